"""The worker against hostile deliveries and handlers (issue 11, items 1, 3 and 8), as real processes.

No property of one delivery may stop a worker; a worker that stops on an internal error, or
that gives up leases, says so with its exit code; a handler that never returns cannot hold its
delivery forever; a lease is (delivery, generation), and a holder releases only its own.
"""

from __future__ import annotations

import datetime as dt
import signal
import time

import pytest
from django.db import connection

from buzz_delivery import services
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import DeliveryFactory, random32
from buzz_delivery.worker.handlers import PermanentFailure, settle_args_for, storable_text
from tests.test_worker import commit, count_claimed, db_now, statuses, wait_until
from tests.worker_support import one_worker_listening

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def spawn(start_worker):
    """``spawn(target, *options)`` starts ``run_delivery_worker`` (tests/test_worker.py)."""
    return start_worker


def _poison_trigger(message: str) -> None:
    """A database that refuses one delivery's settle: an UPDATE writing ``message`` raises."""
    with connection.cursor() as cursor:
        # One statement per execute: Citus propagates DDL statement by statement.
        cursor.execute(
            "CREATE FUNCTION test_refuse_settle() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"IF NEW.failure_message = '{message}' THEN RAISE EXCEPTION 'refused by a test trigger'; END IF; "
            "RETURN NEW; END $$"
        )
        cursor.execute(
            "CREATE TRIGGER test_refuse_settle BEFORE UPDATE ON buzz_delivery_delivery_record "
            "FOR EACH ROW EXECUTE FUNCTION test_refuse_settle()"
        )


@pytest.fixture
def drop_test_triggers():
    yield
    with connection.cursor() as cursor:
        cursor.execute("DROP TRIGGER IF EXISTS test_refuse_settle ON buzz_delivery_delivery_record")
        cursor.execute("DROP FUNCTION IF EXISTS test_refuse_settle()")


# --- item 1: text from handlers, and the exit code ---------------------------------------------


def test_handler_text_is_made_storable_and_bounded():
    class Bad(PermanentFailure):
        pass

    args = settle_args_for(Bad("a\x00b\ud800" + "x" * 20_000))
    assert args.outcome == "failed" and args.failure_code == "Bad"
    assert "\x00" not in args.failure_message and args.failure_message.startswith("a\\x00b\\ud800")
    args.failure_message.encode("utf-8")  # storable: no lone surrogate is left
    assert len(args.failure_message) == 10_000
    assert storable_text("\udfff" * 100, 64).encode("utf-8") and len(storable_text("é" * 100, 64)) == 64


def test_deliveries_whose_handler_text_postgresql_cannot_store_settle_and_the_worker_goes_on(make_binding, spawn):
    target = random32()
    nul = commit(make_binding, target, **{"raise": "nul_permanent"})[0]
    surrogate = commit(make_binding, target, **{"raise": "surrogate_ordinary"})[0]
    unprintable = commit(make_binding, target, **{"raise": "unprintable"})[0]
    fine = commit(make_binding, target, 3)
    worker = spawn(target, "--concurrency", "2", "--idle-exit", "1.5", "--lease-seconds", "5")

    assert worker.wait() == 0, worker.log()

    rows = {r.id: r for r in WorkflowAgentDelivery.objects.filter(id__in=[nul, surrogate, unprintable])}
    assert rows[nul].status == "failed" and rows[nul].failure_code == "BadPayload"
    assert (
        rows[nul].failure_message.startswith("byte \\x00 in the payload") and len(rows[nul].failure_message) == 10_000
    )
    for retried in (surrogate, unprintable):  # retried: pending after its backoff, claimed once
        assert (rows[retried].status, rows[retried].attempt) == ("pending", 1)
    assert set(statuses(fine).values()) == {"finished"}
    summary = worker.summary()
    assert (summary["finished"], summary["failed"], summary["retried"]) == (3, 1, 2)
    assert (summary["reason"], summary["exit_code"]) == ("idle_exit", 0)
    assert "worker_error" not in worker.log()


def test_a_settle_the_database_refuses_leaves_that_lease_to_lapse_and_the_worker_goes_on(
    make_binding, spawn, drop_test_triggers
):
    """Same class of defect as item 1: anything one delivery's settle raises stays with it."""
    target = random32()
    _poison_trigger("payload cannot be parsed")
    (poisoned,) = commit(make_binding, target, **{"raise": "permanent"})  # message "payload cannot be parsed"
    fine = commit(make_binding, target, 2)
    worker = spawn(target, "--idle-exit", "1.5", "--lease-seconds", "5")

    assert worker.wait() == 0, worker.log()

    assert WorkflowAgentDelivery.objects.get(id=poisoned).status == "claimed"  # left to lapse
    assert set(statuses(fine).values()) == {"finished"}
    summary = worker.summary()
    assert (summary["settle_errors"], summary["finished"]) == (1, 2)
    assert "settle_error delivery=" in worker.log()


def test_a_worker_stopped_by_an_internal_error_exits_non_zero_and_says_why(make_binding, spawn):
    """Issue 28: a handler's BaseException is now that delivery's failure (test_worker_poison);
    an internal error is one of the runtime's own threads dying, simulated by raising SystemExit
    into a handler thread while the runtime's code runs there."""
    target = random32()
    commit(make_binding, target, **{"raise": "kill_thread"})
    worker = spawn(target, "--lease-seconds", "2")

    assert worker.wait() == 1
    summary = worker.summary()
    assert summary["reason"] == "handler_thread_died" and summary["exit_code"] == 1
    assert "stopped reason=handler_thread_died exit_code=1" in worker.log()


# --- item 3: leases are (delivery, generation) ------------------------------------------------


def test_a_delivery_requeued_and_claimed_again_by_the_same_worker_keeps_its_new_lease(community, make_binding, spawn):
    target = random32()
    (delivery_id,) = commit(make_binding, target, sleep=4)
    worker = spawn(target, "--concurrency", "2", "--lease-seconds", "1.5", "--idle-exit", "2")
    wait_until(lambda: count_claimed([delivery_id]) == 1, what="the first claim")
    time.sleep(2.5)  # the second run must outlive the first's release by more than a lease

    # An operator force-fails and requeues it while the first handler still runs; the same
    # worker claims it again on its second handler thread.
    assert services.force_fail_delivery(community.id, delivery_id).done
    assert services.requeue_delivery(community.id, delivery_id).done
    wait_until(lambda: count_claimed([delivery_id]) == 1, what="the second claim")
    second_generation = WorkflowAgentDelivery.objects.get(id=delivery_id).lease_generation

    assert worker.wait(timeout=30) == 0, worker.log()
    row = WorkflowAgentDelivery.objects.get(id=delivery_id)
    # The first handler's release must not have stopped the renewal of the second lease.
    assert (row.status, row.lease_generation) == ("finished", second_generation)
    summary = worker.summary()
    assert (summary["claimed"], summary["finished"], summary["lease_lost"]) == (2, 1, 1)


# --- item 8: deadlines and the shutdown grace ---------------------------------------------------


FAST_BACKOFF = {"BUZZ_RETRY_BACKOFF_BASE_SECONDS": "0.2"}


def test_a_hung_handler_hands_its_delivery_back_at_its_deadline_so_attempts_apply_and_it_ends_failed(
    make_binding, spawn
):
    target = random32()
    (hung,) = commit(make_binding, target, sleep=600)
    worker = spawn(
        target, "--concurrency", "2", "--lease-seconds", "1", "--handler-timeout", "1.5", "--shutdown-grace", "600",
        **FAST_BACKOFF,
    )  # fmt: skip

    # At the deadline: a retry (attempt 1). Each later claim finds the first handler still
    # hanging in this worker and is retried without running, until the attempts (3) run out.
    wait_until(
        lambda: WorkflowAgentDelivery.objects.get(id=hung).status == "failed",
        timeout=15,
        what="the hung delivery's attempts to run out",
    )
    row = WorkflowAgentDelivery.objects.get(id=hung)
    assert (row.attempt, row.failure_code) == (3, "attempts_exhausted")
    later = commit(make_binding, target, 2)  # the other handler thread still serves the others
    wait_until(lambda: set(statuses(later).values()) == {"finished"}, what="the later deliveries")
    assert services.reap().total == 0  # nothing was left for the reaper

    worker.proc.send_signal(signal.SIGTERM)
    # A handler past its deadline is not waited for: a stop that waited for it would wait the
    # whole shutdown grace (600 s here), the handler sleeping 600 s. The stop itself and the
    # process's exit take well under a second; 60 s leaves a loaded machine room.
    assert worker.wait(timeout=60) == 3  # the hung handler's lease was given up
    summary = worker.summary()
    assert (summary["timed_out"], summary["abandoned"], summary["finished"]) == (1, 1, 2)
    assert (summary["claimed"], summary["retried"], summary["failed"]) == (5, 2, 1)
    assert summary["reason"] == "SIGTERM"
    assert "handler_timeout delivery=" in worker.log()


def test_a_delivery_that_always_hangs_never_takes_more_than_one_thread_with_unlimited_attempts(
    settings, make_binding, spawn
):
    settings.BUZZ_DELIVERY = {**settings.BUZZ_DELIVERY, "MAX_ATTEMPTS": None}  # stored on the row at commit
    target = random32()
    (poison,) = commit(make_binding, target, sleep=600)
    worker = spawn(target, "--concurrency", "2", "--lease-seconds", "1", "--handler-timeout", "1", **FAST_BACKOFF)
    wait_until(lambda: WorkflowAgentDelivery.objects.get(id=poison).attempt >= 4, timeout=20, what="re-claims")

    assert worker.proc.poll() is None  # still serving: one hung thread, the other free
    later = commit(make_binding, target, 2)
    wait_until(lambda: set(statuses(later).values()) == {"finished"}, what="the other deliveries")
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait() == 3
    assert worker.summary()["timed_out"] == 1


def test_a_hung_handler_whose_lease_was_lost_still_counts_as_hung(community, make_binding, spawn):
    """Review regression: the deadline was only checked for leases still being renewed."""
    target = random32()
    (hung,) = commit(make_binding, target, sleep=120)
    worker = spawn(target, "--lease-seconds", "2", "--handler-timeout", "2", "--shutdown-grace", "30")
    wait_until(lambda: count_claimed([hung]) == 1, what="the claim")
    assert services.force_fail_delivery(community.id, hung).done  # the renewer will find it lost

    assert worker.wait(timeout=15) == 3  # its only thread hangs: it stops by itself
    assert worker.summary()["reason"] == "handlers_hung"


@pytest.mark.parametrize("option", [("--max-deliveries", "1"), ("--idle-exit", "1")])
def test_a_hung_handler_does_not_keep_a_worker_from_its_quota_or_idle_exit(make_binding, spawn, option):
    """Review regression: both exits waited for every handler, hung ones included."""
    target = random32()
    commit(make_binding, target, sleep=120)
    worker = spawn(target, "--concurrency", "2", *option, "--lease-seconds", "2", "--handler-timeout", "1")

    # From the spawn (a loaded machine takes seconds to start Django), not the 120 s the handler wants.
    assert worker.wait(timeout=60) == 3  # stopped, and says the hung handler's lease was given up
    summary = worker.summary()
    assert (summary["timed_out"], summary["abandoned"]) == (1, 1)
    assert summary["reason"] == ("max_deliveries" if option[0] == "--max-deliveries" else "idle_exit")


def test_a_handler_base_exception_during_the_drain_fails_that_delivery_and_the_stop_stays_clean(make_binding, spawn):
    """Was: the drain's handler error reported as the reason (exit 1). Issue 28: a handler's
    BaseException ends that delivery (failed, its class name as the code), never the worker."""
    target = random32()
    (d,) = commit(make_binding, target, sleep=1.5, **{"raise": "cancelled"})
    worker = spawn(target, "--lease-seconds", "2")
    wait_until(lambda: count_claimed([d]) == 1, what="the claim")
    worker.proc.send_signal(signal.SIGTERM)

    assert worker.wait() == 0, worker.log()
    summary = worker.summary()
    assert (summary["reason"], summary["failed"]) == ("SIGTERM", 1)
    row = WorkflowAgentDelivery.objects.get(id=d)
    assert (row.status, row.failure_code) == ("failed", "CancelledError")


def test_a_signal_after_an_internal_error_does_not_hide_it(make_binding, spawn):
    """Review regression: the signal handler overwrote the error reason with SIGTERM. (Issue 28:
    the internal error is now a handler thread dying, see above.)"""
    target = random32()
    (d,) = commit(make_binding, target, sleep=1.0, **{"raise": "kill_thread"})
    worker = spawn(target, "--lease-seconds", "5", "--concurrency", "2")
    wait_until(lambda: count_claimed([d]) == 1, what="the claim")
    with connection.cursor() as cursor:  # autocommit: a transaction of its own holds the lock
        cursor.execute("BEGIN; LOCK TABLE buzz_delivery_delivery_record IN ACCESS EXCLUSIVE MODE")
        time.sleep(2.0)  # the dispatcher's next poll waits on the lock; the handler raises meanwhile
        worker.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        cursor.execute("COMMIT")

    assert worker.wait() == 1
    assert worker.summary()["reason"] == "handler_thread_died"


def test_a_settle_under_way_at_the_give_up_is_not_counted_abandoned(make_binding, spawn):
    """Review regression: the summary said abandoned=1 finished=0 while the row ended finished."""
    target = random32()
    (d,) = commit(make_binding, target, sleep=0.5)
    worker = spawn(target, "--lease-seconds", "5", "--shutdown-grace", "2")
    wait_until(lambda: count_claimed([d]) == 1, what="the claim")
    with connection.cursor() as cursor:
        cursor.execute("SELECT community_id FROM buzz_delivery_delivery WHERE id = %s", [d])
        (community_id,) = cursor.fetchone()
        cursor.execute("BEGIN")
        cursor.execute(  # the settle waits (the community named: a row lock Citus can route)
            "SELECT 1 FROM buzz_delivery_delivery_record WHERE community_id = %s AND id = %s FOR UPDATE",
            [community_id, d],
        )
        # Its 0.5 s handler over (a loaded machine may take longer than the 2 s grace to run it):
        # the SIGTERM finds its settle under way, not a handler to give up.
        wait_until(lambda: [e["event"] for e in worker.handler_events()] == ["start", "end"], what="the handler")
        worker.proc.send_signal(signal.SIGTERM)
        time.sleep(3)  # past the grace, the settle still waiting on the row
        cursor.execute("COMMIT")

    assert worker.wait() == 0  # nothing was given up: the settle under way finished
    summary = worker.summary()
    assert (summary["abandoned"], summary["finished"]) == (0, 1)
    assert statuses([d])[d] == "finished"


def test_a_handler_past_the_deliverys_expires_at_is_no_longer_renewed(make_binding, spawn):
    target = random32()
    worker = spawn(target, "--concurrency", "2", "--lease-seconds", "1.5")
    # Started and listening before the delivery exists: on a loaded machine the process may take
    # longer to start than the delivery has to live (and a SIGTERM before its handler is set kills it).
    wait_until(one_worker_listening, timeout=60, what="the worker to listen")
    delivery = DeliveryFactory(
        binding=make_binding(target_pubkey=target),
        trigger_context={"sleep": 30},
        expires_at=db_now() + dt.timedelta(seconds=2),
    )
    wait_until(lambda: count_claimed([delivery.id]) == 1, what="the claim")

    wait_until(lambda: services.reap().expired == 1, timeout=10, what="the delivery to expire")
    assert WorkflowAgentDelivery.objects.get(id=delivery.id).failure_code == "delivery_expired"
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait() == 3
    assert worker.summary()["timed_out"] == 1


def test_a_worker_whose_every_handler_thread_hung_stops_with_exit_code_3(make_binding, spawn):
    target = random32()
    commit(make_binding, target, sleep=600)
    worker = spawn(target, "--lease-seconds", "1", "--handler-timeout", "1")

    # From the spawn (a loaded machine takes seconds to start Django), not the 600 s the handler wants.
    assert worker.wait(timeout=60) == 3
    assert worker.summary()["reason"] == "handlers_hung"


def test_a_stopping_worker_gives_up_in_flight_leases_after_the_grace_and_exits_3(make_binding, spawn):
    target = random32()
    (slow,) = commit(make_binding, target, sleep=600)
    worker = spawn(target, "--lease-seconds", "1", "--shutdown-grace", "1")
    wait_until(lambda: count_claimed([slow]) == 1, what="the claim")

    worker.proc.send_signal(signal.SIGTERM)
    # The 1 s grace and the process's exit (under 2 s here), not the 600 s the handler wants:
    # 60 s leaves a loaded machine room and still catches a grace overrun ten times over.
    assert worker.wait(timeout=60) == 3
    summary = worker.summary()
    assert (summary["abandoned"], summary["finished"], summary["reason"]) == (1, 0, "SIGTERM")
    assert WorkflowAgentDelivery.objects.get(id=slow).status == "claimed"  # left to lapse, not settled
    wait_until(lambda: services.reap().reclaimed == 1, timeout=60, what="the given-up lease to lapse")


def test_a_second_signal_gives_up_at_once(make_binding, spawn):
    target = random32()
    (slow,) = commit(make_binding, target, sleep=20)
    worker = spawn(target, "--lease-seconds", "1", "--shutdown-grace", "60")
    wait_until(lambda: count_claimed([slow]) == 1, what="the claim")

    worker.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert worker.proc.poll() is None  # still waiting within its grace
    worker.proc.send_signal(signal.SIGINT)
    # At once: well within the 20 s the handler wants (and the 60 s grace), with room for a loaded exit.
    assert worker.wait(timeout=15) == 3
    assert worker.summary()["abandoned"] == 1
