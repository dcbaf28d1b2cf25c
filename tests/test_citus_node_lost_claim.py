"""Citus: an agent-run claim under concurrency limits (the community's claim lock, then the claim:
one transaction) whose worker connection is lost before its COMMIT (the worker restarted, its
backend terminated) fails the COMMIT with ``XX000`` ("could not commit transaction for shard N on
at least one active node"), psycopg's ``InternalError``. The services raise it as the
``OperationalError`` of a lost connection (nothing was kept), which the worker loops treat as the
database unavailable for a moment (retried next poll): as an ``InternalError`` it was an internal
error of ``run_agent_worker``'s loop, which stopped the worker (exit 1).

The real fault, timed: the worker nodes' backends are terminated right before the claim's COMMIT."""

from __future__ import annotations

from django.test import override_settings

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import claim_agent_runs
from buzz_delivery.testing import CommunityFactory
from buzz_delivery.worker.renewer import DB_UNAVAILABLE
from tests.agents_support import AGENT, new_run
from tests.citus_node_lost import PYTESTMARK, workers_lost_before_commit

pytestmark = PYTESTMARK


def test_a_limited_claim_whose_commit_lost_a_worker_raises_the_database_unavailable():
    community = CommunityFactory()
    run_id = new_run(community.id)
    raised: BaseException | None = None
    with override_settings(BUZZ_DELIVERY={"AGENT_CONCURRENCY_LIMITS": {"community": 5}}):
        with workers_lost_before_commit() as loss:  # the claim's last statement ran: before its COMMIT
            try:
                claim_agent_runs(community.id, [AGENT], worker_id="w1", lease_seconds=30)
            except Exception as exc:
                raised = exc
        assert loss.lost  # the claim committed a transaction (the limits' form)
        assert isinstance(raised, DB_UNAVAILABLE), f"{type(raised).__name__}: {raised}"
        assert AgentRun.objects.get(id=run_id).state == "pending"  # nothing kept
        (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w1", lease_seconds=30)  # next poll
        assert claimed.lease.run_id == run_id
