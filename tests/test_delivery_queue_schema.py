"""The live queue of issue 31, stage 2 (core migration 0037): the table's keys and indexes, the
migration back and forth under live rows, the claim as a HOT update, its row-level security and
its purge. The transitions themselves are tested with the services."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import override_settings

from buzz_delivery import isolation, scaleout, services
from buzz_delivery.models import DeliveryQueue, DeliveryRecord, WorkflowAgentDelivery
from buzz_delivery.services import tenancy
from buzz_delivery.testing import (
    BindingFactory,
    CommunityFactory,
    DeliveryFactory,
    Expr,
    advance_to,
    backdate,
    delete_delivery_rows,
    insert_delivery_rows,
    set_delivery_state,
)
from tests.citus_support import CITUS_MODE
from tests.test_tenant_isolation import TENANT_LOGIN, _as_login_role, logins  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("migrated_after")]

QUEUE = DeliveryQueue._meta.db_table
RECORD = DeliveryRecord._meta.db_table
VIEW = WorkflowAgentDelivery._meta.db_table
# The record's indexes and keys the queue took over (they are gone from the record).
RECORD_LIVE_INDEXES = (
    "delivery_pending_poll_idx",
    "delivery_pending_age_idx",
    "delivery_claimed_lease_idx",
    "delivery_pending_expiry_idx",
    "delivery_singleton_pending_key",
    "delivery_slot_community_key",
    "delivery_slot_target_key",
    "delivery_slot_workflow_key",
)
# What a claim, a renew or a retry writes: no index of the queue names one (HOT updates).
CLAIM_COLUMNS = (
    "status",
    "lease_until",
    "claimed_at",
    "claimed_by",
    "renewals",
    "attempt",
    "next_attempt_at",
    "history",
    "lease_generation",
)


def _sql(statement: str, params: object = None) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


def _indexes(table: str) -> dict[str, str]:
    return dict(_sql("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", [table]))


def test_the_queue_is_keyed_as_its_record_with_room_for_hot_updates():
    assert _sql("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", [QUEUE]) == [(["fillfactor=30"],)]
    keys = dict(
        _sql(
            "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid = %s::regclass AND contype IN ('p', 'f')",
            [QUEUE],
        )
    )
    assert keys[f"{QUEUE}_pkey"] == "PRIMARY KEY (id, community_id)"
    assert keys["delivery_queue_record_same_community"] == (
        f"FOREIGN KEY (community_id, id) REFERENCES {RECORD}(community_id, id) ON DELETE CASCADE"
    )
    indexes = _indexes(QUEUE)
    for name, definition in indexes.items():
        if name == f"{QUEUE}_pkey":
            continue
        named = definition.split(" USING btree ", 1)[1]
        assert not [c for c in CLAIM_COLUMNS if c in named], f"{name} names a column the claim writes: {definition}"
    assert not set(RECORD_LIVE_INDEXES) & set(_indexes(RECORD))


def _view_rows() -> list[tuple]:
    return _sql(f"SELECT * FROM {VIEW} ORDER BY id")


def _live_state(pending, claimed, finished) -> None:
    """``claimed`` holding a lease, ``finished`` terminal, ``pending`` as committed."""
    set_delivery_state(
        claimed,
        status="claimed",
        lease_until=Expr("now() + interval '1 hour'"),
        claimed_at=Expr("now()"),
        attempt=1,
        lease_generation=1,
        claimed_by="worker-1",
        slot_community=0,
    )
    set_delivery_state(finished, status="finished", finished_at=Expr("now()"))
    set_delivery_state(pending, status="pending")  # a queue row, whichever producer committed it


@pytest.mark.django_db(transaction=True)
def test_the_migration_goes_back_and_forth_under_live_rows_and_the_view_shows_the_same(community, make_binding):
    pending, claimed, finished = (DeliveryFactory(binding=make_binding()) for _ in range(3))
    _live_state(pending, claimed, finished)
    before = _view_rows()
    assert sorted(r.status for r in WorkflowAgentDelivery.objects.all()) == ["claimed", "finished", "pending"]

    call_command("migrate", "buzz_delivery", "0036", verbosity=0)
    try:
        assert _sql("SELECT to_regclass(%s)::text", [QUEUE]) == [(None,)]
        assert _view_rows() == before  # the live state is back in the record
        assert dict(_sql(f"SELECT id, status FROM {RECORD}")) == {
            pending.id: "pending",
            claimed.id: "claimed",
            finished.id: "finished",
        }
        assert set(RECORD_LIVE_INDEXES) <= set(_indexes(RECORD))
    finally:
        call_command("migrate", verbosity=0)
        if CITUS_MODE:  # the re-created functions are delegated again (docs/scale-out.md)
            scaleout.distribute_tables()

    assert _view_rows() == before
    assert dict(_sql(f"SELECT id, status FROM {QUEUE}")) == {pending.id: "pending", claimed.id: "claimed"}
    # The record of a claimed delivery is pending; its lease and slot are the queue row's.
    assert dict(_sql(f"SELECT id, status FROM {RECORD}")) == {
        pending.id: "pending",
        claimed.id: "pending",
        finished.id: "finished",
    }
    assert _sql(f"SELECT slot_community, claimed_by FROM {QUEUE} WHERE id = %s", [claimed.id]) == [(0, "worker-1")]
    # Once more back and forth: the move is repeatable.
    call_command("migrate", "buzz_delivery", "0036", verbosity=0)
    try:
        assert _view_rows() == before
    finally:
        call_command("migrate", verbosity=0)
        if CITUS_MODE:
            scaleout.distribute_tables()
    assert _view_rows() == before


@pytest.mark.skipif(CITUS_MODE, reason="reads one PostgreSQL node's table statistics (pg_stat_xact_user_tables)")
def test_a_claim_like_update_of_50_queue_rows_is_hot(community, make_binding):
    # Lowered inside this transaction (rolled back with it): the rows inserted below leave their
    # pages nine tenths empty, so page room cannot decide whether an update is HOT.
    _sql(f"ALTER TABLE {QUEUE} SET (fillfactor = 10)")
    seed = DeliveryFactory(binding=make_binding())
    insert_delivery_rows(
        ["id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id",
         "message_event_id", "cause_kind", "cause_webhook_invocation_id"],
        f"SELECT gen_random_uuid(), community_id, workflow_id, run_id, 'hot-' || g, target_pubkey,"
        f" definition_event_id, message_event_id, 'webhook', gen_random_uuid()"
        f" FROM {VIEW}, generate_series(1, 50) AS g WHERE community_id = %s AND id = %s",
        [community.id, seed.id],
    )  # fmt: skip
    hot = Expr("step_id LIKE 'hot-%%' AND community_id = %s", [community.id])
    assert _sql(f"SELECT count(*) FROM {QUEUE} WHERE community_id = %s", [community.id]) >= [(50,)]

    def updates() -> tuple[int, int]:
        (row,) = _sql(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relid = %s::regclass", [QUEUE]
        )
        return row

    upd, hot_upd = updates()
    written = set_delivery_state(
        hot,
        status="claimed",
        lease_generation=Expr("lease_generation + 1"),
        attempt=Expr("attempt + 1"),
        claimed_at=Expr("now()"),
        lease_until=Expr("now() + interval '30 seconds'"),
        next_attempt_at=None,
        claimed_by="worker-hot",
        renewals=0,
        history=Expr("buzz_delivery_history_push(history, jsonb_build_object('event', 'claim'))"),
    )
    assert written == 50
    after_upd, after_hot = updates()
    assert (after_upd - upd, after_hot - hot_upd) == (50, 50)
    # Not one record row was written by it.
    assert _sql(f"SELECT count(*) FROM {RECORD} WHERE status = 'claimed'") == [(0,)]


@pytest.mark.skipif(CITUS_MODE, reason="row-level security is not on Citus in this version (SPEC section 13)")
@override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": False})
def test_another_communitys_session_sees_no_queue_rows(logins, make_binding, community):  # noqa: F811
    other = CommunityFactory()
    mine = DeliveryFactory(binding=make_binding())
    theirs = DeliveryFactory(binding=BindingFactory(run__community=other))
    for delivery in (mine, theirs):
        set_delivery_state(delivery, status="pending")
    assert _sql(f"SELECT count(DISTINCT community_id) FROM {QUEUE}") == [(2,)]
    with connection.cursor() as cursor:
        (state,) = isolation.table_states(cursor, [(QUEUE, "community_id")])
    assert state.policies >= {isolation.TENANT_POLICY, isolation.FLEET_POLICY}
    _as_login_role(TENANT_LOGIN)
    with tenancy.tenant(community.id):
        assert _sql(f"SELECT id FROM {QUEUE}") == [(mine.id,)]  # no community filter
    with tenancy.tenant(other.id):
        assert _sql(f"SELECT id FROM {QUEUE}") == [(theirs.id,)]
    assert _sql(f"SELECT count(*) FROM {QUEUE}") == [(0,)]  # no context: no row


def test_a_purge_removes_the_communitys_queue_rows(make_binding, community):
    other = CommunityFactory()
    mine = [DeliveryFactory(binding=make_binding()) for _ in range(2)]
    theirs = DeliveryFactory(binding=BindingFactory(run__community=other))
    for delivery in (*mine, theirs):
        set_delivery_state(delivery, status="pending")
    advance_to(community, "fenced")
    result = services.purge_community(community.id)
    assert _sql(f"SELECT community_id FROM {QUEUE}") == [(other.id,)]
    assert _sql(f"SELECT count(*) FROM {RECORD} WHERE community_id = %s", [community.id]) == [(0,)]
    labels = list(result.deleted)
    assert result.deleted["buzz_delivery.DeliveryQueue"] == 2
    assert labels.index("buzz_delivery.DeliveryQueue") < labels.index("buzz_delivery.DeliveryRecord")
    assert result.tombstoned


def _both(delivery_id) -> tuple[list[tuple], list[tuple]]:
    record = _sql(
        f"SELECT status, lease_generation, claimed_by, lease_until IS NULL FROM {RECORD} WHERE id = %s", [delivery_id]
    )
    queue = _sql(
        f"SELECT status, lease_generation, claimed_by, lease_until IS NULL FROM {QUEUE} WHERE id = %s", [delivery_id]
    )
    return record, queue


def test_the_helpers_write_the_queue_for_live_rows_and_the_record_otherwise(community, make_binding):
    seed = DeliveryFactory(binding=make_binding())
    insert_delivery_rows(
        ["id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id",
         "message_event_id", "cause_kind", "cause_webhook_invocation_id"],
        f"SELECT gen_random_uuid(), community_id, workflow_id, run_id, 'helper', target_pubkey,"
        f" definition_event_id, message_event_id, 'webhook', gen_random_uuid()"
        f" FROM {VIEW} WHERE community_id = %s AND id = %s",
        [community.id, seed.id],
    )  # fmt: skip
    (row,) = _sql(f"SELECT id FROM {RECORD} WHERE community_id = %s AND step_id = 'helper'", [community.id])
    key = (community.id, row[0])
    assert _both(row[0]) == ([("pending", 0, None, True)], [("pending", 0, None, True)])
    # A claim's columns on a live row: the queue row alone.
    set_delivery_state(
        key, status="claimed", lease_until=Expr("now() + interval '1 hour'"), claimed_at=Expr("now()"),
        attempt=1, lease_generation=1, claimed_by="w",
    )  # fmt: skip
    assert _both(row[0]) == ([("pending", 0, None, True)], [("claimed", 1, "w", False)])
    # A terminal: the queue row goes, the record takes its state, the lease cleared.
    set_delivery_state(key, status="failed", finished_at=Expr("now()"), failure_code="x")
    assert _both(row[0]) == ([("failed", 1, "w", True)], [])
    # Live again: the record pending, a queue row from it.
    set_delivery_state(key, status="pending", finished_at=None, failure_code=None, lease_generation=2)
    assert _both(row[0]) == ([("pending", 1, "w", True)], [("pending", 2, "w", True)])
    backdate(key, created_at=60)
    (ages,) = _sql(
        f"SELECT r.created_at = q.created_at FROM {RECORD} r JOIN {QUEUE} q USING (community_id, id) WHERE r.id = %s",
        [row[0]],
    )
    assert ages == (True,)
    assert delete_delivery_rows(key) == 1
    assert _both(row[0]) == ([], [])
