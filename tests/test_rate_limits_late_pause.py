"""review4: the delivery worker's claim pause after a late take (ab6d0f6 capped ``take``'s
``Wait`` at one period; the worker's other branch, a weight-0 take that is ``Granted`` on a
window exactly used up, computed its pause from the late statement's clock, uncapped)."""

from __future__ import annotations

import datetime as dt
import threading

import pytest

from buzz_delivery.services import ratelimits as rl
from buzz_delivery.testing import frozen_db_clock, random32
from buzz_delivery.worker.runtime import Worker, WorkerConfig
from tests.test_rate_limits import rate_limits


def _handler(delivery):
    return None


@pytest.mark.django_db
def test_a_late_weight_zero_take_on_a_used_up_window_pauses_the_community_at_most_a_period(community):
    period = 60
    start = dt.datetime(2031, 5, 6, 7, 8, 0, tzinfo=dt.UTC)
    with rate_limits(claims={"limit": 3, "period": period}):
        with frozen_db_clock(start + dt.timedelta(seconds=60.25)):  # the row's window: start+60, used up
            assert isinstance(rl.take(community.id, "claims", 3), rl.Granted)
        worker = Worker(
            WorkerConfig(community_id=community.id, target_pubkey=random32(), handler=_handler, rate_key="claims"),
            threading.Event(),
        )
        # A statement whose clock reads 30 s behind (it waited on the row's lock, or a shard's
        # clock behind another's): its weight-0 take counts in the row's newer window, Granted, used up.
        pauses: list[float] = []
        worker._rate_pause = lambda community_id, seconds: pauses.append(seconds)  # type: ignore[method-assign]
        with frozen_db_clock(start + dt.timedelta(seconds=30)):
            assert worker._rate_units(community.id, 5) == 0
    # That window began at or before now by another statement's clock: it ends within a period
    # (was 90 s: the window's end less this statement's clock).
    assert pauses == [period]


@pytest.mark.django_db
def test_after_the_period_is_raised_a_used_up_window_waits_until_the_new_windows_boundary(community):
    """The operator raises a key's period (60 s to an hour): the row's window, aligned on the old
    period, is not on the new one. The next take is granted at the next hour (the statement's
    window, aligned on the new period, is newer than the row's), but a Wait said the row's start
    plus the new period: an hour less 30 s when 30 s was left, and a worker or an agent slept it."""
    start = dt.datetime(2031, 5, 6, 7, 59, 0, tzinfo=dt.UTC)  # a minute's window, 60 s before the hour
    with rate_limits(api={"limit": 1, "period": 60}), frozen_db_clock(start + dt.timedelta(seconds=10)):
        assert isinstance(rl.take(community.id, "api"), rl.Granted)
    with rate_limits(api={"limit": 1, "period": 3600}):
        with frozen_db_clock(start + dt.timedelta(seconds=30)):
            wait = rl.take(community.id, "api")
        with frozen_db_clock(start + dt.timedelta(seconds=60.25)):  # the new period's next window
            assert isinstance(rl.take(community.id, "api"), rl.Granted)
    assert wait == rl.Wait(seconds=pytest.approx(30), used=1, window_start=start)
