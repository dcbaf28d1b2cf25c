"""Defects a hostile review found in the services and the maintenance commands (issue 11,
items 2, 4, 5 and 6), each against real PostgreSQL, with real threads, connections and processes.
"""

from __future__ import annotations

import datetime as dt
import json
import signal
import threading
import time
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, connections, transaction
from django.test import override_settings

from buzz_delivery import models, services
from buzz_delivery.services.runlock import LeaseBusy, RunLease, acquire_run_lease, run_lease
from buzz_delivery.testing import CommunityFactory, advance_to, set_delivery_state
from buzz_delivery.triggers import FENCE_LOCK_NAMESPACE
from tests.conftest import backdate_lease
from tests.operator_support import claimed, lapsed, lease_rows, manage, pending, settled

SHORT_LEASES = {"MIN_LEASE_SECONDS": 1, "MAX_ATTEMPTS": None}


def _sql(statement: str, params: list | None = None) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(statement, params or [])
        return cursor.fetchall() if cursor.description else []


# --- item 2: backoff with unlimited attempts ----------------------------------------------


@pytest.mark.django_db
@override_settings(BUZZ_DELIVERY={"MAX_ATTEMPTS": None, "RETRY_BACKOFF_CAP_SECONDS": 300})
def test_a_retry_on_the_2000th_attempt_waits_the_capped_backoff_instead_of_overflowing(community):
    delivery = pending(community)
    assert delivery.max_attempts is None
    set_delivery_state(delivery.id, attempt=1999)
    claim = services.claim_delivery(community.id, bytes(delivery.target_pubkey))
    assert claim is not None and claim.delivery.attempt == 2000

    assert services.finish_delivery(claim.lease, "retry") == services.Settled("pending")

    (wait,) = _sql(
        "SELECT extract(epoch FROM next_attempt_at - statement_timestamp()) FROM buzz_delivery_delivery WHERE id = %s",
        [delivery.id],
    )[0]
    assert 149 <= wait <= 300  # the capped backoff, with equal jitter: within [1/2, 1] of it


# --- item 6: lease calls inside a caller's transaction --------------------------------------


@pytest.mark.django_db
@override_settings(BUZZ_DELIVERY=SHORT_LEASES)
def test_inside_a_transaction_a_renew_past_the_lease_is_lost_not_granted_in_the_past(community):
    """The test runs inside a transaction (pytest-django's): ``now()`` is its start."""
    assert connection.in_atomic_block
    _, lease = claimed(community)
    services.renew_delivery(lease, 1)
    _sql("SELECT pg_sleep(1.3)")

    assert services.renew_delivery(lease, 1) == services.LeaseLost()
    assert services.finish_delivery(lease, "finished") == services.LeaseLost()


@pytest.mark.django_db
@override_settings(BUZZ_DELIVERY=SHORT_LEASES)
def test_inside_a_transaction_a_renew_grants_a_lease_from_the_statements_clock(community):
    _, lease = claimed(community)
    _sql("SELECT pg_sleep(1.2)")
    renewed = services.renew_delivery(lease, 5)

    assert isinstance(renewed, services.Renewed)
    (clock,) = _sql("SELECT statement_timestamp()")[0]
    assert renewed.lease_until > clock  # with now() it would be the transaction start + 5 s... and
    assert (renewed.lease_until - clock).total_seconds() > 4.5  # ...1.2 s of it already gone
    assert isinstance(services.finish_delivery(renewed.lease, "finished"), services.Settled)


# --- item 4: one tenant's lifecycle move never stalls the fleet-wide maintenance -----------


class _HeldWriter:
    """A transaction on community X that wrote a row and stays open (holds X's fence lock
    shared), and a lifecycle move of X queued behind it (waits for the lock exclusively)."""

    def __init__(self, community: models.Community) -> None:
        self.community = community
        self.wrote = threading.Event()
        self.release = threading.Event()
        self.moved = threading.Event()
        self.errors: list[BaseException] = []

    def _writer(self) -> None:
        try:
            with transaction.atomic():
                _sql("UPDATE buzz_delivery_workflow SET name = name WHERE community_id = %s", [self.community.id])
                self.wrote.set()
                self.release.wait(30)
        except BaseException as exc:  # pragma: no cover - reported by the test
            self.errors.append(exc)
        finally:
            connections.close_all()

    def _mover(self) -> None:
        try:
            services.advance_community(self.community.id, "quiescing")
            self.moved.set()
        except BaseException as exc:  # pragma: no cover
            self.errors.append(exc)
        finally:
            connections.close_all()

    def __enter__(self) -> _HeldWriter:
        self.threads = [threading.Thread(target=self._writer), threading.Thread(target=self._mover)]
        self.threads[0].start()
        assert self.wrote.wait(10)
        self.threads[1].start()
        deadline = time.monotonic() + 10
        while not _exclusive_fence_lock_waiting(self.community.id):
            assert time.monotonic() < deadline, "the lifecycle move never queued for the fence lock"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        for thread in self.threads:
            thread.join(30)
        assert not self.errors, self.errors
        assert self.moved.is_set()


def _exclusive_fence_lock_waiting(community_id) -> bool:
    """Whether a backend of this database waits for ``community_id``'s fence lock exclusively
    (another test's waiter, e.g. a run on another database of the server, is not ours)."""
    rows = _sql(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND NOT granted"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " AND classid = %s AND objsubid = 2 AND objid = (hashtext(%s::text)::bigint & 4294967295)",
        [FENCE_LOCK_NAMESPACE, str(community_id)],
    )
    return rows[0][0] > 0


@pytest.fixture
def stall_guard():
    """Fail (instead of hanging) when a statement waits on a lock for over 60 s: a stall takes
    that long, the bounded wait (FENCE_WAIT_MS, 0.2 s) well under the tests' 30 s bound."""
    _sql("SET lock_timeout = '60s'")
    yield
    _sql("RESET lock_timeout")


@pytest.mark.django_db(transaction=True)
def test_a_lifecycle_move_queued_on_one_community_does_not_stall_the_reap_of_the_others(stall_guard):
    stuck, healthy = CommunityFactory(), CommunityFactory()
    stuck_lapsed = lapsed(stuck)
    healthy_lapsed = [lapsed(healthy) for _ in range(3)]

    with _HeldWriter(stuck):
        started = time.monotonic()
        result = services.reap(batch_size=2)
        took = time.monotonic() - started

    assert took < 30, f"the reap waited {took:.1f}s on another community's fence lock"
    assert result.reclaimed == 3 and result.skipped_busy == 1
    assert {d.status for d in models.WorkflowAgentDelivery.objects.filter(id__in=[d.id for d in healthy_lapsed])} == {
        "pending"
    }
    assert models.WorkflowAgentDelivery.objects.get(id=stuck_lapsed.id).status == "claimed"


@pytest.mark.django_db(transaction=True)
def test_a_lifecycle_move_queued_on_one_community_does_not_stall_the_pruner(stall_guard):
    stuck, healthy = CommunityFactory(), CommunityFactory()
    kept = settled(stuck, age_seconds=86_400 * 40)
    old = [settled(healthy, age_seconds=86_400 * 40) for _ in range(3)]

    with _HeldWriter(stuck):
        started = time.monotonic()
        result = services.prune_deliveries({"finished": dt.timedelta(days=30)}, batch_size=2)
        took = time.monotonic() - started

    assert took < 30, f"the pruner waited {took:.1f}s on another community's fence lock"
    assert result.deleted == {"finished": 3}
    assert not models.WorkflowAgentDelivery.objects.filter(id__in=[d.id for d in old]).exists()
    assert models.WorkflowAgentDelivery.objects.filter(id=kept.id).exists()


# --- item 5: the run lease of the maintenance commands is renewed on a timer -----------------


@pytest.fixture
def slow_reap_updates():
    """Every UPDATE of a delivery takes 1.5 s (a stalled batch)."""
    _sql(
        "CREATE FUNCTION test_slow_update() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "PERFORM pg_sleep(1.5); RETURN NULL; END $$;"
        "CREATE TRIGGER test_slow_update AFTER UPDATE ON buzz_delivery_delivery_queue "
        "FOR EACH STATEMENT EXECUTE FUNCTION test_slow_update()"
    )
    yield
    _sql("DROP TRIGGER IF EXISTS test_slow_update ON buzz_delivery_delivery_queue")
    _sql("DROP FUNCTION IF EXISTS test_slow_update()")


@pytest.fixture
def gated_reap_updates():
    """Every UPDATE of a delivery by another session waits (in short sleeps: a lock wait would
    end at the reaper's lock_timeout) while ``test_reap_gate`` has a row: a batch stalled for
    as long as the test needs, not for a fixed time a loaded machine may outlast. The test's
    own session passes. ``_open_gate()`` ends the stall."""
    _sql(
        "CREATE TABLE test_reap_gate (closed boolean); INSERT INTO test_reap_gate VALUES (true);"
        "GRANT SELECT ON test_reap_gate TO PUBLIC;"
        "CREATE FUNCTION test_gated_update() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "WHILE pg_backend_pid() <> %s AND EXISTS (SELECT FROM test_reap_gate) LOOP PERFORM pg_sleep(0.05); END LOOP; "
        "RETURN NULL; END $$;"
        "CREATE TRIGGER test_gated_update AFTER UPDATE ON buzz_delivery_delivery_queue "
        "FOR EACH STATEMENT EXECUTE FUNCTION test_gated_update()",
        [_sql("SELECT pg_backend_pid()")[0][0]],
    )
    try:
        yield
    finally:
        _open_gate()
        _sql("DROP TRIGGER IF EXISTS test_gated_update ON buzz_delivery_delivery_queue")
        _sql("DROP FUNCTION IF EXISTS test_gated_update()")
        _sql("DROP TABLE IF EXISTS test_reap_gate")


def _open_gate() -> None:
    _sql("DELETE FROM test_reap_gate")


def _updates_at_the_gate() -> int:
    rows = _sql(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event = 'PgSleep'"
        " AND pid <> pg_backend_pid()"
    )
    return rows[0][0]


def _summary(proc) -> tuple[int, dict]:
    out, err = proc.communicate(timeout=60)
    lines = out.strip().splitlines()
    assert lines, err
    return proc.returncode, json.loads(lines[-1])


def _reap_holding_its_lease(lease_seconds: str):
    """A ``reap_deliveries`` process (single-row batches), once it holds its run lease."""
    proc = manage("reap_deliveries", "--json", "--batch-size", "1", "--lease-seconds", lease_seconds)
    deadline = time.monotonic() + 60  # the process's start too (Django's import: seconds on a loaded machine)
    while not lease_rows():
        assert time.monotonic() < deadline, "the run never took its lease"
        time.sleep(0.05)
    return proc


@pytest.mark.django_db(transaction=True)
def test_a_stalled_reap_keeps_its_guard_so_a_second_run_stays_out(community, gated_reap_updates):
    for _ in range(3):
        lapsed(community)
    first = _reap_holding_its_lease("1.5")
    try:
        # Its first batch's UPDATE waits at the gate until the second run has ended: however
        # slowly a loaded machine starts the second process, it finds the first still stalled.
        deadline = time.monotonic() + 30
        while not _updates_at_the_gate():
            assert time.monotonic() < deadline, "the first run's UPDATE never reached the gate"
            time.sleep(0.05)
        time.sleep(2.5)  # past the guard's 1.5 s: only a timer renewal keeps it

        second = manage("reap_deliveries", "--json", "--lease-seconds", "1.5")
        deadline = time.monotonic() + 60
        while second.poll() is None:
            assert _updates_at_the_gate() < 2, "the second run got past the guard: it reaps beside the first"
            assert time.monotonic() < deadline, "the second run did not end"
            time.sleep(0.05)
        code, summary = _summary(second)
        assert (code, summary["outcome"]) == (0, "busy")
    finally:
        _open_gate()

    code, summary = _summary(first)
    assert (code, summary["outcome"], summary["reclaimed"]) == (0, "ok", 3)
    assert lease_rows() == []


@pytest.mark.django_db(transaction=True)
def test_a_run_that_finds_its_guard_lost_after_a_pause_exits_3(community, slow_reap_updates):
    for _ in range(3):
        lapsed(community)
    first = _reap_holding_its_lease("1")
    first.send_signal(signal.SIGSTOP)  # paused past its guard: another run may take over
    try:
        time.sleep(1.5)
        taken = acquire_run_lease("reap_deliveries", 3600, holder="the-other-run")
        assert isinstance(taken, RunLease)
    finally:
        first.send_signal(signal.SIGCONT)

    code, summary = _summary(first)
    assert (code, summary["outcome"]) == (3, "lease_lost")
    assert lease_rows() == [("reap_deliveries", "the-other-run")]


@pytest.mark.django_db(transaction=True)
def test_run_lease_keeps_the_guard_renewed_while_its_block_runs():
    """What the admin's "reap now" holds: renewed on a timer, released at the end."""
    with run_lease("reap_deliveries", 1.2) as lease:
        assert isinstance(lease, RunLease)
        time.sleep(2.5)  # twice the guard's length
        assert isinstance(acquire_run_lease("reap_deliveries", 60, holder="intruder"), LeaseBusy)
    assert lease_rows() == []


# --- item 7: a bad setting stops even a --loop run, with the usage exit code --------------


@pytest.mark.django_db
@pytest.mark.parametrize("command", ["reap_deliveries", "prune_deliveries"])
def test_a_loop_whose_settings_are_bad_exits_2_instead_of_failing_every_pass_forever(command, settings):
    settings.BUZZ_DELIVERY = {"BATCH_SIZE": 0}
    args = ["--loop", "--interval", "0.1"] if command == "reap_deliveries" else ["--older-than", "1d"]

    def too_long(signum: int, frame: object) -> None:
        raise TimeoutError(f"{command} kept running on a setting that fails every pass")

    previous = signal.signal(signal.SIGALRM, too_long)
    signal.setitimer(signal.ITIMER_REAL, 10)
    try:
        with pytest.raises(CommandError) as failure:
            call_command(command, *args, stdout=StringIO(), stderr=StringIO())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert failure.value.returncode == 2
    assert "batch_size" in str(failure.value)


@pytest.mark.django_db(transaction=True)
def test_a_maintenance_batch_takes_fence_locks_only_for_the_communities_it_works_on():
    """Regression: the try-lock once ran on every row scanned, one lock per community of any
    state; with tens of thousands of retiring communities the lock table ran out and every reap
    and prune failed. A batch now locks at most the communities of its own rows."""
    for _ in range(25):  # scanned first: their leases lapsed earlier, their rows finished earlier
        retiring = CommunityFactory()
        backdate_lease(lapsed(retiring).pk, 7200)
        settled(retiring, age_seconds=86_400 * 41)
        advance_to(retiring, "quiescing")
    healthy = CommunityFactory()
    lapsed(healthy)
    settled(healthy, age_seconds=86_400 * 40)

    def advisory_locks_after(work) -> int:
        with transaction.atomic():  # keeps the batch's transaction-scoped locks for the count
            work()
            return _sql("SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'")[0][0]

    assert advisory_locks_after(lambda: services.reap(batch_size=1, max_batches=1)) == 1
    assert advisory_locks_after(lambda: services.prune_deliveries({"finished": dt.timedelta(days=30)})) == 1


@pytest.mark.django_db
def test_a_reap_inside_the_callers_transaction_keeps_its_guard(community, request):
    """Review regression: the keeper renewed on its own connection, which cannot see a lease row
    taken inside the caller's (uncommitted) transaction, so the run "lost" it and exited 3."""
    assert connection.in_atomic_block  # pytest-django's test transaction
    lapsed(community)
    request.getfixturevalue("slow_reap_updates")  # from here on the run lasts past its guard's third
    out = StringIO()

    call_command("reap_deliveries", "--json", "--batch-size", "1", "--lease-seconds", "1.5", stdout=out)

    summary = json.loads(out.getvalue())
    assert (summary["outcome"], summary["reclaimed"]) == ("ok", 1)
