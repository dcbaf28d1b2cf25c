"""Concurrency limits by key (issue 32, ``services/flow.py``, docs/flow-control.md): at most N
deliveries claimed at once per key the operator declares; a settle, a retry or the reaper frees
the slot in the statement that moves the delivery; bad definitions are refused naming the field."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, connection, transaction
from django.test import override_settings

from buzz_delivery import models, services
from buzz_delivery.checks import check_settings
from buzz_delivery.services import flow
from buzz_delivery.testing import WorkflowFactory, WorkflowRunFactory, random32, set_delivery_state
from tests.conftest import backdate_lease

pytestmark = pytest.mark.django_db

DELIVERY = models.DeliveryRecord._meta.db_table
QUEUE = models.DeliveryQueue._meta.db_table


def limits(**caps: int):
    return override_settings(BUZZ_DELIVERY={"CONCURRENCY_LIMITS": caps})


def commit(make_binding, message_event, target: bytes, n: int, **binding) -> list:
    bindings = [make_binding(target_pubkey=target, **binding) for _ in range(n)]
    return services.commit_deliveries(message_event.community_id, message_event, bindings)


def claimed(community, **filters) -> int:
    return models.WorkflowAgentDelivery.objects.filter(community_id=community.id, status="claimed", **filters).count()


def test_a_target_limit_caps_the_claims_of_that_target_and_a_settle_frees_a_slot(
    community, make_binding, message_event
):
    target, other = random32(), random32()
    commit(make_binding, message_event, target, 5)
    commit(make_binding, message_event, other, 3)
    with limits(target=2):
        first = services.claim_deliveries(community.id, target, limit=10)
        assert len(first) == 2
        assert services.claim_deliveries(community.id, target, limit=10) == []
        assert services.claim_delivery(community.id, target) is None
        assert len(services.claim_deliveries(community.id, other, limit=10)) == 2  # its own key

        assert isinstance(services.finish_delivery(first[0].lease, "finished"), services.Settled)
        (again,) = services.claim_deliveries(community.id, target, limit=10)
        assert services.finish_delivery(first[1].lease, "retry") == services.Settled(status="pending")
        assert len(services.claim_deliveries(community.id, target, limit=10)) == 1
    assert claimed(community, target_pubkey=target) == 2
    slots = models.WorkflowAgentDelivery.objects.filter(
        community_id=community.id, target_pubkey=target, status="claimed"
    )
    assert sorted(slots.values_list("slot_target", flat=True)) == [0, 1]
    assert again.delivery.slot_target in (0, 1)


def test_a_community_limit_holds_across_its_targets(community, make_binding, message_event):
    targets = [random32() for _ in range(3)]
    for target in targets:
        commit(make_binding, message_event, target, 2)
    with limits(community=3):
        taken = [len(services.claim_deliveries(community.id, t, limit=5)) for t in targets]
    assert taken == [2, 1, 0]
    assert claimed(community) == 3


def test_a_workflow_limit_holds_per_workflow_within_one_claim(community, message_event, make_binding):
    target = random32()
    runs = [WorkflowRunFactory(community=community, workflow=WorkflowFactory(community=community)) for _ in range(2)]
    for run in runs:
        commit(make_binding, message_event, target, 3, run=run)
    with limits(workflow=2, target=10):
        batch = services.claim_deliveries(community.id, target, limit=10)
    assert sorted(c.delivery.workflow_id for c in batch) == sorted(
        [runs[0].workflow_id] * 2 + [runs[1].workflow_id] * 2
    )


def test_priorities_are_claimed_first_under_a_limit(community, make_binding, message_event):
    target = random32()
    commit(make_binding, message_event, target, 3)
    urgent = services.commit_deliveries(community.id, message_event, [make_binding(target_pubkey=target)], priority=4)
    with limits(target=1):
        (first,) = services.claim_deliveries(community.id, target, limit=5)
    assert [first.delivery.id] == urgent


def test_a_lapsed_lease_holds_its_slot_until_the_reaper_takes_it_back(community, make_binding, message_event):
    target = random32()
    commit(make_binding, message_event, target, 2)
    with limits(target=1):
        held = services.claim_delivery(community.id, target)
        backdate_lease(held.lease.delivery_id)
        assert services.claim_delivery(community.id, target) is None  # lapsed, not yet reaped
        services.reap()
        nxt = services.claim_delivery(community.id, target)
    assert nxt is not None
    assert claimed(community, target_pubkey=target) == 1


def test_without_a_limit_a_claim_clears_the_slots_a_limited_claim_left(community, make_binding, message_event):
    target = random32()
    (one,) = commit(make_binding, message_event, target, 1)
    with limits(target=1):
        lease = services.claim_delivery(community.id, target).lease
    services.finish_delivery(lease, "retry")
    set_delivery_state((community.id, one), next_attempt_at=None)
    again = services.claim_delivery(community.id, target)
    assert (again.delivery.slot_target, again.delivery.slot_community, again.delivery.slot_workflow) == (None,) * 3


def test_the_database_refuses_a_second_claimed_delivery_on_a_held_slot(community, make_binding, message_event):
    target = random32()
    a, b = commit(make_binding, message_event, target, 2)
    with limits(target=2):
        services.claim_deliveries(community.id, target, limit=2)
    with (
        pytest.raises(IntegrityError, match="delivery_queue_slot_target_key"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        # The slots are the live queue's (issue 31, stage 2).
        cursor.execute(
            f"UPDATE {QUEUE} SET slot_target = 0 WHERE community_id = %s AND id = ANY(%s)", [community.id, [a, b]]
        )


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"tenant": 2}, "['tenant']"),
        ({"target": 0}, "['target']"),
        ({"target": 1001}, "['target']"),
        ({"target": True}, "['target']"),
        ({"target": "2"}, "['target']"),
        ([("target", 2)], "CONCURRENCY_LIMITS"),
    ],
)
def test_a_bad_limit_is_refused_naming_its_field_and_a_claim_writes_nothing(
    community, make_binding, message_event, value, field
):
    target = random32()
    commit(make_binding, message_event, target, 1)
    with pytest.raises(ImproperlyConfigured, match=field.replace("[", r"\[").replace("]", r"\]")):
        flow.parse_limits(value)
    with override_settings(BUZZ_DELIVERY={"CONCURRENCY_LIMITS": value}):
        assert [e.id for e in check_settings()] == ["buzz_delivery.E032"]
        with pytest.raises(ImproperlyConfigured, match="CONCURRENCY_LIMITS"):
            services.claim_deliveries(community.id, target, limit=5)
    assert claimed(community) == 0
    history = models.WorkflowAgentDelivery.objects.get(community_id=community.id, target_pubkey=target).history
    assert [entry["event"] for entry in history] == []


def test_the_claim_under_limits_keeps_citus_router_form():
    """Every statement names its community (rule 1 of tests/test_scale_out_rules.py, run on each)."""
    from tests.test_scale_out_rules import rule1_violations, rule2_violations, rule3_violations

    assert len(flow.LIMITED_CLAIMS) == 28
    for statement in flow.LIMITED_CLAIMS.values():
        assert not rule1_violations(statement) + rule2_violations(statement) + rule3_violations(statement)


def test_a_claim_by_id_honours_the_limit_too(community, make_binding, message_event):
    target = random32()
    first, second = commit(make_binding, message_event, target, 2)
    with limits(target=1):
        assert services.claim_delivery(community.id, target, delivery_id=first) is not None
        assert services.claim_delivery(community.id, target, delivery_id=second) is None
    assert claimed(community, target_pubkey=target) == 1
