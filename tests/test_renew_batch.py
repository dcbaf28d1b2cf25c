"""services.renew_deliveries: a holder's renewal round in one statement (SPEC sections 4.4 and 9,
issue 29), each lease fenced on its own."""

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


def rows(claims) -> dict:
    ids = [c.lease.delivery_id for c in claims]
    return {
        r[0]: r[1:]
        for r in WorkflowAgentDelivery.objects.filter(id__in=ids).values_list(
            "id", "status", "lease_generation", "lease_until", "renewals"
        )
    }


def test_a_round_of_current_leases_renews_in_one_statement_as_renew_delivery_would(
    community, message_event, make_binding, django_assert_num_queries
):
    claims = claims_for(community, message_event, make_binding, 4)
    before = rows(claims)

    with django_assert_num_queries(1):
        outcomes = services.renew_deliveries([c.lease for c in claims], 120)

    assert [type(o) for o in outcomes] == [services.Renewed] * 4
    after = rows(claims)
    for claim, outcome in zip(claims, outcomes, strict=True):
        status, generation, until, renewals = after[claim.lease.delivery_id]
        assert (status, generation, renewals) == ("claimed", claim.lease.lease_generation, 1)
        assert until > before[claim.lease.delivery_id][2]  # 30 s -> 120 s from now
        assert outcome.lease == dataclasses.replace(claim.lease, lease_until=until)


def test_a_stale_lease_in_the_round_is_lost_alone_and_its_row_is_untouched(community, message_event, make_binding):
    current, lapsed, settled, reclaimed = claims_for(community, message_event, make_binding, 4)
    backdate_lease(reclaimed.lease.delivery_id)
    assert services.reap().reclaimed == 1  # its generation bumped: the old holder is fenced
    (again,) = services.claim_deliveries(community.id, reclaimed.lease.target_pubkey, limit=1, lease_seconds=30)
    assert again.lease.delivery_id == reclaimed.lease.delivery_id and again.lease.lease_generation > 1
    backdate_lease(lapsed.lease.delivery_id)  # lapsed, not yet reaped
    assert services.finish_delivery(settled.lease, "finished") == services.Settled("finished")
    untouched = rows([lapsed, settled, reclaimed])

    outcomes = services.renew_deliveries([lapsed.lease, current.lease, settled.lease, reclaimed.lease])

    assert [type(o) for o in outcomes] == [services.LeaseLost, services.Renewed, services.LeaseLost, services.LeaseLost]
    assert rows([lapsed, settled, reclaimed]) == untouched
    assert rows([current])[current.lease.delivery_id][3] == 1


def test_leases_of_several_targets_renew_together_each_fenced_by_its_target(community, message_event, make_binding):
    first = claims_for(community, message_event, make_binding, 1)[0]
    second = claims_for(community, message_event, make_binding, 1)[0]
    wrong = dataclasses.replace(second.lease, target_pubkey=first.lease.target_pubkey)

    outcomes = services.renew_deliveries([first.lease, wrong])

    assert isinstance(outcomes[0], services.Renewed) and outcomes[1] == services.LeaseLost()
    assert rows([second])[second.lease.delivery_id][3] == 0


def test_bad_rounds_are_refused_naming_the_argument_before_any_sql(
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
            services.renew_deliveries(leases)
        assert key in caught.value.message_dict
    for key, call in {
        "leases": lambda: services.renew_deliveries("ab"),
        "lease_seconds": lambda: services.renew_deliveries([a.lease, b.lease], 10**9),
    }.items():
        with pytest.raises(ValidationError) as caught, django_assert_num_queries(0):
            call()
        assert key in caught.value.message_dict
    assert table_snapshot() == before
