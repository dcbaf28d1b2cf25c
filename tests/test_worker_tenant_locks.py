"""One community's lock waits never hold up the other communities a worker serves (docs/security.md).

A worker process serving several communities renews and settles their leases on one thread
each. A lifecycle move of community A that waits behind a long transaction of A's own code
holds A's community row, and every write of A's rows queues behind the move: A's renewals and
settles cannot go through. They wait a bounded time (``lock_timeout``), then A is left for a
while and B's leases are renewed and settled meanwhile; A's results are settled again with the
same leases once the move is through. Waits poll the database for a condition; nothing is timed.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import psycopg
import pytest
from django.db import OperationalError, connection, transaction
from django.test import override_settings

from buzz_delivery import services
from buzz_delivery.models import Community, WorkflowAgentDelivery
from buzz_delivery.services import LeaseLost
from buzz_delivery.services.db import bound_lock_waits, lock_wait_timed_out, lock_waits_bounded
from buzz_delivery.testing import CommunityFactory, DeliveryFactory, random32
from project.database_url import database_url
from tests.test_worker import commit, count_claimed, statuses, wait_until
from tests.test_worker_pairs import other_community_binding

pytestmark = pytest.mark.django_db(transaction=True)


class _Probed(Exception):
    """The probe's write went through: rolled back."""


def a_write_waits(community_id: uuid.UUID) -> bool:
    """Whether a write of the community's rows now waits for a lock (it waited past 100 ms; the
    probe is rolled back either way)."""
    try:
        with transaction.atomic():
            bound_lock_waits(100)
            with connection.cursor() as cursor:
                cursor.execute("UPDATE buzz_delivery_workflow SET name = name WHERE community_id = %s", [community_id])
            raise _Probed
    except _Probed:
        return False
    except OperationalError as exc:
        if lock_wait_timed_out(exc):
            return True
        raise


@contextmanager
def move_stuck_behind_a_long_transaction(
    community_id: uuid.UUID, *, rolled_back: bool = False
) -> Iterator[Future[Community]]:
    """A transaction of the community's own (a write of its events, left open) and a lifecycle
    move of the community (``advance_community`` to ``quiescing``, in a thread) waiting behind
    it; yields the move's future once the community's writes queue behind the move. On exit the
    long transaction commits, and the move goes through (``rolled_back``: then its transaction
    rolls back, as an operator's move given up, and the community stays active: its writes go
    through from then on)."""
    holder = psycopg.connect(database_url(connection.settings_dict))
    pool = ThreadPoolExecutor(max_workers=1)

    def move() -> Community:
        try:
            if not rolled_back:
                return services.advance_community(community_id, "quiescing")
            with transaction.atomic():
                moved = services.advance_community(community_id, "quiescing")
                transaction.set_rollback(True)
            return moved
        finally:
            connection.close()

    try:
        holder.execute("UPDATE buzz_delivery_event SET content = content WHERE community_id = %s", [community_id])
        moving = pool.submit(move)
        wait_until(lambda: a_write_waits(community_id), timeout=30, what="the writes to queue behind the move")
        assert not moving.done()
        yield moving
    finally:
        holder.commit()
        holder.close()
        pool.shutdown(wait=True)


def backends_waiting_for_a_lock() -> int:
    """Sessions of the database waiting for a lock now (on a Citus cluster, on every node:
    a statement routed to a worker waits there)."""
    from tests.citus_support import CITUS_MODE

    view = "citus_stat_activity" if CITUS_MODE else "pg_stat_activity"
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {view} WHERE wait_event_type = 'Lock'")
        return cursor.fetchone()[0]


def lock_timeout() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        return cursor.fetchone()[0]


def test_a_bounded_renewal_behind_a_stuck_move_gives_up_changes_nothing_and_leaves_no_bound_behind(
    community, make_binding
):
    delivery = DeliveryFactory(binding=make_binding())
    claim = services.claim_delivery(community.id, bytes(delivery.target_pubkey), lease_seconds=30)
    assert claim is not None
    session_default = lock_timeout()

    with move_stuck_behind_a_long_transaction(community.id) as moving:
        with lock_waits_bounded(100), pytest.raises(OperationalError) as raised:
            services.renew_delivery(claim.lease, 30)
        assert lock_wait_timed_out(raised.value)
        assert lock_timeout() == session_default  # the bound was the statement's only
        delivery.refresh_from_db()
        assert (delivery.status, delivery.renewals, delivery.lease_until) == ("claimed", 0, claim.lease.lease_until)
        assert not moving.done()
    assert moving.result(timeout=30).deletion_state == "quiescing"
    with lock_waits_bounded(100):  # the move is through: judged at once, as without a bound
        assert isinstance(services.renew_delivery(claim.lease, 30), LeaseLost)
        assert isinstance(services.finish_delivery(claim.lease, "finished"), LeaseLost)
    assert lock_timeout() == session_default


@contextmanager
def statement_timeout(milliseconds: int) -> Iterator[None]:
    with connection.cursor() as cursor:
        cursor.execute(f"SET statement_timeout = {int(milliseconds)}")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET statement_timeout")


def claim_state(ids) -> dict:
    return {
        row[0]: row[1:]
        for row in WorkflowAgentDelivery.objects.filter(id__in=ids).values_list(
            "id", "status", "lease_generation", "attempt"
        )
    }


@pytest.mark.parametrize("limited", [False, True], ids=["plain", "under_limits"])
def test_a_bounded_claim_behind_a_stuck_move_gives_up_and_claims_nothing(community, make_binding, limited):
    """A claim (polled or hinted; under concurrency limits, whose hinted form runs a transaction
    of its own) waits for a lock at most the bound, and then claimed nothing."""
    target = random32()
    ids = [DeliveryFactory(binding=make_binding(target_pubkey=target)).id for _ in range(2)]
    limits = {"CONCURRENCY_LIMITS": {"target": 5}} if limited else {}
    with (
        override_settings(BUZZ_DELIVERY=limits),
        move_stuck_behind_a_long_transaction(community.id) as moving,
        statement_timeout(10_000),  # an unbounded claim would wait until the move is through
    ):
        for claim in (
            lambda: services.claim_deliveries(community.id, target, limit=5, lease_seconds=30),
            lambda: services.claim_delivery(community.id, target, delivery_id=ids[0], lease_seconds=30),
        ):
            with lock_waits_bounded(100), pytest.raises(OperationalError) as raised:
                claim()
            assert lock_wait_timed_out(raised.value)
        assert claim_state(ids) == dict.fromkeys(ids, ("pending", 0, 0))
        assert not moving.done()
    assert moving.result(timeout=30).deletion_state == "quiescing"


def renewals(ids) -> dict:
    return dict(WorkflowAgentDelivery.objects.filter(id__in=ids).values_list("id", "renewals"))


def test_a_lifecycle_move_stuck_in_one_community_delays_no_renewal_or_settle_of_another(
    community, make_binding, start_worker, tmp_path
):
    a_target, b_target = random32(), random32()
    other, make_other = other_community_binding()
    gate_a, gate_b = tmp_path / "gate-a", tmp_path / "gate-b"
    (a_early,) = commit(make_binding, a_target, 1, wait_for=str(gate_a))  # returns while A is stuck: a settle
    (a_late,) = commit(make_binding, a_target, 1, wait_for=str(gate_b))  # held while A is stuck: renewals
    b_ids = commit(make_other, b_target, 2, wait_for=str(gate_b))
    # Leases of 1.5 s, renewed every 0.5 s: B's lapse unless renewed while A is stuck.
    worker = start_worker(
        a_target,
        *("--pair", f"{other.id}:{b_target.hex()}"),
        *("--concurrency", "4", "--lease-seconds", "1.5", "--max-deliveries", "4"),
    )
    wait_until(lambda: count_claimed([a_early, a_late, *b_ids]) == 4, what="the four claims")

    with move_stuck_behind_a_long_transaction(community.id) as moving:
        gate_a.touch()  # A's first handler returns: its settle meets the move
        wait_until(
            lambda: any(e["event"] == "end" and e["delivery"] == str(a_early) for e in worker.handler_events()),
            what="A's first handler to return",
        )
        # B's leases are renewed all along (three renewals: a whole lease's worth, each within
        # the lease of the one before), while A's renewals and settle cannot go through.
        before = renewals(b_ids)
        wait_until(
            lambda: all(n >= before[i] + 3 for i, n in renewals(b_ids).items()),
            timeout=30,
            what="B's leases to be renewed while A's move is stuck",
        )
        gate_b.touch()  # B's handlers (and A's second) return: B's settle goes through meanwhile
        wait_until(
            lambda: set(statuses(b_ids).values()) == {"finished"},
            timeout=30,
            what="B's deliveries to settle while A's move is stuck",
        )
        assert not moving.done()
        assert set(statuses([a_early, a_late]).values()) == {"claimed"}
        assert Community.objects.get(id=community.id).deletion_state == "active"
    assert moving.result(timeout=30).deletion_state == "quiescing"

    # A's results were kept and settled again once the move was through: judged LeaseLost by the
    # database (its community left active), each once; nothing of A was written.
    assert worker.wait(60) == 0, worker.log()
    rows = {r.id: r for r in WorkflowAgentDelivery.objects.filter(id__in=[a_early, a_late, *b_ids])}
    for b in b_ids:
        assert (rows[b].status, rows[b].lease_generation, rows[b].attempt) == ("finished", 1, 1)
        assert [e["event"] for e in rows[b].history].count("settle") == 1
    for a in (a_early, a_late):
        assert (rows[a].status, rows[a].lease_generation) == ("claimed", 1)
        assert "settle" not in [e["event"] for e in rows[a].history]
    summary = worker.summary()
    assert (summary["claimed"], summary["finished"], summary["lease_lost"]) == (4, 2, 2)
    assert summary["settle_errors"] == 0
    log = worker.log()
    assert "renew_lock_wait community=" + str(community.id) in log
    assert "settle_lock_wait community=" + str(community.id) in log
    assert "lock_wait community=" + str(other.id) not in log


def test_a_lifecycle_move_stuck_in_one_community_keeps_no_claim_of_another_waiting(
    community, make_binding, start_worker
):
    """The dispatcher claims every pair in turn: A's claim (A has pending deliveries) waits for a
    lock at most the bound, then A is left for a while and B's new deliveries are claimed and
    settled meanwhile. Without the bound the dispatcher waits behind A's move and claims none."""
    a_target, b_target = random32(), random32()
    other, make_other = other_community_binding()
    a_ids = commit(make_binding, a_target, 3)
    with move_stuck_behind_a_long_transaction(community.id) as moving:
        worker = start_worker(
            a_target,
            *("--pair", f"{other.id}:{b_target.hex()}"),
            *("--concurrency", "2", "--lease-seconds", "5"),
        )
        b_ids = commit(make_other, b_target, 3)  # committed after A got stuck
        wait_until(
            lambda: set(statuses(b_ids).values()) == {"finished"},
            timeout=30,
            what="B's deliveries to be claimed and settled while A's move is stuck",
        )
        assert not moving.done()
        # Every claim of A was cancelled and claimed nothing.
        assert claim_state(a_ids) == dict.fromkeys(a_ids, ("pending", 0, 0))
    assert moving.result(timeout=30).deletion_state == "quiescing"
    worker.proc.terminate()  # A (quiescing now) is claimed from no more: the quota is never met
    assert worker.wait(60) == 0, worker.log()
    summary = worker.summary()
    assert (summary["claimed"], summary["finished"], summary["settle_errors"]) == (3, 3, 0)
    assert claim_state(a_ids) == dict.fromkeys(a_ids, ("pending", 0, 0))
    log = worker.log()
    assert "claim_lock_wait community=" + str(community.id) in log
    assert "lock_wait community=" + str(other.id) not in log


def test_only_a_worker_serving_several_communities_bounds_its_renewals_settles_and_claims(community):
    """A worker of one community has no other to hold up: its renewals, settles and claims keep
    their one-statement fast path (the bound's transaction costs client CPU a delivery)."""
    import threading

    from buzz_delivery.worker import WorkerConfig
    from buzz_delivery.worker.runtime import Worker

    other = CommunityFactory()
    one = WorkerConfig(community_id=community.id, target_pubkey=random32(), handler=lambda delivery: None)
    two_targets = WorkerConfig(
        community_id=community.id,
        target_pubkey=random32(),
        handler=lambda delivery: None,
        extra_pairs=((community.id, random32()),),
    )
    several = WorkerConfig(
        community_id=community.id,
        target_pubkey=random32(),
        handler=lambda delivery: None,
        extra_pairs=((other.id, random32()),),
    )
    bounds = {
        name: (worker.renewer._lock_wait_ms, worker.settler._lock_wait_ms, worker.claim_lock_wait_ms)
        for name, worker in (
            (name, Worker(config, threading.Event()))
            for name, config in (("one", one), ("two_targets", two_targets), ("several", several))
        )
    }
    assert bounds["one"] == bounds["two_targets"] == (None, None, None)
    assert None not in bounds["several"]


def test_one_locked_delivery_row_does_not_keep_the_other_leases_of_its_community_from_renewal(
    community, make_binding, start_worker, tmp_path
):
    """A long transaction holds one delivery row of community A: that lease's renewals wait
    past the bound, every time. A's other lease, whose row nothing holds, is renewed all the
    same (its community's tries do not always start with the locked lease), as B's is."""
    import psycopg as pg

    a_target, b_target = random32(), random32()
    other, make_other = other_community_binding()
    gate = tmp_path / "gate"
    (a_locked,) = commit(make_binding, a_target, 1, wait_for=str(gate))  # claimed first: renewed first
    (a_free,) = commit(make_binding, a_target, 1, wait_for=str(gate))
    (b_id,) = commit(make_other, b_target, 1, wait_for=str(gate))
    worker = start_worker(
        a_target,
        *("--pair", f"{other.id}:{b_target.hex()}"),
        *("--concurrency", "4", "--lease-seconds", "1.5", "--max-deliveries", "3"),
    )
    wait_until(lambda: count_claimed([a_locked, a_free, b_id]) == 3, what="the three claims")
    holder = pg.connect(database_url(connection.settings_dict))
    try:
        holder.execute(
            "SELECT 1 FROM buzz_delivery_delivery_queue WHERE community_id = %s AND id = %s FOR UPDATE",
            [community.id, a_locked],
        )
        before = renewals([a_free, b_id])
        # Three renewals each: a whole lease's worth, each within the lease of the one before.
        wait_until(
            lambda: all(n >= before[i] + 3 for i, n in renewals([a_free, b_id]).items()),
            timeout=30,
            what="A's unlocked lease (and B's) to be renewed while another row of A is locked",
        )
    finally:
        holder.rollback()
        holder.close()
        gate.touch()
    assert worker.wait(60) == 0, worker.log()
    assert statuses([a_free, b_id]) == {a_free: "finished", b_id: "finished"}
    assert "renew_lock_wait community=" + str(community.id) in worker.log()


def test_one_locked_delivery_row_does_not_keep_the_other_results_of_its_community_from_settling(
    community, make_binding, start_worker, tmp_path
):
    """A long transaction holds one delivery row of community A while A's results settle: the
    batch waits past the bound, then A's other results settle one by one (their leases are no
    longer renewed while they wait), and the held one once its row is released."""
    import psycopg as pg

    a_target, b_target = random32(), random32()
    other, make_other = other_community_binding()
    gate = tmp_path / "gate"
    a_ids = commit(make_binding, a_target, 3, wait_for=str(gate))
    (b_id,) = commit(make_other, b_target, 1, wait_for=str(gate))
    a_locked, a_free = a_ids[0], a_ids[1:]
    worker = start_worker(
        a_target,
        *("--pair", f"{other.id}:{b_target.hex()}"),
        *("--concurrency", "4", "--lease-seconds", "20", "--max-deliveries", "4"),
    )
    wait_until(lambda: count_claimed([*a_ids, b_id]) == 4, what="the four claims")
    holder = pg.connect(database_url(connection.settings_dict))
    try:
        holder.execute(
            "SELECT 1 FROM buzz_delivery_delivery_record WHERE community_id = %s AND id = %s FOR UPDATE",
            [community.id, a_locked],
        )
        gate.touch()  # every handler returns: A's three results go to the settler together
        wait_until(
            lambda: set(statuses([*a_free, b_id]).values()) == {"finished"},
            timeout=30,
            what="A's results whose rows nothing holds (and B's) to settle while another row of A is held",
        )
        wait_until(
            lambda: "settle_lock_wait community=" + str(community.id) in worker.log(),
            timeout=30,
            what="the held row's settle to wait past the bound",
        )
        assert statuses([a_locked]) == {a_locked: "claimed"}
    finally:
        holder.rollback()
        holder.close()
        gate.touch()
    assert worker.wait(60) == 0, worker.log()
    assert statuses([*a_ids, b_id]) == dict.fromkeys([*a_ids, b_id], "finished")


@contextmanager
def community_writes_held(community_id: uuid.UUID) -> Iterator[None]:
    """A session that holds the community's write fence as a lifecycle move does (the fence
    lock exclusively and the community row), then lets go without moving it: the community's
    writes wait meanwhile, and it is still active afterwards."""
    from buzz_delivery.triggers import FENCE_LOCK_NAMESPACE

    holder = psycopg.connect(database_url(connection.settings_dict))
    try:
        holder.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s::text))", [FENCE_LOCK_NAMESPACE, str(community_id)]
        )
        holder.execute("SELECT 1 FROM buzz_delivery_community WHERE id = %s FOR UPDATE", [community_id])
        yield
    finally:
        holder.rollback()
        holder.close()


def test_a_community_whose_claim_waited_is_polled_again_once_its_wait_is_over_not_a_poll_interval_later(
    community, make_binding, start_worker
):
    """A's claim waits past the bound (A's writes are held), so A is left for a while; once
    that is over, the next round polls A again: its pending deliveries (no hint will name them
    again) are not left until the next round a whole poll interval (here 600 s) later, even
    when a round came in between (the listener asks for one as it starts) and skipped A."""
    a_target, b_target = random32(), random32()
    other, _ = other_community_binding()
    a_ids = commit(make_binding, a_target, 2)
    with community_writes_held(community.id):
        worker = start_worker(
            a_target,
            *("--pair", f"{other.id}:{b_target.hex()}"),
            *("--concurrency", "2", "--lease-seconds", "5", "--poll-interval", "600", "--max-deliveries", "2"),
        )
        wait_until(
            lambda: "claim_lock_wait community=" + str(community.id) in worker.log(),
            timeout=60,
            what="A's claim to wait past the bound",
        )
        assert claim_state(a_ids) == dict.fromkeys(a_ids, ("pending", 0, 0))
    # A busy community is left for at most a second here (a third of the lease, at most 1 s).
    wait_until(
        lambda: set(statuses(a_ids).values()) == {"finished"},
        timeout=60,
        what="A's deliveries to be claimed once A's writes are let go (not a poll interval later)",
    )
    assert worker.wait(60) == 0, worker.log()


def test_a_worker_with_idle_exit_does_not_exit_while_a_community_is_left_for_a_lock_wait(
    community, make_binding, start_worker
):
    """A has pending deliveries and its move is stuck longer than ``--idle-exit``: each claim of
    A waits past the bound and A is left a while, again and again. The worker has nothing else
    to do, but it is not idle: it stays (before, it exited ``idle_exit`` with A's deliveries
    pending), and claims and settles A's deliveries once A's move is given up, then exits idle."""
    a_target, b_target = random32(), random32()
    other, _ = other_community_binding()
    a_ids = commit(make_binding, a_target, 2)
    with move_stuck_behind_a_long_transaction(community.id, rolled_back=True) as moving:
        worker = start_worker(
            a_target,
            *("--pair", f"{other.id}:{b_target.hex()}"),
            *("--concurrency", "2", "--lease-seconds", "3", "--idle-exit", "1"),
        )
        # Each wait: the bound (0.3 s) after A was left 1 s: four of them outlast the idle limit.
        wait_until(
            lambda: (
                worker.log().count("claim_lock_wait community=" + str(community.id)) >= 4
                or worker.proc.poll() is not None
            ),
            timeout=60,
            what="A's claims to wait past the bound four times",
        )
        assert worker.proc.poll() is None, worker.log()
        assert claim_state(a_ids) == dict.fromkeys(a_ids, ("pending", 0, 0))
        assert not moving.done()
    moving.result(timeout=30)  # given up: A stays active
    assert worker.wait(60) == 0, worker.log()
    assert claim_state(a_ids) == dict.fromkeys(a_ids, ("finished", 1, 1))
    summary = worker.summary()
    assert (summary["claimed"], summary["finished"], summary["reason"]) == (2, 2, "idle_exit"), summary


def test_another_community_s_settle_during_a_lock_wait_s_skip_does_not_make_the_worker_idle_sooner(
    community, make_binding, start_worker
):
    """A's move is stuck and A is left a while (a second) after each claim that waited; B's
    deliveries, claimed in the same round, are settled during that while. An ``--idle-exit``
    shorter than the while does not count from B's settle: the worker is busy until A's next
    try (before, B's settle moved the busy instant back from the end of A's while, and the
    worker exited idle with A's deliveries pending)."""
    a_target, b_target = random32(), random32()
    other, make_other = other_community_binding()
    a_ids = commit(make_binding, a_target, 2)
    commit(make_other, b_target, 2)
    with move_stuck_behind_a_long_transaction(community.id, rolled_back=True) as moving:
        worker = start_worker(
            a_target,
            *("--pair", f"{other.id}:{b_target.hex()}"),
            *("--concurrency", "2", "--lease-seconds", "3", "--idle-exit", "0.4"),
        )
        wait_until(
            lambda: (
                worker.log().count("claim_lock_wait community=" + str(community.id)) >= 4
                or worker.proc.poll() is not None
            ),
            timeout=60,
            what="A's claims to wait past the bound four times",
        )
        assert worker.proc.poll() is None, worker.log()
        assert claim_state(a_ids) == dict.fromkeys(a_ids, ("pending", 0, 0))
        assert not moving.done()
    moving.result(timeout=30)  # given up: A stays active
    assert worker.wait(60) == 0, worker.log()
    assert claim_state(a_ids) == dict.fromkeys(a_ids, ("finished", 1, 1))
