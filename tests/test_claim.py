"""claim_delivery and claim_deliveries (SPEC sections 4.3 and 9): isolation, order, narrowing
by id and by the expected binding."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid

import pytest
from django.db import connection

from buzz_delivery import models, services
from buzz_delivery.services import Binding, Cause
from buzz_delivery.testing import (
    BindingFactory,
    CommunityFactory,
    EventFactory,
    Expr,
    WorkflowRunFactory,
    advance_to,
    random32,
    set_delivery_state,
)
from tests.conftest import db_clock

pytestmark = pytest.mark.django_db


def db_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def commit(bindings: list[Binding]) -> list[uuid.UUID]:
    first = bindings[0]
    event = models.Event.objects.get(community_id=first.community_id, event_id=first.message_event_id)
    return services.commit_deliveries(first.community_id, event, bindings)


def row(delivery_id: uuid.UUID) -> models.WorkflowAgentDelivery:
    return models.WorkflowAgentDelivery.objects.get(id=delivery_id)


def set_created_at(delivery_id: uuid.UUID, hours_ago: int) -> None:
    set_delivery_state(delivery_id, created_at=Expr("now() - make_interval(hours => %s)", [hours_ago]))


def test_a_claim_leases_the_delivery_from_the_database_clock(community, make_binding, django_assert_num_queries):
    binding = make_binding()
    (delivery_id,) = commit([binding])
    before = db_clock()

    with django_assert_num_queries(1):
        claim = services.claim_delivery(community.id, binding.target_pubkey, lease_seconds=45)

    after = db_clock()
    assert claim is not None
    stored = row(delivery_id)
    assert before <= stored.claimed_at <= after  # the claim statement's database clock
    assert claim.lease == services.Lease(
        community_id=community.id,
        delivery_id=delivery_id,
        target_pubkey=binding.target_pubkey,
        lease_generation=1,
        lease_until=stored.claimed_at + dt.timedelta(seconds=45),
    )
    assert claim.delivery.id == delivery_id
    assert claim.delivery.status == "claimed"
    assert (stored.status, stored.lease_generation, stored.attempt) == ("claimed", 1, 1)
    assert stored.lease_until == stored.claimed_at + dt.timedelta(seconds=45)


def test_a_claim_without_lease_seconds_uses_the_configured_default(community, make_binding, settings):
    settings.BUZZ_DELIVERY = {"LEASE_SECONDS": 90}
    binding = make_binding()
    commit([binding])

    claim = services.claim_delivery(community.id, binding.target_pubkey)

    assert claim.lease.lease_until == claim.delivery.claimed_at + dt.timedelta(seconds=90)


def test_a_claimed_delivery_is_not_claimed_again(community, make_binding):
    binding = make_binding()
    commit([binding])
    assert services.claim_delivery(community.id, binding.target_pubkey) is not None

    assert services.claim_delivery(community.id, binding.target_pubkey) is None


def test_a_claim_never_crosses_into_another_community_with_the_same_target(community, make_binding):
    target = random32()
    other_run = WorkflowRunFactory()
    other_event = EventFactory(community=other_run.community)
    (other_id,) = commit([BindingFactory(run=other_run, message_event=other_event, target_pubkey=target)])

    assert services.claim_delivery(community.id, target) is None
    assert row(other_id).status == "pending"

    (own_id,) = commit([make_binding(target_pubkey=target)])
    claim = services.claim_delivery(community.id, target)
    assert claim.lease.delivery_id == own_id
    assert services.claim_delivery(community.id, target) is None
    assert row(other_id).status == "pending"
    assert services.claim_delivery(other_run.community_id, target).lease.delivery_id == other_id


def test_a_claim_never_takes_a_delivery_addressed_to_another_target(community, make_binding):
    addressed = make_binding()
    (delivery_id,) = commit([addressed])

    assert services.claim_delivery(community.id, random32()) is None
    assert row(delivery_id).status == "pending"
    assert services.claim_delivery(community.id, addressed.target_pubkey).lease.delivery_id == delivery_id


def test_claims_take_the_oldest_delivery_first(community, make_binding):
    target = random32()
    ids = commit([make_binding(target_pubkey=target) for _ in range(3)])
    # created_at decides, not the order of ids: the last id is the oldest.
    for delivery_id, hours_ago in zip(ids, (2, 1, 3), strict=True):
        set_created_at(delivery_id, hours_ago)

    claimed = [services.claim_delivery(community.id, target).lease.delivery_id for _ in range(3)]

    assert claimed == [ids[2], ids[0], ids[1]]
    assert services.claim_delivery(community.id, target) is None


def test_claim_deliveries_takes_up_to_limit_oldest_first_each_with_its_own_lease(community, make_binding):
    target = random32()
    ids = commit([make_binding(target_pubkey=target) for _ in range(5)])
    for delivery_id, hours_ago in zip(ids, (5, 4, 3, 2, 1), strict=True):
        set_created_at(delivery_id, hours_ago)

    claims = services.claim_deliveries(community.id, target, limit=3)

    assert [c.lease.delivery_id for c in claims] == ids[:3]
    assert all(c.lease.lease_generation == 1 for c in claims)
    assert [c.lease.delivery_id for c in services.claim_deliveries(community.id, target, limit=10)] == ids[3:]


def test_delivery_id_narrows_the_claim_to_that_delivery(community, make_binding):
    target = random32()
    ids = commit([make_binding(target_pubkey=target) for _ in range(3)])
    for delivery_id, hours_ago in zip(ids, (3, 2, 1), strict=True):
        set_created_at(delivery_id, hours_ago)

    claim = services.claim_delivery(community.id, target, delivery_id=ids[2])

    assert claim.lease.delivery_id == ids[2]
    assert [row(i).status for i in ids] == ["pending", "pending", "claimed"]
    # Already claimed: the same hint again is a miss.
    assert services.claim_delivery(community.id, target, delivery_id=ids[2]) is None


@pytest.mark.parametrize("mismatch", ["unknown id", "another target", "another community"])
def test_a_delivery_id_hint_that_does_not_match_the_call_is_a_miss(community, make_binding, mismatch):
    binding = make_binding()
    (delivery_id,) = commit([binding])
    community_id, target, wanted = community.id, binding.target_pubkey, delivery_id
    if mismatch == "unknown id":
        wanted = uuid.uuid4()
    elif mismatch == "another target":
        target = random32()
    else:
        community_id = CommunityFactory().id

    assert services.claim_delivery(community_id, target, delivery_id=wanted) is None
    assert row(delivery_id).status == "pending"
    assert row(delivery_id).lease_generation == 0


def test_an_expected_binding_that_matches_every_field_claims_the_delivery(community, make_binding):
    binding = make_binding()
    (delivery_id,) = commit([binding])

    claim = services.claim_delivery(community.id, binding.target_pubkey, delivery_id=delivery_id, expected=binding)

    assert claim.lease.delivery_id == delivery_id
    assert Binding.of(claim.delivery) == binding


@pytest.mark.parametrize("field", ["community_id", "target_pubkey"])
def test_an_expected_binding_of_another_community_or_target_is_a_miss_before_any_sql(
    community, make_binding, django_assert_num_queries, field
):
    binding = make_binding()
    (delivery_id,) = commit([binding])
    other = uuid.uuid4() if field == "community_id" else random32()
    forged = dataclasses.replace(binding, **{field: other})

    with django_assert_num_queries(0):
        assert services.claim_delivery(community.id, binding.target_pubkey, expected=forged) is None
        assert (
            services.claim_delivery(community.id, binding.target_pubkey, delivery_id=delivery_id, expected=forged)
            is None
        )

    assert row(delivery_id).status == "pending"
    assert services.claim_delivery(community.id, binding.target_pubkey, expected=binding).lease.delivery_id == (
        delivery_id
    )


@pytest.mark.parametrize("field", ["workflow_id", "run_id", "step_id", "definition_event_id", "message_event_id"])
def test_an_expected_binding_that_differs_in_one_field_is_a_miss_and_leaves_the_delivery_claimable(
    community, make_binding, field
):
    binding = make_binding()
    (delivery_id,) = commit([binding])
    other = {
        "workflow_id": WorkflowRunFactory(community=community).workflow_id,
        "run_id": WorkflowRunFactory(community=community).id,
        "step_id": binding.step_id + "_other",
        "definition_event_id": random32(),
        "message_event_id": bytes(EventFactory(community=community).event_id),
    }[field]
    stale = dataclasses.replace(binding, **{field: other})

    assert services.claim_delivery(community.id, binding.target_pubkey, expected=stale) is None
    assert services.claim_delivery(community.id, binding.target_pubkey, delivery_id=delivery_id, expected=stale) is None

    stored = row(delivery_id)
    assert (stored.status, stored.lease_generation, stored.attempt) == ("pending", 0, 0)
    claim = services.claim_delivery(community.id, binding.target_pubkey, delivery_id=delivery_id, expected=binding)
    assert claim.lease.delivery_id == delivery_id
    assert claim.lease.lease_generation == 1


SCHEDULED = dt.datetime(2030, 5, 6, 7, 8, 9, tzinfo=dt.UTC)
STORED_CAUSES = {
    "event": Cause.event(b"\xaa" * 32),
    "schedule": Cause.schedule(SCHEDULED),
    "webhook": Cause.webhook(uuid.UUID("0190f2a4-0000-7000-8000-0000000000aa")),
}
OTHER_CAUSES = {
    "event": Cause.event(b"\xbb" * 32),
    "schedule": Cause.schedule(SCHEDULED + dt.timedelta(seconds=1)),
    "webhook": Cause.webhook(uuid.UUID("0190f2a4-0000-7000-8000-0000000000bb")),
}


@pytest.mark.parametrize("stored_kind", sorted(STORED_CAUSES))
@pytest.mark.parametrize("expected_kind", sorted(OTHER_CAUSES))
def test_an_expected_binding_with_another_cause_kind_or_cause_value_is_a_miss(
    community, make_binding, stored_kind, expected_kind
):
    """Each pair is either a cause-kind change or the same kind with another value."""
    binding = make_binding(cause=STORED_CAUSES[stored_kind])
    (delivery_id,) = commit([binding])
    stale = dataclasses.replace(binding, cause=OTHER_CAUSES[expected_kind])
    assert stale != binding

    assert services.claim_delivery(community.id, binding.target_pubkey, delivery_id=delivery_id, expected=stale) is None

    assert row(delivery_id).status == "pending"
    claim = services.claim_delivery(community.id, binding.target_pubkey, delivery_id=delivery_id, expected=binding)
    assert claim.lease.delivery_id == delivery_id


def test_an_expected_binding_picks_its_own_delivery_among_others_of_the_same_target(community, make_binding):
    target = random32()
    bindings = [make_binding(target_pubkey=target) for _ in range(3)]
    ids = commit(bindings)

    claim = services.claim_delivery(community.id, target, expected=bindings[1])

    assert claim.lease.delivery_id == ids[1]
    assert [row(i).status for i in ids] == ["pending", "claimed", "pending"]


def test_a_claim_in_a_community_that_is_not_active_is_a_miss(community, make_binding):
    binding = make_binding()
    (delivery_id,) = commit([binding])
    advance_to(community, "quiescing")

    assert services.claim_delivery(community.id, binding.target_pubkey) is None
    assert row(delivery_id).status == "pending"
