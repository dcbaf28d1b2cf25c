"""Helpers of the agent-run tests."""

from __future__ import annotations

import uuid
from typing import Any

from django.db import connection

from buzz_delivery import services as core
from buzz_delivery.agents.models import AgentRun, IntakeKey, JournalEntry, StepWait
from buzz_delivery.agents.services import AgentLease, Created, claim_agent_runs, intake_event
from buzz_delivery.testing import DeliveryFactory, random32
from buzz_delivery.workflows.models import Approval

AGENT_MODELS = (JournalEntry, IntakeKey, StepWait, AgentRun, Approval)


def counts() -> dict[str, int]:
    """Rows per agent table (and the engine's approvals, the core's deliveries)."""
    from buzz_delivery.models import WorkflowAgentDelivery

    return {m._meta.db_table: m._base_manager.count() for m in (*AGENT_MODELS, WorkflowAgentDelivery)}


def new_run(community_id: Any, agent: bytes | None = None, **kwargs: Any) -> uuid.UUID:
    """A pending run created through ``intake_event`` with a fresh key."""
    outcome = intake_event(community_id, "test", uuid.uuid4().hex, {"n": 1}, agent or AGENT, **kwargs)
    assert isinstance(outcome, Created)
    return outcome.run_id


def claim(community_id: Any, run_id: Any = None, worker: str = "w1", agent: bytes | None = None) -> AgentLease:
    """Claim the oldest pending run of ``agent`` (asserting it is ``run_id`` when given)."""
    (claimed,) = claim_agent_runs(community_id, [agent or AGENT], worker_id=worker, lease_seconds=30)
    if run_id is not None:
        assert claimed.lease.run_id == run_id
    return claimed.lease


def backdate_run_lease(run_id: Any, seconds: float = 3600) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_agents_run SET lease_until = now() - make_interval(secs => %s),"
            " claimed_at = buzz_delivery_plus_seconds(claimed_at, -%s) WHERE id = %s",
            [seconds, seconds, run_id],
        )


def make_claimable(run_id: Any) -> None:
    """Skip a reclaimed run's backoff (raw SQL: time passing)."""
    with connection.cursor() as cursor:
        cursor.execute("UPDATE buzz_agents_run SET next_attempt_at = NULL WHERE id = %s", [run_id])


def delivery_lease(run: Any, target: bytes | None = None) -> core.Lease:
    """Commit one delivery on ``run`` (a core WorkflowRun) to ``target`` and claim it."""
    from buzz_delivery.testing import BindingFactory

    target = target or AGENT
    delivery = DeliveryFactory(binding=BindingFactory(run=run, target_pubkey=target))
    claimed = core.claim_delivery(run.community_id, target, delivery_id=delivery.id, lease_seconds=30)
    assert claimed is not None
    return claimed.lease


AGENT = random32()
