"""Delivery priority (issue 32, docs/flow-control.md): set at commit within a small CHECKed
range; claims take higher priorities first, oldest first within one, through the polling index
whose order they are, so a claim reads only the rows it takes whatever the mix."""

from __future__ import annotations

import json

import pytest
from django.core.exceptions import ValidationError
from django.db import connection

from buzz_delivery import models, services
from buzz_delivery.services import cached
from buzz_delivery.testing import backdate, insert_delivery_rows, random32
from tests.plan_support import generic_explain

pytestmark = pytest.mark.django_db

DELIVERY = models.DeliveryRecord._meta.db_table
QUEUE = models.DeliveryQueue._meta.db_table  # the claims' table (issue 31, stage 2)


def commit(make_binding, message_event, target: bytes, priority: int | None, n: int = 1) -> list:
    bindings = [make_binding(target_pubkey=target) for _ in range(n)]
    extra = {} if priority is None else {"priority": priority}
    return services.commit_deliveries(message_event.community_id, message_event, bindings, **extra)


def test_claims_take_higher_priorities_first_and_the_oldest_first_within_one(community, make_binding, message_event):
    target = random32()
    low = commit(make_binding, message_event, target, -3, 2)
    default = commit(make_binding, message_event, target, None, 2)
    high = commit(make_binding, message_event, target, 7, 2)
    top = commit(make_binding, message_event, target, models.PRIORITY_MAX)
    later_high = commit(make_binding, message_event, target, 7)

    first = services.claim_delivery(community.id, target)
    batch = services.claim_deliveries(community.id, target, limit=4)
    rest = services.claim_deliveries(community.id, target, limit=10)

    order = [first.delivery.id] + [c.delivery.id for c in batch] + [c.delivery.id for c in rest]
    assert order == top + high + later_high + default + low
    assert [c.delivery.priority for c in batch] == [7, 7, 7, 0]


def test_a_retried_delivery_keeps_its_priority_and_goes_before_older_lower_ones(community, make_binding, message_event):
    target = random32()
    (old,) = commit(make_binding, message_event, target, 0)
    (urgent,) = commit(make_binding, message_event, target, 5)
    claim = services.claim_delivery(community.id, target)
    assert claim.delivery.id == urgent
    services.finish_delivery(claim.lease, "retry")
    backdate((community.id, urgent), next_attempt_at=1)  # the backoff passes
    assert services.claim_delivery(community.id, target).delivery.id == urgent
    assert services.claim_delivery(community.id, target).delivery.id == old


@pytest.mark.parametrize("bad", [models.PRIORITY_MAX + 1, models.PRIORITY_MIN - 1, True, 1.0, "1", None])
def test_a_priority_out_of_range_or_not_an_int_is_refused_naming_it_and_nothing_is_written(
    community, make_binding, message_event, bad
):
    before = models.WorkflowAgentDelivery.objects.filter(community_id=community.id).count()
    with pytest.raises(ValidationError) as info:
        services.commit_deliveries(community.id, message_event, [make_binding()], priority=bad)
    assert "priority" in info.value.message_dict
    assert models.WorkflowAgentDelivery.objects.filter(community_id=community.id).count() == before


def test_the_database_refuses_a_priority_outside_the_range(community, make_binding, message_event):
    (created,) = commit(make_binding, message_event, random32(), 0)
    with pytest.raises(Exception, match="delivery_priority_range"), connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {DELIVERY} SET priority = %s WHERE community_id = %s AND id = %s",
            [models.PRIORITY_MAX + 1, community.id, created],
        )


def _scanned_rows(plan: dict) -> int:
    """Rows the claim's scans of the live queue returned (its index scan, its lock)."""
    total = 0
    stack = [plan["Plan"]]
    while stack:
        node = stack.pop()
        if node.get("Relation Name") == QUEUE and node.get("Index Name") == "delivery_queue_poll_idx":
            total += node["Actual Rows"] * node.get("Actual Loops", 1)
        stack += node.get("Plans", [])
    return total


def test_the_claim_reads_only_the_rows_it_takes_among_many_of_lower_priority(community, make_binding, message_event):
    """The generic plan (what the claim's function caches) walks the polling index in the claim's
    order: 5 urgent rows under 20,000 older ordinary ones are the first 5 it reads."""
    target = random32()
    (seed,) = commit(make_binding, message_event, target, 0)
    insert_delivery_rows(
        ["id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id",
         "message_event_id", "cause_kind", "cause_webhook_invocation_id", "priority", "created_at"],
        f"""SELECT gen_random_uuid(), community_id, workflow_id, run_id, 'bulk-' || g, target_pubkey,
                   definition_event_id, message_event_id, cause_kind, gen_random_uuid(),
                   CASE WHEN g > 20000 THEN 9 ELSE 0 END, now() - make_interval(secs => (30000 - g) / 1000.0)
            FROM {DELIVERY}, generate_series(1, 20005) AS g WHERE community_id = %s AND id = %s""",
        [community.id, seed],
    )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {DELIVERY}")
        cursor.execute(f"ANALYZE {QUEUE}")
    params = {"community_id": community.id, "target_pubkey": target, "limit": 5, "lease_seconds": 60.0, "holder": None}
    ((plan,),) = generic_explain(cached.CLAIM, params, "ANALYZE, FORMAT JSON")
    plan = plan[0] if isinstance(plan, list) else json.loads(plan)[0]

    assert _scanned_rows(plan) == 5, json.dumps(plan)[:3000]
    claimed = models.WorkflowAgentDelivery.objects.filter(community_id=community.id, status="claimed")
    assert set(claimed.values_list("priority", flat=True)) == {9}
    assert claimed.count() == 5
