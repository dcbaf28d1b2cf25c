"""The reaper (SPEC sections 4.6 and 9): lapsed leases back to pending, fenced communities
skipped without aborting healthy ones, bounded batches."""

from __future__ import annotations

import pytest

from buzz_delivery import models, services
from buzz_delivery.services import LeaseLost, ReapResult
from buzz_delivery.testing import (
    BindingFactory,
    CommunityFactory,
    EventFactory,
    WorkflowRunFactory,
    advance_to,
    random32,
)
from tests.conftest import backdate_lease

pytestmark = pytest.mark.django_db


def claimed_and_lapsed(community: models.Community, count: int) -> list[services.Lease]:
    """Commit ``count`` deliveries in ``community``, claim them all and back-date their leases."""
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    target = random32()
    bindings = [BindingFactory(run=run, message_event=event, target_pubkey=target) for _ in range(count)]
    services.commit_deliveries(community.id, event, bindings)
    claims = services.claim_deliveries(community.id, target, limit=count)
    assert len(claims) == count
    for claim in claims:
        backdate_lease(claim.lease.delivery_id)
    return [claim.lease for claim in claims]


def statuses(community: models.Community) -> dict[str, int]:
    rows = models.WorkflowAgentDelivery.objects.filter(community=community).values_list("status", flat=True)
    out: dict[str, int] = {}
    for status in rows:
        out[status] = out.get(status, 0) + 1
    return out


def test_the_reaper_returns_a_lapsed_lease_to_pending_with_the_next_generation(community):
    (lease,) = claimed_and_lapsed(community, 1)

    result = services.reap()

    assert result == ReapResult(reclaimed=1, batches=2)
    row = models.WorkflowAgentDelivery.objects.get(id=lease.delivery_id)
    assert (row.status, row.lease_generation) == ("pending", lease.lease_generation + 1)
    assert (row.lease_until, row.claimed_at, row.finished_at) == (None, None, None)
    assert services.finish_delivery(lease, "finished") == LeaseLost()


def test_the_reaper_leaves_unexpired_leases_alone(community, make_binding, message_event):
    binding = make_binding()
    services.commit_deliveries(community.id, message_event, [binding])
    claim = services.claim_delivery(community.id, binding.target_pubkey, lease_seconds=15)

    assert services.reap_expired_deliveries() == 0

    row = models.WorkflowAgentDelivery.objects.get(id=claim.lease.delivery_id)
    assert (row.status, row.lease_generation) == ("claimed", 1)


def test_a_lease_ending_exactly_at_the_database_now_is_not_reaped(community):
    (lease,) = claimed_and_lapsed(community, 1)
    backdate_lease(lease.delivery_id, seconds=0)  # lease_until = now(): not yet lapsed

    assert services.reap_expired_deliveries() == 0
    backdate_lease(lease.delivery_id, seconds=0.001)
    assert services.reap_expired_deliveries() == 1


@pytest.mark.parametrize("state", ["quiescing", "fenced"])
def test_the_reaper_skips_communities_that_are_not_active_while_reaping_healthy_ones(community, state):
    healthy_leases = claimed_and_lapsed(community, 2)
    retired = CommunityFactory()
    retired_leases = claimed_and_lapsed(retired, 1)
    advance_to(retired, state)

    result = services.reap()

    assert result.reclaimed == 2
    assert result.skipped_fenced == 1
    assert statuses(community) == {"pending": 2}
    row = models.WorkflowAgentDelivery.objects.get(id=retired_leases[0].delivery_id)
    assert (row.status, row.lease_generation) == ("claimed", retired_leases[0].lease_generation)
    assert all(
        models.WorkflowAgentDelivery.objects.get(id=lease.delivery_id).lease_generation == 2 for lease in healthy_leases
    )


def test_reap_expired_deliveries_returns_the_number_reclaimed_as_an_int(community):
    claimed_and_lapsed(community, 3)

    reaped = services.reap_expired_deliveries()

    assert type(reaped) is int
    assert reaped == 3
    assert services.reap_expired_deliveries() == 0


def test_the_reaper_works_in_bounded_batches(community):
    claimed_and_lapsed(community, 5)

    result = services.reap(batch_size=2, max_batches=1)

    assert (result.reclaimed, result.batches) == (2, 1)
    assert statuses(community) == {"pending": 2, "claimed": 3}


def test_reap_expired_deliveries_honours_its_batch_bounds(community):
    claimed_and_lapsed(community, 5)

    assert services.reap_expired_deliveries(batch_size=2, max_batches=1) == 2
    assert services.reap_expired_deliveries(batch_size=2, max_batches=1) == 2
    assert services.reap_expired_deliveries(batch_size=2, max_batches=1) == 1
    assert statuses(community) == {"pending": 5}


def test_without_max_batches_the_reaper_runs_batches_until_done(community):
    claimed_and_lapsed(community, 5)

    result = services.reap(batch_size=2)

    assert result.reclaimed == 5
    # 2 + 2 + 1 lapsed leases, then one pass over overdue pending deliveries.
    assert result.batches == 4
    assert statuses(community) == {"pending": 5}


def test_a_dry_run_counts_what_would_be_reaped_and_writes_nothing(community, table_snapshot):
    claimed_and_lapsed(community, 2)
    before = table_snapshot()

    result = services.reap(dry_run=True)

    assert (result.reclaimed, result.dry_run) == (2, True)
    assert table_snapshot() == before


def test_a_reclaimed_delivery_can_be_claimed_again_by_a_new_holder(community):
    (lease,) = claimed_and_lapsed(community, 1)
    services.reap_expired_deliveries()

    claim = services.claim_delivery(community.id, lease.target_pubkey)

    assert claim.lease.delivery_id == lease.delivery_id
    assert claim.lease.lease_generation == lease.lease_generation + 2
    assert claim.delivery.attempt == 2
