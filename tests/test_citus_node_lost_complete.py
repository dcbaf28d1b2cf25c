"""Citus: the in-process runtime's ``complete_run`` whose COMMIT lost a worker's connection (the
worker restarted, its backend terminated: ``XX000`` "could not commit transaction for shard N on
at least one active node", an ``InternalError``; the transaction rolled back) is tried once more
on a fresh connection, as a lost connection's ``OperationalError`` is: before, the run was
``lost`` with its handler done, its lease left to lapse and an attempt counted (on its last:
``failed``/``attempts_exhausted``, its calls compensated) for a passing fault.

The real fault, timed: the worker nodes' backends are terminated right before the completion's COMMIT."""

from __future__ import annotations

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import claim_agent_runs
from buzz_delivery.agents.services import sql as agent_sql
from buzz_delivery.testing import CommunityFactory
from tests.agents_support import AGENT, new_run
from tests.citus_node_lost import PYTESTMARK, workers_lost_before_commit

pytestmark = PYTESTMARK


def test_a_completion_whose_commit_lost_a_worker_is_tried_again_not_the_run_lost():
    community = CommunityFactory()
    run_id = new_run(community.id)
    (claim,) = claim_agent_runs(community.id, [AGENT], worker_id="w1", lease_seconds=60)
    # the first completion's statement ran: before its COMMIT
    with workers_lost_before_commit(after=agent_sql.COMPLETE_IF_CURRENT.strip()[:60]) as loss:
        result = run_claim(claim, lambda ctx: {"ok": True})

    assert loss.lost == 1  # the fault was met
    assert result == "completed"
    assert len(loss.seen) == 2  # the completion, then once more on a fresh connection
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.output) == ("completed", {"ok": True})
