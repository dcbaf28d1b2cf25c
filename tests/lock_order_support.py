"""Set-ups shared by the lock-order tests of a multi-run settle against the agents' side
(``tests/test_settle_vs_agents_*_lock_order.py``)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from django.db import connection, transaction

from buzz_delivery import services as core
from buzz_delivery.agents.services import Accepted, accept_delivery
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.services import Cause, Lease
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.services import publish_definition, start_run
from buzz_delivery.workflows.testing import run_until_idle, send_step
from tests.conftest import BARRIER_TIMEOUT

LOCK_WORKFLOW_RUN = "SELECT 1 FROM buzz_workflows_run WHERE community_id = %s AND run_id = %s FOR NO KEY UPDATE"


@dataclass(frozen=True)
class TwoRunsInFlight:
    """Two workflow runs, each with a ``send_message`` step and an ``await: agent_run`` step in
    flight: ``leases`` of the sends in delivery id order (the first run's first), ``agent_runs``
    accepted from the asks the other way round (the second run's has the lower id)."""

    first: Any
    second: Any
    leases: list[Lease]
    agent_runs: list[Any]
    agent: bytes


def two_runs_in_flight(community: Any) -> TwoRunsInFlight:
    target, agent = random32(), random32()
    workflow = WorkflowFactory(community=community)
    steps = [send_step("send", [target]), send_step("ask", [agent], **{"await": "agent_run"})]
    publish_definition(community.id, workflow.id, {"steps": steps})
    first, second = (start_run(community.id, workflow.id, {}, cause=Cause.event(os.urandom(32))) for _ in range(2))
    run_until_idle(community.id)
    assert first.pk < second.pk

    def delivery(run: Any, step: str) -> WorkflowAgentDelivery:
        return WorkflowAgentDelivery.objects.get(run_id=run.pk, step_id=step)

    sends = [delivery(run, "send") for run in (first, second)]
    assert sends[0].id < sends[1].id  # the settle writes (and counts) the first run's first
    leases = [core.claim_delivery(community.id, target, delivery_id=d.id, lease_seconds=60).lease for d in sends]
    agent_runs = []
    for run in (second, first):
        claimed = core.claim_delivery(community.id, agent, delivery_id=delivery(run, "ask").id, lease_seconds=60)
        accepted = accept_delivery(claimed.lease)
        assert isinstance(accepted, Accepted)
        agent_runs.append(accepted.run_id)
    assert agent_runs[0] < agent_runs[1]
    return TwoRunsInFlight(first, second, leases, agent_runs, agent)


def hold_row(statement: str, params: list[Any], holding: threading.Event, release: threading.Event) -> None:
    """In a transaction of this thread: lock a row (``statement``), say so, keep it until released."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(statement, params)
        holding.set()
        assert release.wait(BARRIER_TIMEOUT)
