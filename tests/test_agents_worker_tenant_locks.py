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


def test_one_locked_run_row_does_not_keep_the_other_run_leases_of_its_community_from_renewal(community):
    """A long transaction holds one run row of community A: that run's renewals wait past the
    bound, every round. A's other run, whose row nothing holds, is renewed all the same (its
    community's rounds do not always start with the locked run), as B's is."""
    import psycopg
    from django.db import connection

    from project.database_url import database_url

    other = CommunityFactory()
    a_locked, a_free, b_run = new_run(community.id), new_run(community.id), new_run(other.id)
    (locked_claim,) = s.claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    (free_claim,) = s.claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    (b_claim,) = s.claim_agent_runs(other.id, [AGENT], worker_id="w", lease_seconds=30)
    assert [c.lease.run_id for c in (locked_claim, free_claim, b_claim)] == [a_locked, a_free, b_run]
    heartbeat = Heartbeat(every=0.2, lease_seconds=30, bound_lock_waits=True)
    locked_ctx, free_ctx, b_ctx = Context(locked_claim), Context(free_claim), Context(b_claim)
    for ctx in (locked_ctx, free_ctx, b_ctx):  # the locked run first: renewed first
        heartbeat.hold(ctx)
    holder = psycopg.connect(database_url(connection.settings_dict))
    try:
        holder.execute(
            f"SELECT 1 FROM {AgentRun._meta.db_table} WHERE community_id = %s AND id = %s FOR UPDATE",
            [community.id, a_locked],
        )
        heartbeat.start()
        for ctx in (free_ctx, b_ctx):  # twice each: each renewal a round after the one before
            for _ in range(2):
                before = ctx.lease.lease_until
                wait_until(lambda c=ctx, b=before: c.lease.lease_until != b, timeout=30, what="a renewal")
        assert locked_ctx.lease == locked_claim.lease and not locked_ctx.lost.is_set()
    finally:
        holder.rollback()
        holder.close()
        heartbeat.stop.set()
        if heartbeat.ident is not None:
            heartbeat.join(timeout=30)
    assert not heartbeat.is_alive()
    assert not (free_ctx.lost.is_set() or b_ctx.lost.is_set())
