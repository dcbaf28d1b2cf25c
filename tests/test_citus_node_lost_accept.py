"""Citus: an in-process accept (``accept_claim``) whose COMMIT lost a worker's connection (the
worker restarted, its backend terminated: ``XX000`` "could not commit transaction for shard N on
at least one active node", an ``InternalError``; the transaction rolled back) is tried again on a
fresh connection, as ``complete_run`` is: before, the delivery was settled ``retry`` at once,
one of its attempts spent (on its last: ``failed``/``attempts_exhausted``, no run) for a passing
fault. The real fault, timed: the worker nodes' backends are terminated right before the
accept's COMMIT."""

from __future__ import annotations

from buzz_delivery import services as core
from buzz_delivery.agents.acceptance import accept_claim
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import sql as agent_sql
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory, random32
from tests.citus_node_lost import PYTESTMARK, workers_lost_before_commit
from tests.operator_support import pending

pytestmark = PYTESTMARK


def test_an_accept_whose_commit_lost_a_worker_is_tried_again_not_settled_retry():
    community = CommunityFactory()
    agent = random32()
    delivery = pending(community, target_pubkey=agent)
    claim = core.claim_delivery(community.id, agent, delivery_id=delivery.pk, lease_seconds=60)
    with workers_lost_before_commit(after=agent_sql.INSERT_RUN_FROM_DELIVERY.strip()[:60]) as loss:
        outcome = accept_claim(claim)

    assert loss.lost == 1  # the fault was met
    assert outcome == "accepted"
    assert len(loss.seen) == 2  # the accept, then once more on a fresh connection
    after = WorkflowAgentDelivery.objects.get(pk=delivery.pk)
    assert (after.status, after.attempt) == ("finished", 1)
    assert AgentRun.objects.filter(community_id=community.id, delivery_id=delivery.pk).count() == 1
