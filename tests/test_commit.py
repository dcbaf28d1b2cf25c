"""The producer side: lock_delivery_identity and commit_deliveries (SPEC sections 2, 4.1, 4.2, 9).

Wake hints (NOTIFY) are tested elsewhere; these tests cover what is written and returned.
"""

from __future__ import annotations

import datetime as dt
import threading
import uuid

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, transaction

from buzz_delivery import models, services
from buzz_delivery.exceptions import NotInTransaction
from buzz_delivery.services import Binding, Cause
from buzz_delivery.testing import (
    BindingFactory,
    CommunityFactory,
    EventFactory,
    WorkflowFactory,
    WorkflowRunFactory,
    random32,
)
from buzz_delivery.triggers import IDENTITY_LOCK_NAMESPACE

pytestmark = pytest.mark.django_db


def delivery_count() -> int:
    return models.WorkflowAgentDelivery.objects.count()


def test_commit_creates_one_row_per_binding_and_returns_their_ids_in_binding_order(
    community, message_event, make_binding
):
    bindings = [make_binding() for _ in range(3)]

    created = services.commit_deliveries(community.id, message_event, bindings)

    assert len(created) == 3
    for delivery_id, binding in zip(created, bindings, strict=True):
        row = models.WorkflowAgentDelivery.objects.get(id=delivery_id)
        assert Binding.of(row) == binding
        assert row.status == "pending"
        assert row.lease_generation == 0
        assert row.attempt == 0
        assert row.lease_until is None and row.claimed_at is None and row.finished_at is None


@pytest.mark.parametrize(
    "cause",
    [
        Cause.event(b"\x01" * 32),
        Cause.schedule(dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)),
        Cause.webhook(uuid.UUID("0190f2a4-0000-7000-8000-000000000001")),
    ],
    ids=["event", "schedule", "webhook"],
)
def test_every_cause_kind_round_trips_through_the_stored_row(community, message_event, make_binding, cause):
    binding = make_binding(cause=cause)

    (created,) = services.commit_deliveries(community.id, message_event, [binding])

    row = models.WorkflowAgentDelivery.objects.get(id=created)
    assert row.cause_kind == cause.kind
    assert Binding.of(row) == binding


def test_a_producer_retry_of_the_same_bindings_returns_an_empty_list_and_writes_no_row(
    community, message_event, make_binding, table_snapshot
):
    bindings = [make_binding() for _ in range(3)]
    services.commit_deliveries(community.id, message_event, bindings)
    before = table_snapshot()

    retried = services.commit_deliveries(community.id, message_event, bindings)

    assert retried == []
    assert table_snapshot() == before
    assert delivery_count() == 3


def test_a_retry_that_adds_one_binding_creates_only_the_new_one(community, message_event, make_binding):
    first = [make_binding(), make_binding()]
    services.commit_deliveries(community.id, message_event, first)
    extra = make_binding()

    created = services.commit_deliveries(community.id, message_event, [*first, extra])

    assert len(created) == 1
    assert Binding.of(models.WorkflowAgentDelivery.objects.get(id=created[0])) == extra
    assert delivery_count() == 3


def test_a_retry_with_the_same_identity_but_other_fields_is_skipped_and_leaves_the_row_unchanged(
    community, message_event, make_binding, table_snapshot
):
    original = make_binding()
    services.commit_deliveries(community.id, message_event, [original])
    before = table_snapshot()
    # Same (community, run, step_id, target): a retry, even if other fields differ.
    variant = make_binding(
        step_id=original.step_id,
        target_pubkey=original.target_pubkey,
        definition_event_id=random32(),
        cause=Cause.webhook(uuid.uuid4()),
    )

    assert services.commit_deliveries(community.id, message_event, [variant]) == []
    assert table_snapshot() == before


def test_the_same_step_for_another_target_is_a_new_delivery(community, message_event, make_binding):
    original = make_binding()
    services.commit_deliveries(community.id, message_event, [original])

    created = services.commit_deliveries(community.id, message_event, [make_binding(step_id=original.step_id)])

    assert len(created) == 1
    assert delivery_count() == 2


def test_lock_delivery_identity_says_false_before_the_first_commit_and_true_after_it(
    community, run, message_event, make_binding
):
    binding = make_binding(step_id="send_message_1")

    with transaction.atomic():
        assert services.lock_delivery_identity(community.id, run.id, "send_message_1") is False
        services.commit_deliveries(community.id, message_event, [binding])
    with transaction.atomic():
        assert services.lock_delivery_identity(community.id, run.id, "send_message_1") is True
        # Another step of the same run has no delivery yet.
        assert services.lock_delivery_identity(community.id, run.id, "send_message_2") is False


def test_lock_delivery_identity_is_scoped_to_the_community(community, run, message_event, make_binding):
    services.commit_deliveries(community.id, message_event, [make_binding(step_id="step")])
    other = CommunityFactory()

    with transaction.atomic():
        assert services.lock_delivery_identity(other.id, run.id, "step") is False


def test_lock_delivery_identity_takes_an_advisory_lock_in_the_callers_transaction(community, run):
    def identity_locks() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
                " AND classid = %s AND objsubid = 2 AND granted",
                [IDENTITY_LOCK_NAMESPACE],
            )
            return cursor.fetchone()[0]

    assert identity_locks() == 0
    with transaction.atomic():
        services.lock_delivery_identity(community.id, run.id, "step")
        assert identity_locks() == 1


@pytest.mark.django_db(transaction=True)
def test_lock_delivery_identity_refuses_to_run_outside_a_transaction(django_assert_num_queries):
    community = CommunityFactory()
    run = WorkflowRunFactory(community=community)
    assert not connection.in_atomic_block

    with django_assert_num_queries(0), pytest.raises(NotInTransaction):
        services.lock_delivery_identity(community.id, run.id, "step")


@pytest.mark.django_db(transaction=True)
def test_lock_delivery_identity_holds_the_identity_against_a_second_producer_until_commit():
    community = CommunityFactory()
    run = WorkflowRunFactory(community=community)
    lock_sql = "SELECT pg_try_advisory_xact_lock(%s, hashtext(%s))"
    key = f"{community.id}/{run.id}/step"
    seen: dict[str, bool] = {}

    def second_producer(label: str) -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(lock_sql, [IDENTITY_LOCK_NAMESPACE, key])
                seen[label] = cursor.fetchone()[0]
        finally:
            connection.close()

    with transaction.atomic():
        services.lock_delivery_identity(community.id, run.id, "step")
        worker = threading.Thread(target=second_producer, args=("while_held",))
        worker.start()
        worker.join()
    worker = threading.Thread(target=second_producer, args=("after_commit",))
    worker.start()
    worker.join()

    assert seen == {"while_held": False, "after_commit": True}


def test_a_binding_of_another_community_is_refused_before_any_sql_and_nothing_is_written(
    community, message_event, make_binding, table_snapshot, django_assert_num_queries
):
    foreign_run = WorkflowRunFactory()
    foreign = BindingFactory(run=foreign_run, message_event=message_event)
    before = table_snapshot()

    with django_assert_num_queries(0), pytest.raises(ValidationError) as info:
        services.commit_deliveries(community.id, message_event, [make_binding(), foreign])

    assert set(info.value.message_dict) == {"bindings[1].community_id"}
    assert table_snapshot() == before


def test_a_message_event_of_another_community_is_refused_before_any_sql(
    community, make_binding, table_snapshot, django_assert_num_queries
):
    foreign_event = EventFactory()
    binding = make_binding()
    before = table_snapshot()

    with django_assert_num_queries(0), pytest.raises(ValidationError) as info:
        services.commit_deliveries(community.id, foreign_event, [binding])

    assert set(info.value.message_dict) == {"message_event"}
    assert table_snapshot() == before


@pytest.mark.parametrize(
    ("bad_entry", "field"),
    [
        ("not a binding", "bindings[2]"),
        ("other message event", "bindings[2].message_event_id"),
        ("repeated identity", "bindings[2]"),
    ],
)
def test_one_bad_binding_refuses_the_whole_commit_before_any_sql(
    community, message_event, make_binding, table_snapshot, django_assert_num_queries, bad_entry, field
):
    good = [make_binding(), make_binding()]
    if bad_entry == "not a binding":
        bad = {"step_id": "x"}
    elif bad_entry == "other message event":
        bad = make_binding(message_event_id=random32())
    else:
        bad = make_binding(step_id=good[0].step_id, target_pubkey=good[0].target_pubkey)
    before = table_snapshot()

    with django_assert_num_queries(0), pytest.raises(ValidationError) as info:
        services.commit_deliveries(community.id, message_event, [*good, bad])

    assert set(info.value.message_dict) == {field}
    assert table_snapshot() == before


@pytest.mark.parametrize("foreign", ["run", "workflow"])
def test_a_binding_whose_run_or_workflow_belongs_to_another_community_refuses_the_whole_commit(
    community, run, message_event, make_binding, table_snapshot, foreign
):
    other_run = WorkflowRunFactory()  # another community
    if foreign == "run":
        bad = make_binding(run_id=other_run.id)
    else:
        bad = make_binding(workflow_id=WorkflowFactory(community=other_run.community).id)
    good = [make_binding(), make_binding()]
    before = table_snapshot()

    with pytest.raises(ValidationError) as info:
        services.commit_deliveries(community.id, message_event, [*good, bad])

    # One key (core 0036) judges the pair: the error names both of its fields, whichever is foreign.
    assert set(info.value.message_dict) == {"bindings.run_id", "bindings.workflow_id"}
    assert table_snapshot() == before
    # The caller's transaction is still usable, and a corrected commit goes through.
    assert len(services.commit_deliveries(community.id, message_event, good)) == 2


def test_a_commit_inside_the_callers_transaction_rolls_back_with_it(community, message_event, make_binding):
    class Abort(Exception):
        pass

    with pytest.raises(Abort), transaction.atomic():
        created = services.commit_deliveries(community.id, message_event, [make_binding()])
        assert len(created) == 1
        raise Abort

    assert delivery_count() == 0


def test_a_commit_writes_each_created_record_and_its_live_queue_row_from_it(community, message_event, make_binding):
    """Issue 31, stage 2: the commit's second statement gives every record it created a queue row
    (pending, the record's ordering, policy and history copied; the singleton key set only with a
    key), in the same transaction; a producer's retry writes neither again."""
    from buzz_delivery.services import fanout

    not_before = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    expires = dt.datetime(2031, 1, 1, tzinfo=dt.UTC)
    bindings = [make_binding(), make_binding()]
    ids = services.commit_deliveries(
        community.id, message_event, bindings, priority=3, not_before=not_before, expires_at=expires
    )
    (keyed,) = services.commit_deliveries(community.id, message_event, [make_binding()], singleton_key="k").created
    with transaction.atomic():
        (sent,) = fanout.commit_messages(community.id, [fanout.Message([make_binding()], priority=-2)])
    assert services.commit_deliveries(community.id, message_event, bindings) == []
    columns = ("priority", "created_at", "max_attempts", "next_attempt_at", "expires_at", "history", "workflow_id")
    queue = {q.id: q for q in models.DeliveryQueue.objects.filter(community_id=community.id)}
    assert set(queue) == {*ids, keyed, sent}
    for record in models.DeliveryRecord.objects.filter(community_id=community.id):
        row = queue[record.id]
        assert (row.status, row.lease_generation, row.attempt, row.target_pubkey) == (
            "pending", 0, 0, record.target_pubkey
        )  # fmt: skip
        assert [getattr(row, c) for c in columns] == [getattr(record, c) for c in columns]
        assert row.singleton_key == ("k" if record.id == keyed else None) == record.singleton_key
    assert [queue[i].priority for i in ids] == [3, 3] and queue[sent].priority == -2
    assert queue[ids[0]].next_attempt_at == not_before and queue[ids[0]].expires_at == expires
