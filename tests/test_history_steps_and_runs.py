"""Who holds a workflow step or an agent run, and their histories (issue 17), as for deliveries
(tests/test_history.py): the holder recorded by the claim, one entry per lease transition written
by its own statement, append-only (a trigger), bounded, the admin showing both."""

from __future__ import annotations

import json

import pytest
from django.core.exceptions import ValidationError
from django.db import DatabaseError, connection, transaction
from django.urls import reverse

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import (
    cancel_agent_run,
    claim_agent_runs,
    complete_run,
    fail_run,
    heartbeat,
    reap_agent_runs,
    request_approval,
)
from buzz_delivery.services import LeaseLost, Settled
from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.triggers import HISTORY_SQLSTATE
from buzz_delivery.workflows.models import Step
from buzz_delivery.workflows.orchestrator import Orchestrator, OrchestratorConfig
from buzz_delivery.workflows.services import (
    Decided,
    cancel_run,
    claim_steps,
    complete_step,
    decide_approval,
    fail_step,
    renew_step,
)
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from buzz_delivery.workflows.testing import function_step
from tests.agents_support import AGENT, backdate_run_lease, make_claimable, new_run
from tests.wf_support import backdate_step_lease, start

pytestmark = pytest.mark.django_db


@pytest.fixture
def workflow(community):
    return WorkflowFactory(community=community)


def history(table: str, row_id) -> list[dict]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT history::text FROM {table} WHERE id = %s", [row_id])
        return json.loads(cursor.fetchone()[0])


def brief(entries: list[dict]) -> list[tuple]:
    return [(e["event"], e["status"], e["generation"], e["actor"]) for e in entries]


def refused(sql: str, params: list) -> None:
    with pytest.raises(DatabaseError) as caught, transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params)
    assert getattr(caught.value.__cause__, "sqlstate", None) == HISTORY_SQLSTATE, caught.value


# --- steps --------------------------------------------------------------------------------


def test_a_step_records_its_holder_renewals_and_settle(workflow):
    start(workflow, {"steps": [function_step("a")]})
    [claim] = claim_steps(workflow.community_id, lease_seconds=30, holder="orch-1")
    assert claim.step.claimed_by == "orch-1"
    renew_step(claim.lease, 30)
    renew_step(claim.lease, 30)
    assert complete_step(claim.lease, {"ok": 1}) == Settled("succeeded")
    step = Step.objects.get(id=claim.lease.step_id)
    assert (step.claimed_by, step.renewals) == ("orch-1", 2)
    claim_entry, settle = history("buzz_workflows_step", step.id)
    assert brief([claim_entry, settle]) == [("claim", "running", 1, "orch-1"), ("settle", "succeeded", 1, "orch-1")]
    assert settle["renewals"] == 2 and claim_entry["attempt"] == 1
    assert claim_entry["at"] and settle["at"]


def test_a_step_retry_and_its_reaps_are_recorded(workflow):
    start(workflow, {"steps": [function_step("a", retry={"max_attempts": 3})]})
    [first] = claim_steps(workflow.community_id, lease_seconds=30, holder="orch-1")
    fail_step(first.lease, "boom")  # retried: back to ready behind its backoff
    with connection.cursor() as cursor:
        cursor.execute("UPDATE buzz_workflows_step SET next_attempt_at = NULL WHERE id = %s", [first.lease.step_id])
    [second] = claim_steps(workflow.community_id, lease_seconds=30, holder="orch-2")
    backdate_step_lease(second.lease.step_id)
    assert reap_workflow_steps().reclaimed == 1
    [third] = claim_steps(workflow.community_id, lease_seconds=30, holder="orch-3")
    backdate_step_lease(third.lease.step_id)
    assert reap_workflow_steps().exhausted == 1
    assert brief(history("buzz_workflows_step", first.lease.step_id)) == [
        ("claim", "running", 1, "orch-1"),
        ("retry", "ready", 1, "orch-1"),
        ("claim", "running", 2, "orch-2"),
        ("reap", "ready", 3, "reaper"),
        ("claim", "running", 4, "orch-3"),
        ("reap", "failed", 5, "reaper"),
    ]


def test_cancelling_a_run_records_the_cancel_on_each_open_step(workflow):
    run = start(workflow, {"steps": [function_step("a"), function_step("b", depends_on=["a"])]})
    [claim] = claim_steps(workflow.community_id, lease_seconds=30, holder="orch-1")
    cancel_run(workflow.community_id, run.pk)
    steps = {s.key: s for s in Step.objects.filter(run_id=run.pk)}
    held = history("buzz_workflows_step", steps["a"].id)
    assert brief(held) == [("claim", "running", 1, "orch-1"), ("cancel", "canceled", 2, "engine")]
    assert held[-1]["reason"] == "run_canceled" and held[-1]["renewals"] == 0
    assert brief(history("buzz_workflows_step", steps["b"].id)) == [("cancel", "canceled", 1, "engine")]
    assert complete_step(claim.lease, {}) == LeaseLost()


def test_a_bad_step_holder_is_refused_by_name_before_any_claim(workflow):
    start(workflow, {"steps": [function_step("a")]})
    with pytest.raises(ValidationError) as caught:
        claim_steps(workflow.community_id, holder="h" * 201)
    assert list(caught.value.message_dict) == ["holder"]
    step = Step.objects.get(community_id=workflow.community_id)  # the step's own key (Citus: no join on run_id)
    assert (step.state, step.lease_generation, step.claimed_by, step.history) == ("ready", 0, None, [])


def test_the_orchestrator_claims_as_host_pid_name(workflow):
    import os
    import socket
    import threading

    config = OrchestratorConfig(community_id=workflow.community_id, name="orch")
    orchestrator = Orchestrator(config, threading.Event())
    assert orchestrator.holder == f"{socket.gethostname()}:{os.getpid()}:orch"


def test_a_step_history_cannot_be_rewritten(workflow):
    start(workflow, {"steps": [function_step("a")]})
    [claim] = claim_steps(workflow.community_id, lease_seconds=30, holder="orch-1")
    where = " WHERE community_id = %s AND id = %s"
    ids = [workflow.community_id, claim.lease.step_id]
    refused("UPDATE buzz_workflows_step SET history = jsonb_set(history, '{0,actor}', '\"x\"')" + where, ids)
    refused("UPDATE buzz_workflows_step SET history = '[]'" + where, ids)
    assert brief(history("buzz_workflows_step", claim.lease.step_id)) == [("claim", "running", 1, "orch-1")]


# --- agent runs ------------------------------------------------------------------------------


def test_an_agent_run_records_claim_heartbeats_and_completion(community):
    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="gw:agent-1", lease_seconds=30)
    heartbeat(claimed.lease)
    complete_run(claimed.lease, {"done": True})
    run = AgentRun.objects.get(id=run_id)
    assert (run.worker_id, run.renewals) == ("gw:agent-1", 1)
    entries = history("buzz_agents_run", run_id)
    assert brief(entries) == [("claim", "running", 1, "gw:agent-1"), ("settle", "completed", 1, "gw:agent-1")]
    assert entries[-1]["renewals"] == 1


def test_an_agent_run_records_reaps_failure_and_cancel(community):
    reaped = new_run(community.id, max_attempts=3)
    claim_agent_runs(community.id, [AGENT], worker_id="w1", lease_seconds=30)
    backdate_run_lease(reaped)
    assert reap_agent_runs().reclaimed == 1
    make_claimable(reaped)
    (second,) = claim_agent_runs(community.id, [AGENT], worker_id="w2", lease_seconds=30)
    fail_run(second.lease, "boom", "it broke")
    assert brief(history("buzz_agents_run", reaped)) == [
        ("claim", "running", 1, "w1"),
        ("reap", "pending", 2, "reaper"),
        ("claim", "running", 3, "w2"),
        ("settle", "failed", 3, "w2"),
    ]
    cancelled = new_run(community.id)
    claim_agent_runs(community.id, [AGENT], worker_id="w3", lease_seconds=30)
    cancel_agent_run(community.id, cancelled, reason="stop", actor="operator:alice")
    assert brief(history("buzz_agents_run", cancelled))[-1] == ("cancel", "cancelled", 2, "operator:alice")


def test_an_approval_decision_resumes_the_run_with_an_entry_naming_who_decided(community):
    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w1", lease_seconds=30)
    requested = request_approval(claimed.lease, prompt="ship it?", deadline_seconds=600)
    assert isinstance(decide_approval(community.id, requested.approval_id, "approved", "alice"), Decided)
    assert brief(history("buzz_agents_run", run_id)) == [
        ("claim", "running", 1, "w1"),
        ("park", "waiting_approval", 1, "w1"),
        ("approval", "pending", 1, "alice"),
    ]


def test_an_agent_run_history_cannot_be_rewritten(community):
    run_id = new_run(community.id)
    claim_agent_runs(community.id, [AGENT], worker_id="w1", lease_seconds=30)
    where = " WHERE community_id = %s AND id = %s"
    refused("UPDATE buzz_agents_run SET history = history - 0" + where, [community.id, run_id])
    assert len(history("buzz_agents_run", run_id)) == 1


# --- the admin -------------------------------------------------------------------------------


def test_the_admin_shows_holders_and_histories_of_steps_and_runs(admin_client, workflow, community):
    start(workflow, {"steps": [function_step("a")]})
    [claim] = claim_steps(workflow.community_id, lease_seconds=30, holder="orch-1")
    complete_step(claim.lease, {"ok": 1})
    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="gw:agent-1", lease_seconds=30)
    complete_run(claimed.lease, {"done": True})
    for changelist, change, row_id, holder, column in (
        (
            "admin:buzz_workflows_step_changelist",
            "admin:buzz_workflows_step_change",
            claim.lease.step_id,
            "orch-1",
            "column-holder",
        ),
        # The agent-runs list pairs the agent and its holder in one column (fits 1400 px).
        (
            "admin:buzz_agents_agentrun_changelist",
            "admin:buzz_agents_agentrun_change",
            run_id,
            "gw:agent-1",
            "column-agent_holder",
        ),
    ):
        listing = admin_client.get(reverse(changelist)).content.decode()
        assert column in listing and holder in listing
        page = admin_client.get(reverse(change, args=[row_id])).content.decode()
        table = page[page.index('class="buzz-history"') :]
        table = table[: table.index("</table>")]
        assert table.index("settle") < table.index("claim") and table.count(holder) == 2
