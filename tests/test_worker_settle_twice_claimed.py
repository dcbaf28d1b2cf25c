"""The settler's mixed batches when one delivery was claimed twice by the same worker (review of
issue 29): a stale lease's result (its lease lapsed, the delivery claimed again) and the new
claim's result in one batch. Whatever their order, only the new claim's outcome is written (its
own Retry-After, never the stale one's), the stale result is counted ``lease_lost``, and the
other deliveries of the batch settle in the batch statement. A guard: it held before the review."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from django.db import connection

from buzz_delivery import services
from buzz_delivery.services.reaper import reap
from buzz_delivery.worker.handlers import SettleArgs
from buzz_delivery.worker.settler import SettleJob, Settler
from tests.conftest import backdate_lease
from tests.test_settle_batch import claimed, row

pytestmark = pytest.mark.django_db


def reclaimed(lease):
    """The same delivery claimed again after ``lease`` lapsed: a new generation."""
    backdate_lease(lease.delivery_id)
    reap()
    claim = services.claim_delivery(
        lease.community_id, lease.target_pubkey, delivery_id=lease.delivery_id, lease_seconds=30
    )
    assert claim.lease.lease_generation > lease.lease_generation, claim
    return claim.lease


def settle(jobs):
    counts: dict[str, int] = {}

    def count(key: str, n: int) -> None:
        counts[key] = counts.get(key, 0) + n

    Settler(max_batch=100, linger=0, lease_seconds=5, count=count, done=lambda n: None)._settle_batch(jobs)
    return counts


def db_now():
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


@pytest.mark.parametrize("stale_first", [True, False])
def test_a_stale_leases_result_never_settles_the_new_claim(community, message_event, make_binding, stale_first):
    stale = claimed(community, message_event, make_binding)
    current = reclaimed(stale)
    other = claimed(community, message_event, make_binding)
    jobs = [
        SettleJob(stale, SettleArgs("retry", None, "stale", 900.0)),
        SettleJob(other, SettleArgs("failed", "poison", "bad")),
        SettleJob(current, SettleArgs("retry", None, "current", 60.0)),
    ]
    if not stale_first:
        jobs.reverse()
    started = db_now()
    counts = settle(jobs)

    mine = row(current.delivery_id)
    assert (mine["status"], mine["lease_generation"]) == ("pending", current.lease_generation)
    # The current claim's Retry-After (60 s), not the stale one's (900 s).
    assert started + dt.timedelta(seconds=59) <= mine["next_attempt_at"] <= db_now() + dt.timedelta(seconds=61)
    history = json.loads(mine["history"]) if isinstance(mine["history"], str) else mine["history"]
    assert [e["event"] for e in history].count("retry") == 1
    assert row(other.delivery_id)["status"] == "failed"
    assert (counts["lease_lost"], counts["retried"], counts["failed"]) == (1, 1, 1)
