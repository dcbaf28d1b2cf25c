"""Database invariants (SPEC section 3): every CHECK, UNIQUE and tenant key rejects a raw SQL
write that breaks it, and deletes cascade to deliveries.

Each rejected write names the constraint that refused it, and the same raw INSERT with the
offending columns left alone succeeds (``test_the_raw_insert_baseline_is_accepted``), so
each case fails for the reason it states.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import pgtrigger
import pytest
from django.core.exceptions import ValidationError
from django.db import DatabaseError, IntegrityError, connection, transaction

from buzz_delivery import models, services
from buzz_delivery.services import fanout
from buzz_delivery.services.db import constraint_name
from buzz_delivery.testing import (
    BindingFactory,
    CommunityFactory,
    EventFactory,
    WorkflowFactory,
    WorkflowRunFactory,
    insert_delivery_rows,
    random32,
)
from tests.citus_support import CITUS_MODE

pytestmark = pytest.mark.django_db

B31, B33 = b"\x01" * 31, b"\x01" * 33


@dataclass
class Tenant:
    community: models.Community
    workflow: models.Workflow
    run: models.WorkflowRun
    event: models.Event


def make_tenant() -> Tenant:
    community = CommunityFactory()
    workflow = WorkflowFactory(community=community)
    return Tenant(
        community=community,
        workflow=workflow,
        run=WorkflowRunFactory(community=community, workflow=workflow),
        event=EventFactory(community=community),
    )


@pytest.fixture
def tenant() -> Tenant:
    return make_tenant()


@pytest.fixture
def other_tenant() -> Tenant:
    return make_tenant()


def valid_columns(tenant: Tenant) -> dict[str, Any]:
    return {
        "id": uuid.uuid4(),
        "community_id": tenant.community.id,
        "workflow_id": tenant.workflow.id,
        "run_id": tenant.run.id,
        "step_id": "send_message",
        "target_pubkey": random32(),
        "definition_event_id": random32(),
        "message_event_id": bytes(tenant.event.event_id),
        "cause_kind": "webhook",
        "cause_event_id": None,
        "cause_scheduled_for": None,
        "cause_webhook_invocation_id": uuid.uuid4(),
        "status": "pending",
        "lease_generation": 0,
        "lease_until": None,
        "claimed_at": None,
        "finished_at": None,
        "attempt": 0,
        "max_attempts": 3,
        "failure_code": None,
    }


def raw_insert(columns: dict[str, Any]) -> None:
    names = ", ".join(columns)
    values = ", ".join(f"%({name})s" for name in columns)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO buzz_delivery_delivery_record ({names}) VALUES ({values})", columns)


def refused_by(exc: BaseException) -> str | None:
    """The violated constraint (on Citus: read from the relayed message, shard suffix dropped)."""
    return constraint_name(exc)


NOW = "now"  # replaced by a timestamp read from the database
CLAIMED = {"status": "claimed", "attempt": 1, "lease_generation": 1}

CHECK_CASES = {
    # cause exclusivity: exactly the column matching cause_kind is non-null
    "event cause without its event id": (
        {"cause_kind": "event", "cause_webhook_invocation_id": None},
        "delivery_cause_exactly_one",
    ),
    "event cause with a second identity": (
        {"cause_kind": "event", "cause_event_id": random32()},
        "delivery_cause_exactly_one",
    ),
    "schedule cause without its instant": (
        {"cause_kind": "schedule", "cause_webhook_invocation_id": None},
        "delivery_cause_exactly_one",
    ),
    "webhook cause with a scheduled instant": ({"cause_scheduled_for": NOW}, "delivery_cause_exactly_one"),
    "webhook cause without its invocation id": ({"cause_webhook_invocation_id": None}, "delivery_cause_exactly_one"),
    "unknown cause kind": ({"cause_kind": "cron"}, "delivery_cause_exactly_one"),
    "unknown status": ({"status": "lost"}, "delivery_status_known"),
    # claimed <=> lease_until <=> claimed_at
    "claimed without lease_until": ({**CLAIMED, "claimed_at": NOW}, "delivery_claimed_iff_lease"),
    "claimed without claimed_at": ({**CLAIMED, "lease_until": NOW}, "delivery_claimed_iff_lease"),
    "pending with lease_until": ({"lease_until": NOW}, "delivery_claimed_iff_lease"),
    "pending with claimed_at": ({"claimed_at": NOW}, "delivery_claimed_iff_lease"),
    # terminal <=> finished_at
    "finished without finished_at": ({"status": "finished"}, "delivery_terminal_iff_finished_at"),
    "failed without finished_at": ({"status": "failed"}, "delivery_terminal_iff_finished_at"),
    "expired without finished_at": ({"status": "expired"}, "delivery_terminal_iff_finished_at"),
    "pending with finished_at": ({"finished_at": NOW}, "delivery_terminal_iff_finished_at"),
    # 32-byte columns
    "31-byte target_pubkey": ({"target_pubkey": B31}, "delivery_target_pubkey_32_bytes"),
    "33-byte target_pubkey": ({"target_pubkey": B33}, "delivery_target_pubkey_32_bytes"),
    "31-byte definition_event_id": ({"definition_event_id": B31}, "delivery_definition_event_id_32_bytes"),
    "33-byte definition_event_id": ({"definition_event_id": B33}, "delivery_definition_event_id_32_bytes"),
    "31-byte message_event_id": ({"message_event_id": B31}, "delivery_message_event_id_32_bytes"),
    "33-byte message_event_id": ({"message_event_id": B33}, "delivery_message_event_id_32_bytes"),
    "31-byte cause_event_id": (
        {"cause_kind": "event", "cause_webhook_invocation_id": None, "cause_event_id": B31},
        "delivery_cause_event_id_32_bytes",
    ),
    "33-byte cause_event_id": (
        {"cause_kind": "event", "cause_webhook_invocation_id": None, "cause_event_id": B33},
        "delivery_cause_event_id_32_bytes",
    ),
    # step_id not blank
    "empty step_id": ({"step_id": ""}, "delivery_step_id_not_blank"),
    "whitespace step_id": ({"step_id": " \t\n "}, "delivery_step_id_not_blank"),
    # generation and attempts
    "negative lease_generation": ({"lease_generation": -1}, "delivery_lease_generation_gte_0"),
    "negative attempt": ({"attempt": -1}, "delivery_attempt_gte_0"),
    "attempt above max_attempts": ({"attempt": 4, "max_attempts": 3}, "delivery_attempt_within_max"),
    "max_attempts of zero": ({"max_attempts": 0}, "delivery_attempt_within_max"),
    "claimed with no attempt": (
        {**CLAIMED, "attempt": 0, "lease_until": NOW, "claimed_at": NOW},
        "delivery_claimed_has_attempt",
    ),
    "failure_code on a pending delivery": ({"failure_code": "boom"}, "delivery_failure_code_only_when_failed"),
    "failure_code on a finished delivery": (
        {"status": "finished", "finished_at": NOW, "failure_code": "boom"},
        "delivery_failure_code_only_when_failed",
    ),
}


def with_db_now(overrides: dict[str, Any]) -> dict[str, Any]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        now = cursor.fetchone()[0]
    return {k: (now if v == NOW else v) for k, v in overrides.items()}


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"cause_kind": "event", "cause_webhook_invocation_id": None, "cause_event_id": random32()},
        {"cause_kind": "schedule", "cause_webhook_invocation_id": None, "cause_scheduled_for": NOW},
        {**CLAIMED, "lease_until": NOW, "claimed_at": NOW},
        {"status": "failed", "finished_at": NOW, "failure_code": "boom", "attempt": 3},
        {"max_attempts": None, "attempt": 99},
    ],
    ids=["pending webhook", "event cause", "schedule cause", "claimed", "failed", "unlimited attempts"],
)
def test_the_raw_insert_baseline_is_accepted(tenant, overrides):
    columns = {**valid_columns(tenant), **with_db_now(overrides)}

    raw_insert(columns)

    assert models.WorkflowAgentDelivery.objects.filter(id=columns["id"]).exists()


@pytest.mark.parametrize(("overrides", "constraint"), CHECK_CASES.values(), ids=CHECK_CASES.keys())
def test_a_raw_insert_that_breaks_a_check_constraint_is_rejected(tenant, overrides, constraint):
    columns = {**valid_columns(tenant), **with_db_now(overrides)}

    with pytest.raises(IntegrityError) as info:
        raw_insert(columns)

    assert refused_by(info.value) == constraint
    assert not models.WorkflowAgentDelivery.objects.filter(id=columns["id"]).exists()


UPDATE_CASES = {
    "claimed without a lease": ("status = 'claimed', attempt = 1", "delivery_claimed_iff_lease"),
    "finished without finished_at": ("status = 'finished'", "delivery_terminal_iff_finished_at"),
    "negative generation": ("lease_generation = -1", "delivery_lease_generation_gte_0"),
    "blank step_id": ("step_id = '   '", "delivery_step_id_not_blank"),
    "short target": ("target_pubkey = '\\x00'::bytea", "delivery_target_pubkey_32_bytes"),
    "cause swapped to schedule": ("cause_kind = 'schedule'", "delivery_cause_exactly_one"),
}


# The history guards (binding columns immutable, generation monotonic) refuse most of these
# UPDATEs before any CHECK runs (tests/test_review_regressions.py); switch them off here so the
# CHECKs and tenant keys themselves are proven on UPDATE too.
HISTORY_GUARDS = (
    "buzz_delivery.DeliveryRecord:delivery_binding_immutable",
    "buzz_delivery.DeliveryRecord:delivery_generation_monotonic",
)


@pytest.mark.parametrize(("assignment", "constraint"), UPDATE_CASES.values(), ids=UPDATE_CASES.keys())
def test_a_raw_update_that_breaks_a_check_constraint_is_rejected(tenant, assignment, constraint):
    columns = valid_columns(tenant)
    raw_insert(columns)

    with (
        pytest.raises(IntegrityError) as info,
        pgtrigger.ignore(*HISTORY_GUARDS),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute(f"UPDATE buzz_delivery_delivery_record SET {assignment} WHERE id = %s", [columns["id"]])

    assert refused_by(info.value) == constraint
    assert models.WorkflowAgentDelivery.objects.get(id=columns["id"]).status == "pending"


def test_a_step_id_longer_than_64_characters_is_rejected_by_the_column(tenant):
    columns = {**valid_columns(tenant), "step_id": "s" * 65}

    with pytest.raises(DatabaseError, match="too long"):
        raw_insert(columns)

    raw_insert({**columns, "step_id": "s" * 64})


@pytest.mark.parametrize("same", ["everything else", "nothing but the identity"])
def test_a_second_row_with_the_same_identity_is_rejected(tenant, same):
    first = valid_columns(tenant)
    raw_insert(first)
    second = {**first, "id": uuid.uuid4()}
    if same == "nothing but the identity":
        second.update(definition_event_id=random32(), cause_webhook_invocation_id=uuid.uuid4())

    with pytest.raises(IntegrityError) as info:
        raw_insert(second)

    assert refused_by(info.value) == "delivery_identity_key"
    # Another target, step or run is another identity.
    other_run = WorkflowRunFactory(community=tenant.community, workflow=tenant.workflow)
    for change in ({"target_pubkey": random32()}, {"step_id": "other_step"}, {"run_id": other_run.id}):
        raw_insert({**second, "id": uuid.uuid4(), **change})


TENANT_KEYS = {
    # One key, (community, workflow, run) -> the run's (community, workflow, id) (core 0036).
    "workflow": ("workflow_id", "delivery_run_workflow_same_community"),
    "run": ("run_id", "delivery_run_workflow_same_community"),
    "message event": ("message_event_id", "delivery_message_event_same_community"),
}


@pytest.mark.parametrize(("column", "constraint"), TENANT_KEYS.values(), ids=TENANT_KEYS.keys())
def test_a_delivery_pointing_at_another_communitys_row_is_rejected(tenant, other_tenant, column, constraint):
    foreign = {
        "workflow_id": other_tenant.workflow.id,
        "run_id": other_tenant.run.id,
        "message_event_id": bytes(other_tenant.event.event_id),
    }[column]
    columns = {**valid_columns(tenant), column: foreign}

    with pytest.raises(IntegrityError) as info:
        raw_insert(columns)

    assert refused_by(info.value) == constraint


@pytest.mark.parametrize("column", ["workflow_id", "run_id", "message_event_id"])
def test_a_raw_update_moving_a_delivery_to_another_communitys_row_is_rejected(tenant, other_tenant, column):
    columns = valid_columns(tenant)
    raw_insert(columns)
    foreign = {
        "workflow_id": other_tenant.workflow.id,
        "run_id": other_tenant.run.id,
        "message_event_id": bytes(other_tenant.event.event_id),
    }[column]

    with (
        pytest.raises(IntegrityError) as info,
        pgtrigger.ignore(*HISTORY_GUARDS),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute(
            f"UPDATE buzz_delivery_delivery_record SET {column} = %s WHERE id = %s", [foreign, columns["id"]]
        )

    assert (
        refused_by(info.value)
        == TENANT_KEYS[{"workflow_id": "workflow", "run_id": "run", "message_event_id": "message event"}[column]][1]
    )


def test_a_delivery_whose_workflow_is_not_its_runs_is_rejected(tenant):
    # Both rows are of the delivery's community: only the one key to the run (core 0036) knows
    # that the run belongs to another workflow.
    other_workflow = WorkflowFactory(community=tenant.community)

    with pytest.raises(IntegrityError) as info:
        raw_insert({**valid_columns(tenant), "workflow_id": other_workflow.id})

    assert refused_by(info.value) == "delivery_run_workflow_same_community"
    assert deliveries(community_id=tenant.community.id) == 0


def test_a_raw_update_giving_a_delivery_another_workflow_than_its_runs_is_rejected(tenant):
    columns = valid_columns(tenant)
    raw_insert(columns)
    other_workflow = WorkflowFactory(community=tenant.community)

    with (
        pytest.raises(IntegrityError) as info,
        pgtrigger.ignore(*HISTORY_GUARDS),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute(
            "UPDATE buzz_delivery_delivery_record SET workflow_id = %s WHERE community_id = %s AND id = %s",
            [other_workflow.id, tenant.community.id, columns["id"]],
        )

    assert refused_by(info.value) == "delivery_run_workflow_same_community"
    assert deliveries(workflow_id=tenant.workflow.id) == 1


def test_a_run_cannot_move_to_another_workflow_under_its_deliveries(tenant):
    raw_insert(valid_columns(tenant))
    other_workflow = WorkflowFactory(community=tenant.community)

    with pytest.raises(IntegrityError) as info, transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_delivery_workflow_run SET workflow_id = %s WHERE community_id = %s AND id = %s",
            [other_workflow.id, tenant.community.id, tenant.run.id],
        )

    assert refused_by(info.value) == "delivery_run_workflow_same_community"
    assert deliveries(workflow_id=tenant.workflow.id, run_id=tenant.run.id) == 1


def test_commit_refuses_a_binding_whose_workflow_is_not_its_runs_and_writes_nothing(tenant):
    other_workflow = WorkflowFactory(community=tenant.community)
    binding = BindingFactory(run=tenant.run, message_event=tenant.event, workflow_id=other_workflow.id)

    with pytest.raises(ValidationError) as info:
        services.commit_deliveries(tenant.community.id, tenant.event, [binding])

    # One key judges the pair: the error names both fields.
    assert set(info.value.message_dict) == {"bindings.workflow_id", "bindings.run_id"}
    assert "no such workflow run of this workflow" in str(info.value)
    assert deliveries(community_id=tenant.community.id) == 0


def test_a_batch_of_messages_refuses_a_binding_whose_workflow_is_not_its_runs_and_writes_nothing(tenant):
    # The engine's batched sends commit through fanout.commit_messages: one statement for many
    # messages, the same key judging each binding (the good message is not written either).
    other_workflow = WorkflowFactory(community=tenant.community)
    second_event = EventFactory(community=tenant.community)
    good = BindingFactory(run=tenant.run, message_event=tenant.event)
    bad = BindingFactory(run=tenant.run, message_event=second_event, workflow_id=other_workflow.id)

    with pytest.raises(ValidationError) as info, transaction.atomic():
        fanout.commit_messages(tenant.community.id, [fanout.Message([good]), fanout.Message([bad])])

    assert set(info.value.message_dict) == {"messages.workflow_id", "messages.run_id"}
    assert deliveries(community_id=tenant.community.id) == 0


def test_a_run_pointing_at_another_communitys_workflow_is_rejected(tenant, other_tenant):
    with pytest.raises(IntegrityError) as info, transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO buzz_delivery_workflow_run (id, community_id, workflow_id) VALUES (%s, %s, %s)",
            [uuid.uuid4(), tenant.community.id, other_tenant.workflow.id],
        )

    assert refused_by(info.value) == "workflow_run_workflow_same_community"


@pytest.mark.parametrize(
    ("column", "value", "constraint"),
    [
        ("event_id", B31, "event_event_id_32_bytes"),
        ("event_id", B33, "event_event_id_32_bytes"),
        ("pubkey", B31, "event_pubkey_32_bytes"),
        ("pubkey", B33, "event_pubkey_32_bytes"),
    ],
)
def test_an_event_with_a_wrong_length_id_or_pubkey_is_rejected(tenant, column, value, constraint):
    columns = {"event_id": random32(), "pubkey": random32(), column: value}

    with pytest.raises(IntegrityError) as info, transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO buzz_delivery_event (community_id, event_id, created_at, kind, pubkey, content, tags)"
            " VALUES (%s, %s, now(), 1, %s, '', '[]')",
            [tenant.community.id, columns["event_id"], columns["pubkey"]],
        )

    assert refused_by(info.value) == constraint


# --- cascades -------------------------------------------------------------------------


@pytest.fixture
def two_runs_with_deliveries(tenant):
    """Two runs of the same workflow and two message events, one delivery for each pairing."""
    second_run = WorkflowRunFactory(community=tenant.community, workflow=tenant.workflow)
    second_event = EventFactory(community=tenant.community)
    for run in (tenant.run, second_run):
        for event in (tenant.event, second_event):
            raw_insert(
                {
                    **valid_columns(tenant),
                    "run_id": run.id,
                    "message_event_id": bytes(event.event_id),
                    "target_pubkey": random32(),
                }
            )
    return tenant, second_run, second_event


def deliveries(**filters: Any) -> int:
    return models.WorkflowAgentDelivery.objects.filter(**filters).count()


def test_deleting_a_run_deletes_its_deliveries_and_only_those(two_runs_with_deliveries):
    tenant, second_run, _ = two_runs_with_deliveries
    assert deliveries(run_id=tenant.run.id) == 2

    tenant.run.delete()

    assert deliveries(run_id=tenant.run.id) == 0
    assert deliveries(run_id=second_run.id) == 2


def test_deleting_a_workflow_deletes_its_runs_and_their_deliveries(two_runs_with_deliveries):
    tenant, _, _ = two_runs_with_deliveries
    other_workflow_delivery = {**valid_columns(make_tenant())}
    raw_insert(other_workflow_delivery)

    tenant.workflow.delete()

    assert deliveries(workflow_id=tenant.workflow.id) == 0
    assert not models.WorkflowRun.objects.filter(workflow_id=tenant.workflow.id).exists()
    assert deliveries(id=other_workflow_delivery["id"]) == 1


def test_deleting_a_message_event_deletes_the_deliveries_that_carry_it(two_runs_with_deliveries):
    tenant, _, second_event = two_runs_with_deliveries

    tenant.event.delete()

    assert deliveries(message_event_id=bytes(tenant.event.event_id)) == 0
    assert deliveries(message_event_id=bytes(second_event.event_id)) == 2


def test_deleting_a_run_through_raw_sql_cascades_as_well(community, message_event, make_binding, run):
    services.commit_deliveries(community.id, message_event, [make_binding(), make_binding()])

    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM buzz_delivery_workflow_run WHERE id = %s", [run.id])

    assert deliveries(run_id=run.id) == 0


# --- cascades find their deliveries through an index ---------------------------------------
#
# No claim or settle is a HOT update, so every index of the record costs an entry on each of
# them: the record keeps no index a cascade does not need (core 0036 dropped delivery_workflow_idx).
# Each cascade must still reach its deliveries through an index, never by reading the community:
# a crowd of other deliveries in the same community, and the cascade may fetch only its own.

CROWD = 2000


@pytest.fixture
def crowded(two_runs_with_deliveries):
    """``two_runs_with_deliveries`` beside :data:`CROWD` deliveries of another workflow, run and
    event of the same community, the tables analyzed."""
    tenant, second_run, second_event = two_runs_with_deliveries
    crowd_run = WorkflowRunFactory(community=tenant.community, workflow=WorkflowFactory(community=tenant.community))
    crowd_event = EventFactory(community=tenant.community)
    insert_delivery_rows(
        ["id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id",
         "message_event_id", "cause_kind", "cause_webhook_invocation_id", "max_attempts"],
        "SELECT gen_random_uuid(), %s, %s, %s, 's' || g, %s, %s, %s, 'webhook', gen_random_uuid(), 3"
        " FROM generate_series(1, %s) AS g",
        [tenant.community.id, crowd_run.workflow_id, crowd_run.id, random32(), random32(),
         bytes(crowd_event.event_id), CROWD],
    )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE buzz_delivery_delivery_record")
        cursor.execute("ANALYZE buzz_delivery_workflow_run")
    return tenant, second_run, second_event


def _record_reads() -> dict[str, int]:
    """What this transaction has read of the record so far: its sequential scans, the rows its
    index scans fetched, and the scans of each of its indexes."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT 'seq_scan', pg_stat_get_xact_numscans(c.oid) FROM pg_class c WHERE c.oid = %(t)s::regclass"
            # Rows fetched by index scans (counted on the index) and bitmap scans (on the table).
            " UNION ALL SELECT 'idx_tup_fetch', pg_stat_get_xact_tuples_fetched(%(t)s::regclass)"
            " + (SELECT sum(pg_stat_get_xact_tuples_fetched(i.indexrelid))::bigint"
            " FROM pg_index i WHERE i.indrelid = %(t)s::regclass)"
            " UNION ALL SELECT i.indexrelid::regclass::text, pg_stat_get_xact_numscans(i.indexrelid)"
            " FROM pg_index i WHERE i.indrelid = %(t)s::regclass",
            {"t": "buzz_delivery_delivery_record"},
        )
        return dict(cursor.fetchall())


CASCADES = {
    # what is deleted -> (the DELETE, the deliveries it must delete, the index that finds them)
    "run": ("buzz_delivery_workflow_run", lambda t, r, e: t.run.id, 2, "delivery_identity_key"),
    "workflow": ("buzz_delivery_workflow", lambda t, r, e: t.workflow.id, 4, "delivery_identity_key"),
    "message event": ("buzz_delivery_event", lambda t, r, e: t.event.id, 2, "delivery_message_event_idx"),
}


@pytest.mark.skipif(CITUS_MODE, reason="reads the statistics of one PostgreSQL node (the cascade runs on a shard)")
@pytest.mark.parametrize(("table", "row", "deleted", "index"), CASCADES.values(), ids=CASCADES.keys())
def test_a_cascade_finds_exactly_its_deliveries_through_an_index(crowded, table, row, deleted, index):
    tenant, second_run, second_event = crowded
    before = deliveries(community_id=tenant.community.id)
    reads = _record_reads()

    with connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {table} WHERE community_id = %s AND id = %s",
            [tenant.community.id, row(tenant, second_run, second_event)],
        )
    after = _record_reads()

    assert before - deliveries(community_id=tenant.community.id) == deleted
    assert after["seq_scan"] == reads["seq_scan"], (reads, after)
    # Its own deliveries only, never the crowd of the community.
    assert after["idx_tup_fetch"] - reads["idx_tup_fetch"] == deleted, (reads, after)
    assert after[index] > reads[index], (reads, after)
