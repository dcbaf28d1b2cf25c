"""The remote workers back off when their claims are refused (issue: every 1 s, whatever the
cause): a claim refused or left without an answer (a 429/503 of a gateway shedding load, the
gateway down, a key not enrolled) is tried again after capped exponential backoff with equal
jitter (``backoff.Retrying``), reset when a claim gets through; a Retry-After is honoured, and
the wait never runs much past ``--idle-exit``. Real workers against a closed port (connection
refused), real threads."""

from __future__ import annotations

import threading
import time

import pytest

from buzz_delivery import backoff
from buzz_delivery.gateway.client import CLAIM_RETRY_BASE, CLAIM_RETRY_MOST, GatewayClient, RemoteWorker
from buzz_delivery.gateway.remote_accept import RemoteAcceptor
from buzz_delivery.gateway.remote_runs import RemoteRunWorker

REFUSED = "http://127.0.0.1:9/gateway/v1"  # nothing listens: every claim is refused at once
WATCH_SECONDS = 6.0


def handler(item):
    return None


def client() -> GatewayClient:
    return GatewayClient(REFUSED, b"\x01" * 32, timeout=2.0)


def test_the_waits_double_from_the_base_with_jitter_up_to_the_cap_and_start_again_on_reset():
    retrying = backoff.Retrying(1.0, 8.0)
    for computed in (1.0, 2.0, 4.0, 8.0, 8.0, 8.0):
        wait = retrying.delay()
        assert computed * backoff.JITTER_LOW <= wait <= computed, (computed, wait)
    retrying.reset()
    assert 0.5 <= retrying.delay() <= 1.0
    for _ in range(5000):  # a long outage: capped, and no overflow
        assert retrying.delay() <= 8.0


def test_a_retry_after_is_honoured_up_to_the_cap_and_a_lower_cap_for_one_call_wins():
    retrying = backoff.Retrying(1.0, 8.0)
    assert retrying.delay(retry_after=5.0) == 5.0
    assert retrying.delay(retry_after=3600.0) == 8.0
    assert retrying.delay(retry_after=float("nan")) <= 4.0  # not a usable number: the backoff alone
    assert retrying.delay(retry_after=30.0, most=1.5) <= 1.5  # e.g. --idle-exit 1.5


@pytest.mark.parametrize(("base", "most"), [(0, 1), (-1, 1), (2, 1), (1, float("inf")), (float("nan"), 1)])
def test_bad_bounds_are_refused(base, most):
    with pytest.raises(ValueError, match="base and most"):
        backoff.Retrying(base, most)


def test_the_claims_defaults_back_off_from_about_a_second():
    assert CLAIM_RETRY_BASE == 1.0 and 10.0 <= CLAIM_RETRY_MOST <= 60.0


def _watch(start, stop) -> None:
    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    time.sleep(WATCH_SECONDS)
    stop()
    thread.join(timeout=CLAIM_RETRY_MOST + 10)
    assert not thread.is_alive()


def test_refused_claims_back_off_in_work_work_runs_and_the_run_acceptor():
    """In 6 s of refusals a worker claimed 6-7 times (once a second; ``work``'s two claimers 12
    or more); backing off from 1 s with jitter (waits within [0.5, 1], [1, 2], [2, 4]...) it
    claims at most 4 times (at 0 s, and not before 0.5, 1.5 and 3.5 s; the next not before
    7.5 s). ``work``'s two claimers share one backoff but each sleeps the wait its own failure
    drew: both fail at 0 s, then one waits the 1st wait and the 3rd, the other the 2nd and the
    4th, so at most 3 claims each (6 in all; CI saw 6 under load)."""
    work = RemoteWorker(client(), handler, wait_seconds=0)
    runs = RemoteRunWorker(client(), handler, wait_seconds=0, accept=False)
    stop_accepting = threading.Event()
    acceptor = RemoteAcceptor(client(), stop=stop_accepting, wait_seconds=0)
    summaries: dict[str, dict] = {}
    watchers = [
        threading.Thread(
            target=_watch,
            args=(lambda: summaries.__setitem__("work", work.run()), lambda: work.request_stop("test")),
        ),
        threading.Thread(
            target=_watch,
            args=(lambda: summaries.__setitem__("runs", runs.run()), lambda: runs.request_stop("test")),
        ),
        threading.Thread(target=_watch, args=(acceptor.run, stop_accepting.set)),
    ]
    for watcher in watchers:
        watcher.start()
    for watcher in watchers:
        watcher.join(timeout=60)
    counts = {
        "work": summaries["work"]["errors"],
        "work-runs": summaries["runs"]["errors"],
        "acceptor": acceptor.counts["claim_errors"],
    }
    assert 2 <= counts["work"] <= 6 and 2 <= counts["work-runs"] <= 4 and 2 <= counts["acceptor"] <= 4, counts


def test_idle_exit_still_ends_a_worker_whose_claims_are_refused_soon_after_5_s():
    """--idle-exit 1: the waits are held to 1 s, so the worker stops once no claim got through for
    UNREACHABLE_IDLE_SECONDS (5 s), not a long backoff later."""
    for build in (
        lambda: RemoteWorker(client(), handler, wait_seconds=0, idle_exit=1.0),
        lambda: RemoteRunWorker(client(), handler, wait_seconds=0, idle_exit=1.0, accept=False),
    ):
        worker = build()  # its 5 s of unreachability count from here
        started = time.monotonic()
        summary = worker.run()
        took = time.monotonic() - started
        assert summary["reason"] in ("idle", "idle_exit"), summary
        assert 5.0 <= took <= 8.0, took
