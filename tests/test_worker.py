"""The agent runtime as real processes: ``manage.py run_delivery_worker`` (SPEC section 7).

Each test commits deliveries, runs the worker as a subprocess against the pytest test database
(``transaction=True`` so the subprocess sees committed rows) and judges the rows it leaves.
Leases are 1-2 s (``BUZZ_MIN_LEASE_SECONDS=1``); waits poll the database for a condition.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from buzz_delivery import services
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import DeliveryFactory, random32
from tests.worker_support import one_worker_listening, wait_for_poll_since_listening

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent


def wait_until(condition, timeout: float = 15, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def statuses(ids) -> dict:
    return dict(WorkflowAgentDelivery.objects.filter(id__in=ids).values_list("id", "status"))


def count_claimed(ids) -> int:
    return WorkflowAgentDelivery.objects.filter(id__in=ids, status="claimed").count()


def db_now():
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def commit(make_binding, target: bytes, n: int = 1, **script) -> list:
    return [
        DeliveryFactory(binding=make_binding(target_pubkey=target), trigger_context=script or None).id for _ in range(n)
    ]


def test_a_handler_slower_than_its_lease_keeps_it_by_renewing_and_settles_finished_once(make_binding, start_worker):
    target = random32()
    (delivery_id,) = commit(make_binding, target, sleep=3.5)
    # -v 2: the per-delivery lines (DEBUG) are logged too
    worker = start_worker(target, "--lease-seconds", "1.5", "--max-deliveries", "1", "-v", "2")

    wait_until(lambda: count_claimed([delivery_id]) == 1, what="the claim")
    time.sleep(2.5)  # past the first lease deadline: only renewals keep the lease
    assert services.reap().total == 0
    assert worker.wait() == 0

    row = WorkflowAgentDelivery.objects.get(id=delivery_id)
    assert (row.status, row.lease_generation, row.attempt) == ("finished", 1, 1)
    summary = worker.summary()
    assert summary["claimed"] == summary["finished"] == 1
    assert summary["renewed"] >= 2
    assert summary["lease_lost"] == summary["retried"] == summary["failed"] == 0
    assert worker.log().count("settled delivery=") == 1


def test_the_handler_runs_with_no_transaction_open_anywhere(make_binding, start_worker):
    target = random32()
    ids = commit(make_binding, target, 2, sleep=0.3)
    worker = start_worker(target, "--concurrency", "2", "--max-deliveries", "2", "--lease-seconds", "2")
    assert worker.wait() == 0

    starts = [e for e in worker.handler_events() if e["event"] == "start"]
    assert sorted(e["delivery"] for e in starts) == sorted(str(i) for i in ids)
    assert all(e["in_atomic_block"] is False for e in starts)
    assert all(e["open_transactions_elsewhere"] == 0 for e in starts)


def test_a_killed_worker_leaves_claims_that_the_reaper_returns_and_a_second_worker_settles(make_binding, start_worker):
    target = random32()
    ids = commit(make_binding, target, 2, sleep=60)
    first = start_worker(target, "--concurrency", "2", "--lease-seconds", "1")
    wait_until(lambda: count_claimed(ids) == 2, what="both claims")

    first.proc.send_signal(signal.SIGKILL)
    first.wait()
    assert set(statuses(ids).values()) == {"claimed"}
    assert services.reap().total == 0  # leases still running: nothing to reap yet

    wait_until(
        lambda: WorkflowAgentDelivery.objects.filter(id__in=ids, lease_until__lt=db_now()).count() == 2,
        what="the leases to lapse",
    )
    assert services.reap().reclaimed == 2
    rows = WorkflowAgentDelivery.objects.filter(id__in=ids)
    assert {(r.status, r.lease_generation) for r in rows} == {("pending", 2)}

    second = start_worker(
        target, "--max-deliveries", "2", "--lease-seconds", "2", handler="tests.worker_handlers:finish"
    )
    assert second.wait() == 0
    rows = WorkflowAgentDelivery.objects.filter(id__in=ids)
    assert {(r.status, r.lease_generation, r.attempt) for r in rows} == {("finished", 3, 2)}
    assert second.summary()["finished"] == 2


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_ends_claiming_lets_the_in_flight_delivery_settle_and_exits_0(make_binding, start_worker, signum):
    target = random32()
    ids = commit(make_binding, target, 3, sleep=2)
    worker = start_worker(target, "--lease-seconds", "2", "-v", "2")  # -v 2: per-delivery lines too
    wait_until(lambda: count_claimed(ids) == 1, what="the first claim")

    signalled_at = db_now()
    worker.proc.send_signal(signum)
    assert worker.wait() == 0

    rows = {r.id: r for r in WorkflowAgentDelivery.objects.filter(id__in=ids)}
    done = [r for r in rows.values() if r.status == "finished"]
    assert len(done) == 1 and done[0].finished_at > signalled_at
    untouched = [r for r in rows.values() if r.status == "pending"]
    assert len(untouched) == 2 and all(r.lease_generation == 0 for r in untouched)
    summary = worker.summary()
    assert list(summary) == [
        "claimed",
        "finished",
        "failed",
        "retried",
        "lease_lost",
        "renewed",
        "timed_out",
        "settle_errors",
        "abandoned",
        "claim_statements",
        "settle_statements",
        "loop_stalls",
        "rate_waits",
        "hints_dropped",
        "pending_retry",
        "reason",
        "exit_code",
    ]
    assert (summary["reason"], summary["exit_code"]) == (signum.name, 0)
    assert (summary["claimed"], summary["finished"], summary["failed"], summary["lease_lost"]) == (1, 1, 0, 0)
    log = worker.log()
    stopping = f"stopping reason={signum.name}"
    assert log.index(stopping) < log.index("settled delivery=") < log.index("stopped ")


def test_permanent_failures_fail_and_ordinary_exceptions_retry(make_binding, start_worker):
    target = random32()
    (by_subclass,) = commit(make_binding, target, **{"raise": "permanent"})
    (by_attribute,) = commit(make_binding, target, **{"raise": "permanent_attr"})
    (ordinary,) = commit(make_binding, target, **{"raise": "ordinary"})
    (fine,) = commit(make_binding, target)
    worker = start_worker(target, "--concurrency", "2", "--max-deliveries", "4", "--lease-seconds", "2")
    assert worker.wait() == 0

    rows = {r.id: r for r in WorkflowAgentDelivery.objects.filter(id__in=[by_subclass, by_attribute, ordinary, fine])}
    assert (rows[by_subclass].status, rows[by_subclass].failure_code) == ("failed", "BadPayload")
    assert rows[by_subclass].failure_message == "payload cannot be parsed"
    assert (rows[by_attribute].status, rows[by_attribute].failure_code) == ("failed", "QuotaGone")
    retried = rows[ordinary]
    assert (retried.status, retried.attempt, retried.failure_code) == ("pending", 1, None)
    assert retried.next_attempt_at > db_now()
    assert rows[fine].status == "finished"
    summary = worker.summary()
    assert (summary["claimed"], summary["finished"], summary["failed"], summary["retried"]) == (4, 1, 2, 1)
    assert "handler_error delivery=" in worker.log()


def test_a_lease_taken_away_mid_handler_drops_the_result(community, make_binding, start_worker):
    target = random32()
    (delivery_id,) = commit(make_binding, target, sleep=3)
    worker = start_worker(target, "--lease-seconds", "1.5", "--max-deliveries", "1")
    wait_until(lambda: count_claimed([delivery_id]) == 1, what="the claim")

    assert services.force_fail_delivery(community.id, delivery_id).done
    assert worker.wait() == 0

    row = WorkflowAgentDelivery.objects.get(id=delivery_id)
    assert (row.status, row.failure_code) == ("failed", "operator_force_failed")
    summary = worker.summary()
    assert (summary["lease_lost"], summary["finished"]) == (1, 0)
    assert "lease_lost delivery=" in worker.log()


def test_a_wake_hint_gets_a_new_delivery_claimed_long_before_the_next_poll(make_binding, start_worker):
    target = random32()
    worker = start_worker(target, "--poll-interval", "600", "--max-deliveries", "1", "--lease-seconds", "2")
    wait_until(one_worker_listening, what="the worker to LISTEN")
    # Its poll after the LISTEN found nothing: it sleeps until a hint, or for 600 s.
    wait_for_poll_since_listening()
    (delivery_id,) = commit(make_binding, target)

    assert worker.wait(timeout=60) == 0  # without the hint, the next poll is 600 s away
    assert WorkflowAgentDelivery.objects.get(id=delivery_id).status == "finished"


def test_handler_threads_work_a_backlog_in_parallel_each_delivery_once_then_exit_when_idle(make_binding, start_worker):
    target = random32()
    ids = commit(make_binding, target, 20, sleep=0.2)
    worker = start_worker(target, "--concurrency", "4", "--idle-exit", "1", "--lease-seconds", "5")
    assert worker.wait() == 0

    rows = WorkflowAgentDelivery.objects.filter(id__in=ids)
    assert {(r.status, r.lease_generation) for r in rows} == {("finished", 1)}
    summary = worker.summary()
    assert (summary["claimed"], summary["finished"]) == (20, 20)
    events = sorted(
        (e["time"], +1 if e["event"] == "start" else -1) for e in worker.handler_events()
    )  # fmt: skip
    running, most = 0, 0
    for _, step in events:
        running += step
        most = max(most, running)
    assert 1 < most <= 4
    assert "stopping reason=idle_exit" in worker.log()


def test_a_worker_whose_database_connections_are_cut_reconnects_and_carries_on(make_binding, start_worker):
    target = random32()
    (slow,) = commit(make_binding, target)
    worker = start_worker(
        target, "--max-deliveries", "2", "--lease-seconds", "3", handler="tests.worker_handlers:sleep_without_database"
    )
    wait_until(lambda: count_claimed([slow]) == 1, what="the claim")

    with connection.cursor() as cursor:  # what a database restart does to every open connection
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        # The dispatcher and the listener are connected by now; the handler and renewer soon after.
        assert cursor.fetchone()[0] >= 2
    (later,) = commit(make_binding, target)

    assert worker.wait() == 0
    assert statuses([slow, later]) == {slow: "finished", later: "finished"}
    assert worker.summary()["finished"] == 2
    assert "db_unavailable" in worker.log()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--target", "zz" * 32),
        ("--target", "ab" * 31),
        ("--community", "not-a-uuid"),
        ("--concurrency", "0"),
        ("--batch-size", "1001"),
        ("--poll-interval", "-1"),
        ("--renew-fraction", "1"),
        ("--idle-exit", "nan"),
        ("--lease-seconds", "100000"),
        ("--handler", "tests.worker_handlers:no_such_handler"),
    ],
)
def test_bad_options_are_refused_naming_the_option(community, option, value):
    args = {"--community": str(community.id), "--target": "ab" * 32, "--handler": "tests.worker_handlers:finish"}
    args[option] = value
    with pytest.raises(CommandError, match=option):
        call_command("run_delivery_worker", *[x for pair in args.items() for x in pair])


def test_a_handler_raising_a_base_exception_fails_that_delivery_and_the_worker_serves_the_rest(
    make_binding, start_worker
):
    """Regression: a BaseException (CancelledError) used to kill the handler thread while the
    dispatcher kept claiming and the renewer kept those leases alive, never handled. It then
    stopped the worker (a retry, exit 1); since issue 28 it fails only its delivery, with its
    class name as the code, and the same thread handles the rest (tests/test_worker_poison.py)."""
    target = random32()
    (first,) = commit(make_binding, target, **{"raise": "cancelled"})
    rest = commit(make_binding, target, 2)
    worker = start_worker(target, "--lease-seconds", "2", "--concurrency", "1", "--idle-exit", "1")

    assert worker.wait(timeout=30) == 0, worker.log()

    row = WorkflowAgentDelivery.objects.get(id=first)
    assert (row.status, row.failure_code, row.attempt) == ("failed", "CancelledError", 1)
    assert set(statuses(rest).values()) == {"finished"}
    assert count_claimed([first, *rest]) == 0
