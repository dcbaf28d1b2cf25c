"""The write fence: a community that left ``active`` accepts no write but the purge
executor's deletes, and a lifecycle move lets no writer slip past (SPEC section 5)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection, transaction

from buzz_delivery import services
from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.models import Community, Event, WorkflowAgentDelivery, WorkflowRun
from buzz_delivery.services import LeaseLost
from buzz_delivery.testing import (
    BindingFactory,
    CommunityFactory,
    DeliveryFactory,
    EventFactory,
    Expr,
    advance_to,
    delete_delivery_rows,
)
from buzz_delivery.triggers import FENCE_LOCK_NAMESPACE
from tests.citus_support import CITUS_MODE
from tests.conftest import backdate_lease
from tests.lifecycle_support import (
    RAW_WRITES,
    TABLES,
    community_snapshot,
    count_rows,
    fill_community,
    identify_as_purge_executor,
    purge_settings,
    raw_write,
)

NOT_ACTIVE = ("quiescing", "fenced")
OPERATIONS = ("insert", "update", "delete")


# --- raw SQL writes against the fence --------------------------------------------


def _delete_one_delivery(params: dict) -> None:
    """One of community ``params["c"]``'s deliveries deleted (a raw write, through the test helper)."""
    delete_delivery_rows(
        Expr("id = (SELECT id FROM buzz_delivery_delivery WHERE community_id = %s LIMIT 1)", [params["c"]])
    )


@pytest.mark.django_db
@pytest.mark.parametrize("table", list(TABLES))
@pytest.mark.parametrize("operation", OPERATIONS)
def test_raw_writes_to_an_active_community_pass_the_fence(community, table, operation):
    fill_community(community, rows=1)
    assert raw_write(RAW_WRITES[table][operation], {"c": community.id}) is None


@pytest.mark.django_db
@pytest.mark.parametrize("state", NOT_ACTIVE)
@pytest.mark.parametrize("table", list(TABLES))
@pytest.mark.parametrize("operation", OPERATIONS)
def test_the_database_refuses_raw_writes_to_a_community_that_is_not_active(community, state, table, operation):
    fill_community(community, rows=1)
    advance_to(community, state)
    before = community_snapshot(community.id)
    assert raw_write(RAW_WRITES[table][operation], {"c": community.id}) == "BD001"
    assert community_snapshot(community.id) == before


@pytest.mark.django_db
@pytest.mark.parametrize("state", NOT_ACTIVE)
def test_reads_still_work_on_a_community_that_is_not_active(community, state):
    counts = fill_community(community, rows=2)
    delivery = WorkflowAgentDelivery.objects.filter(community=community).first()
    advance_to(community, state)
    assert count_rows(community.id) == counts
    assert services.get_delivery(community.id, delivery.id).id == delivery.id
    assert Event.objects.filter(community=community).count() == 2


@pytest.mark.django_db
@pytest.mark.parametrize("state", NOT_ACTIVE)
def test_the_orm_sees_the_fence_as_community_not_writable_through_services(community, state, make_binding):
    binding = make_binding()
    event = Event.objects.get(community=community)
    advance_to(community, state)
    with pytest.raises(CommunityNotWritable, match=state):
        services.commit_deliveries(community.id, event, [binding])
    assert not WorkflowAgentDelivery.objects.filter(community=community).exists()


# --- claims, leases and the reaper on a fenced tenant ------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("state", NOT_ACTIVE)
def test_a_claim_on_a_fenced_community_is_a_miss_and_changes_nothing(community, state, make_binding):
    delivery = DeliveryFactory(binding=make_binding())
    advance_to(community, state)
    before = community_snapshot(community.id)
    assert services.claim_delivery(community.id, bytes(delivery.target_pubkey)) is None
    assert services.claim_deliveries(community.id, bytes(delivery.target_pubkey), limit=10) == []
    assert community_snapshot(community.id) == before


@pytest.mark.django_db
@pytest.mark.parametrize("state", NOT_ACTIVE)
@pytest.mark.parametrize("action", ["renew", "finished", "failed", "retry"])
def test_a_lease_in_a_fenced_community_is_lost(community, state, action, make_binding):
    delivery = DeliveryFactory(binding=make_binding())
    claim = services.claim_delivery(community.id, bytes(delivery.target_pubkey))
    advance_to(community, state)
    before = community_snapshot(community.id)
    if action == "renew":
        outcome = services.renew_delivery(claim.lease)
    else:
        outcome = services.finish_delivery(claim.lease, action)
    assert isinstance(outcome, LeaseLost)
    assert community_snapshot(community.id) == before


@pytest.mark.django_db
@pytest.mark.parametrize("state", NOT_ACTIVE)
def test_the_reaper_skips_a_fenced_community_and_still_reaps_a_healthy_one(community, state, make_binding):
    fenced_delivery = DeliveryFactory(binding=make_binding())
    healthy_binding = BindingFactory()
    healthy_delivery = DeliveryFactory(binding=healthy_binding)
    for d in (fenced_delivery, healthy_delivery):
        claim = services.claim_delivery(d.community_id, bytes(d.target_pubkey))
        assert claim is not None
        backdate_lease(d.id)
    advance_to(community, state)
    before = community_snapshot(community.id)

    result = services.reap()

    assert (result.reclaimed, result.skipped_fenced) == (1, 1)
    healthy_delivery.refresh_from_db()
    assert (healthy_delivery.status, healthy_delivery.lease_generation) == ("pending", 2)
    assert community_snapshot(community.id) == before


# --- the purge executor's bypass ------------------------------------------------------


@pytest.fixture
def fenced(community):
    fill_community(community, rows=1)
    return advance_to(community, "fenced")


PURGE_ORDER = ("rate_limit", "delivery", "run", "event", "workflow")  # children first: no key cascades further


@pytest.mark.django_db
@pytest.mark.parametrize("table", PURGE_ORDER)
def test_the_purge_executor_may_delete_rows_of_its_fenced_community(fenced, table):
    other = CommunityFactory()
    fill_community(other, rows=1)
    other_before = community_snapshot(other.id)
    done = PURGE_ORDER[: PURGE_ORDER.index(table) + 1]
    with transaction.atomic():
        identify_as_purge_executor(fenced.id, fenced.fence_generation)
        for child in done:
            assert raw_write(RAW_WRITES[child]["delete"], {"c": fenced.id}) is None
    left = community_snapshot(fenced.id)
    for name, db_table in TABLES.items():
        assert bool(left[db_table]) is (name not in done), name
    assert community_snapshot(other.id) == other_before


@pytest.mark.django_db
@pytest.mark.parametrize("table", list(TABLES))
def test_the_bypass_refuses_a_stale_fence_generation(fenced, table):
    before = community_snapshot(fenced.id)
    with transaction.atomic():
        identify_as_purge_executor(fenced.id, fenced.fence_generation - 1)
        assert raw_write(RAW_WRITES[table]["delete"], {"c": fenced.id}) == "BD001"
    assert community_snapshot(fenced.id) == before


@pytest.mark.django_db
@pytest.mark.parametrize("table", list(TABLES))
def test_the_bypass_named_for_another_community_does_not_open_this_one(fenced, table):
    other = advance_to(CommunityFactory(), "fenced")
    assert other.fence_generation == fenced.fence_generation
    before = community_snapshot(fenced.id)
    with transaction.atomic():
        identify_as_purge_executor(other.id, other.fence_generation)
        assert raw_write(RAW_WRITES[table]["delete"], {"c": fenced.id}) == "BD001"
    assert community_snapshot(fenced.id) == before


@pytest.mark.django_db
@pytest.mark.parametrize("table", list(TABLES))
@pytest.mark.parametrize("operation", ["insert", "update"])
def test_the_bypass_allows_only_deletes(fenced, table, operation):
    before = community_snapshot(fenced.id)
    with transaction.atomic():
        identify_as_purge_executor(fenced.id, fenced.fence_generation)
        assert raw_write(RAW_WRITES[table][operation], {"c": fenced.id}) == "BD001"
    assert community_snapshot(fenced.id) == before


@pytest.mark.django_db
@pytest.mark.parametrize("table", list(TABLES))
def test_the_bypass_does_not_open_a_quiescing_community(community, table):
    fill_community(community, rows=1)
    quiescing = advance_to(community, "quiescing")
    before = community_snapshot(community.id)
    with transaction.atomic():
        identify_as_purge_executor(quiescing.id, quiescing.fence_generation)
        assert raw_write(RAW_WRITES[table]["delete"], {"c": community.id}) == "BD001"
    assert community_snapshot(community.id) == before


@pytest.mark.django_db(transaction=True)
def test_the_bypass_ends_with_the_transaction_that_set_it(community):
    fill_community(community, rows=2)
    fenced = advance_to(community, "fenced")
    with transaction.atomic():
        identify_as_purge_executor(fenced.id, fenced.fence_generation)
        assert purge_settings() == (str(fenced.id), str(fenced.fence_generation))
        assert raw_write(_delete_one_delivery, {"c": community.id}) is None
    assert purge_settings() in {("", ""), (None, None)}
    before = community_snapshot(community.id)
    assert raw_write(RAW_WRITES["delivery"]["delete"], {"c": community.id}) == "BD001"
    assert community_snapshot(community.id) == before
    assert WorkflowAgentDelivery.objects.filter(community=community).count() == 2


# --- a lifecycle move against writers on other connections ---------------------------


def _fence_lock_waiters(community_id, pid: int) -> list[str]:
    """Lock modes ``pid`` waits for on the community's fence advisory lock (seen from this connection)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT mode FROM pg_locks
            WHERE locktype = 'advisory' AND pid = %(pid)s AND NOT granted
              AND classid::bigint = %(ns)s AND objsubid = 2
              AND objid::bigint = (hashtext(%(id)s::text)::bigint & 4294967295)
            """,
            {"pid": pid, "ns": FENCE_LOCK_NAMESPACE, "id": community_id},
        )
        return [row[0] for row in cursor.fetchall()]


def _held_fence_locks(community_id, pid: int) -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT mode FROM pg_locks
            WHERE locktype = 'advisory' AND pid = %(pid)s AND granted
              AND classid::bigint = %(ns)s AND objsubid = 2
              AND objid::bigint = (hashtext(%(id)s::text)::bigint & 4294967295)
            """,
            {"pid": pid, "ns": FENCE_LOCK_NAMESPACE, "id": community_id},
        )
        return [row[0] for row in cursor.fetchall()]


def _blocking_pids(pid: int) -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_blocking_pids(%s)", [pid])
        return cursor.fetchone()[0]


def _wait_until(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


@pytest.mark.skipif(CITUS_MODE, reason="reads pg_locks, which on Citus is on the workers: tests/test_citus.py")
@pytest.mark.django_db(transaction=True)
def test_a_move_waits_for_a_writer_inside_its_transaction_and_lets_no_later_writer_slip_past(community, make_binding):
    delivery = DeliveryFactory(binding=make_binding())
    target = bytes(delivery.target_pubkey)
    pids: dict[str, int] = {}
    wrote, release, moved, late_started = (threading.Event() for _ in range(4))

    def writer():
        # Claims (a write under the fence) and keeps its transaction open until released.
        try:
            pids["writer"] = _backend_pid()
            with transaction.atomic():
                claim = services.claim_delivery(community.id, target)
                wrote.set()
                assert release.wait(30)
            return claim
        finally:
            connection.close()

    def mover():
        try:
            pids["mover"] = _backend_pid()
            result = services.advance_community(community.id, "quiescing")
            moved.set()
            return result
        finally:
            connection.close()

    def late_writer():
        # Starts after the move was requested: must queue behind it, then be refused.
        try:
            pids["late"] = _backend_pid()
            late_started.set()
            return raw_write(RAW_WRITES["workflow"]["insert"], {"c": community.id})
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=3) as pool:
        try:
            writing = pool.submit(writer)
            assert wrote.wait(15), "the writer never claimed"
            assert _held_fence_locks(community.id, pids["writer"]) == ["ShareLock"]

            moving = pool.submit(mover)
            assert _wait_until(lambda: "mover" in pids and _fence_lock_waiters(community.id, pids["mover"]))
            assert _fence_lock_waiters(community.id, pids["mover"]) == ["ExclusiveLock"]
            assert not moved.wait(0.5), "the move did not wait for the open writer"

            late = pool.submit(late_writer)
            assert late_started.wait(15)
            # The fence lock is awaited by the move, so the late writer meets the move on the
            # community row, which the move holds (migration 0020): it waits for the move.
            assert _wait_until(lambda: pids["mover"] in _blocking_pids(pids["late"]))
            assert not moved.is_set()
            assert Community.objects.get(id=community.id).deletion_state == "active"
        finally:
            release.set()

        claim = writing.result(timeout=30)
        quiescing = moving.result(timeout=30)
        late_failure = late.result(timeout=30)

    assert claim is not None, "the writer inside its transaction must commit its claim"
    delivery.refresh_from_db()
    assert (delivery.status, delivery.lease_generation) == ("claimed", claim.lease.lease_generation)
    assert (quiescing.deletion_state, quiescing.fence_generation) == ("quiescing", 1)
    assert late_failure == "BD001", "a writer that queued behind the move slipped past the fence"

    # Writers that start after the move are refused too.
    run = WorkflowRun.objects.get(community=community)
    event = Event.objects.get(community=community)
    with pytest.raises(CommunityNotWritable):
        services.commit_deliveries(community.id, event, [BindingFactory(run=run, message_event=event)])
    for operation in OPERATIONS:
        assert raw_write(RAW_WRITES["delivery"][operation], {"c": community.id}) == "BD001"
    assert WorkflowAgentDelivery.objects.filter(community=community).count() == 1


# --- the fence remembers an active community for the rest of its transaction ----------------


# A row moved to another community: refused by the fence, or on Citus by Citus itself before
# (it never changes a row's distribution column: "modifying the partition value of rows").
MOVE_REFUSED = "0A000" if CITUS_MODE else "BD001"


def _fence_passed(community: Community) -> str | None:
    """What the fence remembers, read where the fence ran: on the node that holds ``community``
    (a router read of its row; on Citus the coordinator's own session never sees the setting
    the trigger set on the worker's shard)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('buzz_delivery.fence_passed', true) FROM buzz_delivery_community WHERE id = %s",
            [community.id],
        )
        return cursor.fetchone()[0]


@pytest.mark.django_db
def test_a_transaction_that_passed_the_fence_is_refused_after_its_own_lifecycle_move(community):
    fill_community(community, rows=1)
    assert raw_write(RAW_WRITES["delivery"]["update"], {"c": community.id}) is None
    assert _fence_passed(community) == str(community.id)  # remembered for this transaction
    advance_to(community, "quiescing")  # by this same transaction
    assert _fence_passed(community) == ""
    before = community_snapshot(community.id)
    for table in TABLES:
        assert raw_write(RAW_WRITES[table]["update"], {"c": community.id}) == "BD001", table
    assert community_snapshot(community.id) == before


@pytest.mark.django_db
def test_the_purge_executors_delete_is_not_remembered_as_passing(community):
    fill_community(community, rows=2)
    fenced = advance_to(community, "fenced")
    identify_as_purge_executor(fenced.id, fenced.fence_generation)
    assert raw_write(_delete_one_delivery, {"c": community.id}) is None
    assert _fence_passed(community) != str(community.id)
    assert WorkflowAgentDelivery.objects.filter(community=community).exists()
    before = community_snapshot(community.id)
    assert raw_write(RAW_WRITES["delivery"]["update"], {"c": community.id}) == "BD001"
    assert raw_write(RAW_WRITES["delivery"]["insert"], {"c": community.id}) == "BD001"
    assert community_snapshot(community.id) == before


@pytest.mark.django_db(transaction=True)
def test_what_the_fence_remembers_ends_with_its_transaction_or_savepoint(community):
    fill_community(community, rows=1)
    with transaction.atomic():
        with transaction.atomic():
            assert raw_write(RAW_WRITES["delivery"]["update"], {"c": community.id}) is None
            assert _fence_passed(community) == str(community.id)
            transaction.set_rollback(True)
        assert _fence_passed(community) in ("", None)  # the savepoint rolled back: judged again
    assert _fence_passed(community) in ("", None)
    with transaction.atomic():
        assert raw_write(RAW_WRITES["delivery"]["update"], {"c": community.id}) is None
    # Moved by another transaction after that one committed: the next transaction judges again.
    advance_to(community, "quiescing")
    assert raw_write(RAW_WRITES["delivery"]["update"], {"c": community.id}) == "BD001"


@pytest.mark.django_db
def test_every_write_fence_trigger_runs_the_shared_row_function():
    """Every community-scoped table of every app has the fence's three BEFORE ROW triggers, each
    running ``buzz_delivery_write_fence_row()`` (not pgtrigger's per-table wrapper) under its
    WHEN: INSERT or UPDATE and DELETE skip a community this transaction passed, and an UPDATE of
    ``community_id`` that moves the row is always judged (issue 16)."""
    from buzz_delivery.catalog import catalog_models

    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT c.relname, t.tgname, p.proname, t.tgtype,
                   (SELECT array_agg(a.attname::text) FROM pg_attribute a
                    WHERE a.attrelid = t.tgrelid AND a.attnum = ANY (t.tgattr)),
                   pg_get_triggerdef(t.oid)
            FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_proc p ON p.oid = t.tgfoid
            WHERE NOT t.tgisinternal AND t.tgname LIKE 'pgtrigger_community_write_fence_%%'
            """
        )
        rows = cursor.fetchall()
    found: dict[str, set[tuple[str, int, tuple[str, ...] | None, str]]] = {}
    for table, name, function, tgtype, columns, definition in rows:
        assert function == "buzz_delivery_write_fence_row", name
        when = definition.split(" WHEN ", 1)[1].split(" EXECUTE ", 1)[0]
        kind = name.removeprefix("pgtrigger_").rsplit("_", 1)[0]
        found.setdefault(table, set()).add((kind, tgtype, tuple(columns) if columns else None, when))
    passed = "(current_setting('buzz_delivery.fence_passed'::text, true) IS DISTINCT FROM ({row}.community_id)::text)"
    moved = "((old.community_id IS DISTINCT FROM new.community_id))"
    # tgtype bits: ROW 1, BEFORE 2, INSERT 4, DELETE 8, UPDATE 16.
    fence = {
        ("community_write_fence", 1 | 2 | 4 | 16, None, f"({passed.format(row='new')})"),
        ("community_write_fence_delete", 1 | 2 | 8, None, f"({passed.format(row='old')})"),
        ("community_write_fence_move", 1 | 2 | 16, ("community_id",), moved),
    }
    assert found == {m._meta.db_table: fence for m in catalog_models()}


@pytest.mark.django_db
@pytest.mark.parametrize("state", NOT_ACTIVE)
@pytest.mark.parametrize("table", list(TABLES))
@pytest.mark.parametrize("operation", OPERATIONS)
def test_a_community_passed_in_the_transaction_opens_no_other_community(community, state, table, operation):
    """The WHEN that skips a passed community compares the row's own community: a transaction
    that passed one community is still refused every write to another that left active."""
    fill_community(community, rows=1)
    other = CommunityFactory()
    fill_community(other, rows=1)
    advance_to(community, state)  # (a lifecycle move clears what the transaction passed)
    assert raw_write(RAW_WRITES[table]["update"], {"c": other.id}) is None
    assert _fence_passed(other) == str(other.id)
    before = community_snapshot(community.id)
    assert raw_write(RAW_WRITES[table][operation], {"c": community.id}) == "BD001"
    assert community_snapshot(community.id) == before


@pytest.mark.django_db
@pytest.mark.parametrize("state", NOT_ACTIVE)
def test_moving_a_row_out_of_a_community_that_left_active_is_refused_into_a_passed_one(community, state):
    """An UPDATE that moves a row from a community that left active into one this transaction
    passed is judged on the old community (the ``_move`` trigger), not skipped by the new one's
    pass. Also the reverse: out of a passed community into one that left active."""
    other = CommunityFactory()
    fill_community(other, rows=1)
    mine = EventFactory(community=community)
    advance_to(community, state)
    assert raw_write(RAW_WRITES["event"]["update"], {"c": other.id}) is None
    assert _fence_passed(other) == str(other.id)
    move = "UPDATE buzz_delivery_event SET community_id = %(to)s WHERE id = %(id)s"
    # (On Citus no row ever changes its community, the distribution column: refused as 0A000.)
    assert raw_write(move, {"to": other.id, "id": mine.pk}) == MOVE_REFUSED
    theirs = Event.objects.filter(community=other).first()
    assert raw_write(move, {"to": community.id, "id": theirs.pk}) == MOVE_REFUSED
    assert Event.objects.get(pk=mine.pk).community_id == community.id
    assert Event.objects.get(pk=theirs.pk).community_id == other.id
