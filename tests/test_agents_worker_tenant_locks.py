"""One community's locked rows never let the run leases of another community the agent worker
serves lapse (docs/security.md, docs/agents.md).

``run_agent_worker`` serves several communities (``--community`` given more than once, or every
community with work): one :class:`~buzz_delivery.agents.runtime.Heartbeat` thread renews every
run lease it holds. A lifecycle move of community A waiting behind a long transaction of A's
own code queues every write of A's rows behind it, A's renewals too: they wait a bounded time,
and B's renewals go on meanwhile. Waits poll the database for a condition; nothing is timed.
"""

from __future__ import annotations

import pytest

from buzz_delivery.agents import services as s
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.runtime import Context, Heartbeat
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig
from buzz_delivery.testing import CommunityFactory, EventFactory, WorkflowRunFactory
from tests.agents_support import AGENT, new_run
from tests.test_worker import wait_until
from tests.test_worker_tenant_locks import move_stuck_behind_a_long_transaction

pytestmark = pytest.mark.django_db(transaction=True)


def heartbeat_at(run_id):
    return AgentRun.objects.get(id=run_id).heartbeat_at


def test_a_lifecycle_move_stuck_in_one_community_lets_no_run_lease_of_another_lapse(community):
    other = CommunityFactory()
    EventFactory(community=community)  # the long transaction below writes it
    WorkflowRunFactory(community=community)  # its workflow: the probe of a queued write writes it
    a_run, b_run = new_run(community.id), new_run(other.id)
    (a_claim,) = s.claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    (b_claim,) = s.claim_agent_runs(other.id, [AGENT], worker_id="w", lease_seconds=30)
    assert (a_claim.lease.run_id, b_claim.lease.run_id) == (a_run, b_run)
    heartbeat = Heartbeat(every=0.2, lease_seconds=30, bound_lock_waits=True)
    a_ctx, b_ctx = Context(a_claim), Context(b_claim)
    heartbeat.hold(a_ctx)  # A first: an unbounded renewal of A would hold up B's behind it
    heartbeat.hold(b_ctx)
    a_before = heartbeat_at(a_run)
    try:
        with move_stuck_behind_a_long_transaction(community.id) as moving:
            heartbeat.start()
            # B's lease is renewed twice (each renewal a round after the one before) while A's move
            # is stuck and A's renewals cannot go through.
            first = b_ctx.lease.lease_until
            wait_until(lambda: b_ctx.lease.lease_until != first, timeout=30, what="B's first renewal")
            second = b_ctx.lease.lease_until
            wait_until(lambda: b_ctx.lease.lease_until != second, timeout=30, what="B's second renewal")
            assert heartbeat_at(b_run) is not None
            assert not moving.done()
            assert heartbeat_at(a_run) == a_before
            assert a_ctx.lease == a_claim.lease and not a_ctx.lost.is_set()
        assert moving.result(timeout=30).deletion_state == "quiescing"
    finally:
        heartbeat.stop.set()
        if heartbeat.ident is not None:
            heartbeat.join(timeout=30)
    assert not heartbeat.is_alive()
    assert not b_ctx.lost.is_set()


def test_only_an_agent_worker_serving_several_communities_bounds_its_renewals(community):
    other = CommunityFactory()

    def bound(communities):
        config = WorkerConfig(handler=lambda ctx: None, agents=[AGENT], communities=communities, worker_id="w")
        return AgentWorker(config).heartbeat.lock_wait_ms

    assert bound([community.id]) is None
    assert bound([community.id, community.id]) is None
    assert bound([community.id, other.id]) is not None
    assert bound([]) is not None  # every community with work
