"""services.finish_deliveries: the batch settle (SPEC sections 4.5 and 9)."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
from django.core.exceptions import ValidationError

from buzz_delivery import services
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import random32
from tests.conftest import backdate_lease

pytestmark = pytest.mark.django_db


def claims_for(community, message_event, make_binding, n: int, target: bytes | None = None):
    target = target or random32()
    services.commit_deliveries(community.id, message_event, [make_binding(target_pubkey=target) for _ in range(n)])
    return services.claim_deliveries(community.id, target, limit=n, lease_seconds=30)


def test_a_batch_of_current_leases_settles_in_one_statement(
    community, message_event, make_binding, django_assert_num_queries
):
    claims = claims_for(community, message_event, make_binding, 5)

    with django_assert_num_queries(1):
        outcomes = services.finish_deliveries([c.lease for c in claims])

    assert outcomes == [services.Settled("finished")] * 5
    rows = WorkflowAgentDelivery.objects.filter(id__in=[c.lease.delivery_id for c in claims])
    assert sorted(rows.values_list("status", flat=True)) == ["finished"] * 5


def test_each_lease_gets_what_finish_delivery_would_have_said_in_lease_order(community, message_event, make_binding):
    current, settled_before, lapsed = claims_for(community, message_event, make_binding, 3)
    assert services.finish_delivery(settled_before.lease, "failed") == services.Settled("failed")
    backdate_lease(lapsed.lease.delivery_id)

    outcomes = services.finish_deliveries([lapsed.lease, current.lease, settled_before.lease])

    assert outcomes == [services.LeaseLost(), services.Settled("finished"), services.AlreadyTerminal("failed")]
    assert WorkflowAgentDelivery.objects.get(id=lapsed.lease.delivery_id).status == "claimed"


def test_a_failed_batch_records_the_failure_on_every_row(community, message_event, make_binding):
    claims = claims_for(community, message_event, make_binding, 2)

    services.finish_deliveries([c.lease for c in claims], "failed", failure_code="upstream_gone", failure_message="x")

    rows = WorkflowAgentDelivery.objects.filter(id__in=[c.lease.delivery_id for c in claims])
    assert set(rows.values_list("status", "failure_code", "failure_message")) == {("failed", "upstream_gone", "x")}


def test_bad_batches_are_refused_naming_the_argument_before_any_sql(
    community, message_event, make_binding, table_snapshot, django_assert_num_queries
):
    a, b = claims_for(community, message_event, make_binding, 2)
    other_community = dataclasses.replace(b.lease, community_id=uuid.uuid4())
    before = table_snapshot()
    cases = {
        "leases": [],
        "leases[1].delivery_id": [a.lease, a.lease],
        "leases[1].community_id": [a.lease, other_community],
        "leases[1]": [a.lease, "not a lease"],
    }
    for key, leases in cases.items():
        with pytest.raises(ValidationError) as caught, django_assert_num_queries(0):
            services.finish_deliveries(leases)
        assert key in caught.value.message_dict
    with pytest.raises(ValidationError) as caught:
        services.finish_deliveries([a.lease, b.lease], "retry")
    assert "outcome" in caught.value.message_dict
    with pytest.raises(ValidationError) as caught:
        services.finish_deliveries([a.lease], "finished", failure_code="nope")
    assert "failure_code" in caught.value.message_dict
    assert table_snapshot() == before


def test_leases_of_several_targets_of_one_community_settle_in_one_statement_each_fenced_by_its_target(
    community, message_event, make_binding, django_assert_num_queries
):
    first = claims_for(community, message_event, make_binding, 2)
    second = claims_for(community, message_event, make_binding, 2)
    # A lease naming the wrong target for its delivery matches nothing, as in finish_delivery.
    wrong = dataclasses.replace(second[1].lease, target_pubkey=first[0].lease.target_pubkey)
    leases = [first[0].lease, second[0].lease, first[1].lease, wrong]

    with django_assert_num_queries(3):  # the batch; for the one it missed, finish_delivery and its read
        outcomes = services.finish_deliveries(leases)

    assert outcomes == [services.Settled("finished")] * 3 + [services.LeaseLost()]
    statuses = dict(
        WorkflowAgentDelivery.objects.filter(id__in=[c.lease.delivery_id for c in first + second]).values_list(
            "id", "status"
        )
    )
    assert statuses == {
        first[0].lease.delivery_id: "finished",
        first[1].lease.delivery_id: "finished",
        second[0].lease.delivery_id: "finished",
        second[1].lease.delivery_id: "claimed",
    }
