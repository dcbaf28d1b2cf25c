"""One community's locked rows never let the step leases of another community lapse in an
orchestrator serving every community (``run_workflow_worker --all``; docs/security.md,
docs/workflows.md).

One renewer thread renews the held steps of every community, one statement per community. A
lifecycle move of community A waiting behind a long transaction of A's own code queues every
write of A's rows behind it, A's renewal too: it waits a bounded time, and B's steps are renewed
meanwhile. Waits poll the database for a condition; nothing is timed.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection

from buzz_delivery.testing import CommunityFactory, EventFactory, WorkflowFactory
from buzz_delivery.workflows.orchestrator import Orchestrator, OrchestratorConfig, _key
from buzz_delivery.workflows.services import claim_steps
from buzz_delivery.workflows.testing import function_step
from tests.test_worker import wait_until
from tests.test_worker_tenant_locks import move_stuck_behind_a_long_transaction
from tests.wf_support import start

pytestmark = pytest.mark.django_db(transaction=True)


def claimed_step(community_id, key: str):
    start(WorkflowFactory(community_id=community_id), {"steps": [function_step(key)]})
    (claim,) = claim_steps(community_id, limit=10, lease_seconds=30)
    return claim.lease


def test_an_all_communities_orchestrator_renews_the_steps_of_one_community_while_another_is_stuck(community):
    other = CommunityFactory()
    EventFactory(community=community)  # the long transaction below writes it
    a, b = claimed_step(community.id, "a"), claimed_step(other.id, "b")
    orchestrator = Orchestrator(OrchestratorConfig(community_id=None, lease_seconds=30), threading.Event())
    orchestrator.held.update({_key(a): a, _key(b): b})

    def renew_round() -> None:
        try:
            orchestrator._renew_round([a, b])  # A first: an unbounded renewal of A holds up B's
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        with move_stuck_behind_a_long_transaction(community.id) as moving:
            round_done = pool.submit(renew_round)
            wait_until(round_done.done, timeout=30, what="the renewal round while A's move is stuck")
            round_done.result()
            assert orchestrator.held[_key(b)].lease_until > b.lease_until  # B's step was renewed
            assert orchestrator.held[_key(a)] == a  # A's was left for the next round, still held
            assert orchestrator.counts["renewed"] == 1
            assert not moving.done()
        assert moving.result(timeout=30).deletion_state == "quiescing"


def test_only_an_all_communities_orchestrator_bounds_its_renewals(community):
    def bound(community_id):
        return Orchestrator(OrchestratorConfig(community_id=community_id), threading.Event()).renew_lock_wait_ms

    assert bound(community.id) is None
    assert bound(None) is not None


def test_one_locked_step_row_does_not_keep_the_other_steps_of_its_community_from_renewal(community):
    """A long transaction holds one step row of community A: each round's statement of A's
    steps waits past the bound for it. A's other step, whose row nothing holds, is renewed all
    the same: one lease at a time after the statement waited, the held one tried last from the
    round after it waited (so by the second round), as B's is every round."""
    import psycopg

    from buzz_delivery.workflows.models import Step
    from project.database_url import database_url

    other = CommunityFactory()
    a_locked, a_free, b = (
        claimed_step(community.id, "a1"),
        claimed_step(community.id, "a2"),
        claimed_step(other.id, "b"),
    )
    orchestrator = Orchestrator(OrchestratorConfig(community_id=None, lease_seconds=30), threading.Event())
    orchestrator.held.update({_key(a_locked): a_locked, _key(a_free): a_free, _key(b): b})  # the held one first
    holder = psycopg.connect(database_url(connection.settings_dict))
    try:
        holder.execute(
            f"SELECT 1 FROM {Step._meta.db_table} WHERE community_id = %s AND id = %s FOR UPDATE",
            [community.id, a_locked.step_id],
        )
        for _ in range(2):
            orchestrator._renew_round(list(orchestrator.held.values()))
        assert orchestrator.held[_key(a_free)].lease_until > a_free.lease_until
        assert orchestrator.held[_key(b)].lease_until > b.lease_until
        assert orchestrator.held[_key(a_locked)] == a_locked  # still held, renewed once let go
    finally:
        holder.rollback()
        holder.close()
