"""Back to the workflow (SPEC 11 "send_message", SPEC 12): a ``send_message`` step with
``await: agent_run`` ends when the agent runs started from its deliveries are terminal, counted in
the transaction that ended each, with their outputs keyed by target hex as its output."""

from __future__ import annotations

import pytest

from buzz_delivery import services as core
from buzz_delivery.agents.models import AgentRun, JournalEntry, StepWait
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import Accepted, accept_delivery, cancel_agent_run, claim_agent_runs
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.models import Step
from buzz_delivery.workflows.services import cancel_run, decide_approval, get_run
from buzz_delivery.workflows.testing import function_step, run_until_idle, send_step
from tests import agent_handlers as h
from tests.wf_support import run_state, start, states

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_LEDGER", str(tmp_path / "ledger.txt"))
    monkeypatch.delenv("AGENT_KILL", raising=False)


@pytest.fixture
def workflow(community):
    return WorkflowFactory(community=community)


def accept_all(run, modes):
    """Each target's agent accepts its delivery (input ``mode`` picks its behaviour)."""
    accepted = {}
    for d in WorkflowAgentDelivery.objects.filter(run_id=run.pk):
        target = bytes(d.target_pubkey)
        claim = core.claim_delivery(d.community_id, target, delivery_id=d.id, lease_seconds=30)
        outcome = accept_delivery(claim.lease, input={"mode": modes[target]})
        assert isinstance(outcome, Accepted)
        accepted[target] = outcome.run_id
    return accepted


def work(community, agents):
    """Run every claimable agent run once; returns the results."""
    results = []
    for agent in agents:
        for claim in claim_agent_runs(community.id, [agent], worker_id="w", limit=10):
            results.append(run_claim(claim, h.by_agent))
    return results


def test_a_workflow_awaits_its_agents_calls_approval_and_compensation_and_gets_their_outputs(workflow):
    calls, approver, failer = random32(), random32(), random32()
    modes = {calls: "calls", approver: "approval", failer: "fail"}
    run = start(
        workflow,
        {
            "steps": [
                send_step("ask", [calls, approver, failer], content="do it", **{"await": "agent_run"},
                          tolerate_failures=1),
                function_step("after", depends_on=["ask"]),
            ]
        },
    )  # fmt: skip
    run_until_idle(workflow.community_id)
    agent_runs = accept_all(run, modes)
    step = Step.objects.get(run_id=run.pk, key="ask")
    assert step.state == "waiting"  # the deliveries are finished, but the agents have not run
    assert StepWait.objects.get(step_id=step.id).done == 0
    assert sorted(work(workflow.community, [calls, approver, failer])) == ["compensated", "completed", "parked"]
    assert Step.objects.get(pk=step.pk).state == "waiting"  # the approver is still out
    approval_id = AgentRun.objects.get(id=agent_runs[approver]).approval_id
    decide_approval(workflow.community_id, approval_id, "approved", "alice")
    assert work(workflow.community, [approver]) == ["completed"]
    step.refresh_from_db()
    assert step.state == "succeeded"
    assert step.output[calls.hex()] == {"sum": 6, "agent": "three_calls"}
    assert step.output[approver.hex()] == {"decision": "approved", "calls": [1, 2]}
    assert step.output[failer.hex()] == {"state": "failed", "failure_code": "tool_call_failed"}
    undone = JournalEntry.objects.filter(run_id=agent_runs[failer], compensation_status="compensated")
    assert sorted(undone.values_list("seq", flat=True)) == [1, 2, 3]
    run_until_idle(workflow.community_id)
    assert states(run) == {"ask": "succeeded", "after": "succeeded"}
    assert run_state(run) == "succeeded"


def test_more_failed_agent_runs_than_tolerated_fail_the_step(workflow):
    a, b = random32(), random32()
    run = start(workflow, {"steps": [send_step("ask", [a, b], **{"await": "agent_run"})]})
    run_until_idle(workflow.community_id)
    accepted = accept_all(run, {a: "calls", b: "calls"})
    assert cancel_agent_run(workflow.community_id, accepted[b], reason="no") is not None
    assert Step.objects.get(run_id=run.pk, key="ask").state == "waiting"
    work(workflow.community, [a])
    step = Step.objects.get(run_id=run.pk, key="ask")
    assert (step.state, step.failure_code) == ("failed", "agent_runs_failed")
    assert step.output[b.hex()] == {"state": "cancelled", "failure_code": "cancelled"}
    assert run_state(run) == "failed"


def test_a_delivery_that_fails_before_any_agent_accepts_it_counts_as_a_failed_agent_run(workflow):
    a, b = random32(), random32()
    run = start(workflow, {"steps": [send_step("ask", [a, b], **{"await": "agent_run"}, tolerate_failures=1)]})
    run_until_idle(workflow.community_id)
    deliveries = {bytes(d.target_pubkey): d for d in WorkflowAgentDelivery.objects.filter(run_id=run.pk)}
    claim = core.claim_delivery(workflow.community_id, b, delivery_id=deliveries[b].id, lease_seconds=30)
    core.finish_delivery(claim.lease, "failed", failure_code="agent_refused")
    claim = core.claim_delivery(workflow.community_id, a, delivery_id=deliveries[a].id, lease_seconds=30)
    accept_delivery(claim.lease, input={"mode": "calls"})
    assert Step.objects.get(run_id=run.pk, key="ask").state == "waiting"
    work(workflow.community, [a])
    step = Step.objects.get(run_id=run.pk, key="ask")
    assert step.state == "succeeded"
    assert step.output[b.hex()] == {"state": "delivery_failed", "failure_code": "agent_refused"}


def test_await_delivered_steps_are_untouched_by_the_agents_app(workflow):
    a = random32()
    run = start(workflow, {"steps": [send_step("ask", [a])]})
    run_until_idle(workflow.community_id)
    d = WorkflowAgentDelivery.objects.get(run_id=run.pk)
    claim = core.claim_delivery(workflow.community_id, a, delivery_id=d.id, lease_seconds=30)
    accept_delivery(claim.lease)
    assert not StepWait.objects.exists()
    assert Step.objects.get(run_id=run.pk, key="ask").state == "succeeded"


def test_cancelling_the_workflow_run_cancels_its_agent_runs(workflow):
    a = random32()
    run = start(workflow, {"steps": [send_step("ask", [a], **{"await": "agent_run"})]})
    run_until_idle(workflow.community_id)
    accepted = accept_all(run, {a: "calls"})
    (claim,) = claim_agent_runs(workflow.community_id, [a], worker_id="w")
    cancel_run(workflow.community_id, run.pk)
    agent_run = AgentRun.objects.get(id=accepted[a])
    assert (agent_run.state, agent_run.failure_code) == ("cancelled", "workflow_canceled")
    assert agent_run.lease_generation == claim.lease.lease_generation + 1
    cancelled = agent_run.history[-1]
    assert (cancelled["event"], cancelled["status"], cancelled["actor"]) == ("cancel", "cancelled", "engine")
    assert cancelled["generation"] == agent_run.lease_generation
    assert get_run(workflow.community_id, run.pk).state == "canceled"


def test_await_agent_run_is_refused_by_name_when_the_agents_app_is_not_installed(monkeypatch):
    from django.apps import apps
    from django.core.exceptions import ValidationError

    from buzz_delivery.workflows.definition import validate_definition

    definition = {"steps": [send_step("s", [random32()], **{"await": "agent_run"})]}
    assert validate_definition(definition)["steps"][0]["await"] == "agent_run"
    real = apps.is_installed
    monkeypatch.setattr(apps, "is_installed", lambda name: name != "buzz_delivery.agents" and real(name))
    with pytest.raises(ValidationError) as info:
        validate_definition(definition)
    assert list(info.value.message_dict) == ["steps[0].await"]


def test_cancelling_the_workflow_run_expires_the_approval_its_agent_run_waited_for(workflow, tmp_path, monkeypatch):
    from buzz_delivery.workflows.models import Approval
    from buzz_delivery.workflows.services import Expired

    monkeypatch.setenv("AGENT_LEDGER", str(tmp_path / "ledger.txt"))
    a = random32()
    run = start(workflow, {"steps": [send_step("ask", [a], **{"await": "agent_run"})]})
    run_until_idle(workflow.community_id)
    accepted = accept_all(run, {a: "approve"})
    (claim,) = claim_agent_runs(workflow.community_id, [a], worker_id="w")
    assert run_claim(claim, h.approve_then_call) == "parked"
    approval_id = AgentRun.objects.get(id=accepted[a]).approval_id
    assert Approval.objects.get(id=approval_id).state == "pending"

    cancel_run(workflow.community_id, run.pk)

    approval = Approval.objects.get(id=approval_id)
    assert approval.state == "expired" and approval.closed_at is not None
    late = decide_approval(workflow.community_id, approval_id, "approved", "alice")
    assert isinstance(late, Expired)  # a late decision is refused, not accepted for nothing
    # Its first call carries a compensation: the run unwinds before it ends (issue 28).
    agent_run = AgentRun.objects.get(id=accepted[a])
    assert (agent_run.state, agent_run.unwinding, agent_run.failure_code) == ("pending", True, "workflow_canceled")
    assert work(workflow.community, [a]) == ["compensated"]
    agent_run = AgentRun.objects.get(id=accepted[a])
    assert (agent_run.state, agent_run.failure_code) == ("cancelled", "workflow_canceled")
    assert [x for x in h.ledger_lines() if x.startswith("undo")] == [f"undo {accepted[a]}:1:compensate"]
    assert f"resumed {accepted[a]}" not in h.ledger_lines()  # an unwinding run never runs its handler


# -- A workflow cancel compensates its agent runs' calls (issue 28: no tool call is left
# uncompensated), as the operator's cancel_agent_run does.


def one_agent_run(workflow, agent):
    """A workflow run parked on one agent run of ``agent`` (accepted, not claimed)."""
    run = start(workflow, {"steps": [send_step("ask", [agent], **{"await": "agent_run"})]})
    run_until_idle(workflow.community_id)
    return run, accept_all(run, {agent: "calls"})[agent]


def undone(run_id) -> list[int]:
    """The seqs whose compensation ran (``counted_undo``: a line per execution), in ledger order."""
    prefix = f"ran {run_id}:"
    return [int(line[len(prefix) :].split(":")[0]) for line in h.ledger_lines() if line.startswith(prefix)]


@pytest.mark.django_db(transaction=True)
def test_a_workflow_cancel_unwinds_a_worker_held_agent_run_2_then_1_once_each_and_ends_it_cancelled(workflow, settings):
    """A real worker (its threads, its heartbeat) accepts the delivery, makes two calls with
    registered compensations and holds the run; the workflow run is cancelled through the
    engine's service: the holder learns it at its next heartbeat, the worker claims the run
    again and undoes call 2 then call 1, once each, and the run ends cancelled."""
    import threading
    import time

    from buzz_delivery.agents.services import AlreadyTerminal
    from buzz_delivery.agents.worker import AgentWorker, WorkerConfig

    settings.BUZZ_DELIVERY = {**settings.BUZZ_DELIVERY, "MIN_LEASE_SECONDS": 1}
    community = workflow.community
    agent = random32()
    run = start(workflow, {"steps": [send_step("ask", [agent], **{"await": "agent_run"})]})
    run_until_idle(community.id)
    worker = AgentWorker(
        WorkerConfig(
            handler=h.two_calls_then_hold, agents=[agent], communities=[community.id], lease_seconds=3,
            poll_seconds=0.2, exit_when_idle=True, worker_id="w", shutdown_grace=5,
        )
    )  # fmt: skip
    counts: dict = {}
    thread = threading.Thread(target=lambda: counts.update(worker.run()), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not any(line.startswith("holding ") for line in h.ledger_lines()):
            assert time.monotonic() < deadline and thread.is_alive(), counts
            time.sleep(0.05)
        agent_run = AgentRun.objects.get(community_id=community.id, source_run_id=run.pk)
        assert [e.status for e in JournalEntry.objects.filter(run_id=agent_run.id).order_by("seq")] == [
            "succeeded",
            "succeeded",
        ]

        cancel_run(community.id, run.pk)

        thread.join(60)
    finally:
        worker.stop()
        thread.join(10)
    assert not thread.is_alive()
    assert [counts.get(k, 0) for k in ("accepted", "lost", "compensated", "internal_errors")] == [1, 1, 1, 0], counts
    assert get_run(community.id, run.pk).state == "canceled"
    assert undone(agent_run.id) == [2, 1]  # reverse order, each compensation run once
    agent_run.refresh_from_db()
    assert (agent_run.state, agent_run.failure_code) == ("cancelled", "workflow_canceled")
    journal = JournalEntry.objects.filter(run_id=agent_run.id).order_by("seq")
    assert list(journal.values_list("compensation_status", flat=True)) == ["compensated", "compensated"]
    events = [(e["event"], e["status"], e["actor"]) for e in agent_run.history]
    assert ("cancel", "pending", "engine") in events  # sent to unwind by the engine's cancel
    assert cancel_agent_run(community.id, agent_run.id) == AlreadyTerminal("cancelled")


def test_a_workflow_cancel_fences_a_holder_mid_call_and_its_pending_call_is_compensated_first(workflow):
    from buzz_delivery.agents.services import (
        Cancelled,
        LeaseLost,
        Recorded,
        heartbeat,
        journal_call,
        record_call_result,
    )

    a = random32()
    run, agent_run_id = one_agent_run(workflow, a)
    (claim,) = claim_agent_runs(workflow.community_id, [a], worker_id="w")
    compensation = {"function": "tests.agent_handlers:counted_undo"}
    assert journal_call(claim.lease, "effect", {"n": 1}, compensation=compensation).seq == 1
    assert record_call_result(claim.lease, 1, ok=True, output={"n": 1}) == Recorded("succeeded")
    assert journal_call(claim.lease, "effect", {"n": 2}, compensation=compensation).seq == 2  # mid-call

    cancel_run(workflow.community_id, run.pk)

    row = AgentRun.objects.get(id=agent_run_id)
    assert (row.state, row.unwinding, row.failure_code) == ("pending", True, "workflow_canceled")
    assert row.lease_generation == claim.lease.lease_generation + 1
    assert (row.history[-1]["event"], row.history[-1]["status"], row.history[-1]["actor"]) == (
        "cancel",
        "pending",
        "engine",
    )
    # The holder learns the cancel and can write nothing more; an operator's cancel adds nothing.
    assert heartbeat(claim.lease) == LeaseLost("cancelled")
    assert record_call_result(claim.lease, 2, ok=True, output={"n": 2}) == LeaseLost("cancelled")
    assert cancel_agent_run(workflow.community_id, agent_run_id) == Cancelled(agent_run_id)
    assert AgentRun.objects.get(id=agent_run_id).lease_generation == row.lease_generation

    assert work(workflow.community, [a]) == ["compensated"]
    assert undone(agent_run_id) == [2, 1]  # the uncertain call first, then the one under it
    row = AgentRun.objects.get(id=agent_run_id)
    assert (row.state, row.failure_code) == ("cancelled", "workflow_canceled")
    journal = JournalEntry.objects.filter(run_id=agent_run_id).order_by("seq")
    assert [(e.status, e.uncertain, e.compensation_status) for e in journal] == [
        ("succeeded", False, "compensated"),
        ("failed", True, "compensated"),
    ]
    assert claim_agent_runs(workflow.community_id, [a], worker_id="w2") == []


def test_a_workflow_cancel_ends_an_agent_run_with_nothing_to_undo_at_once_and_closes_its_pending_call(workflow):
    from buzz_delivery.agents.services import Recorded, journal_call, record_call_result

    a = random32()
    run, agent_run_id = one_agent_run(workflow, a)
    (claim,) = claim_agent_runs(workflow.community_id, [a], worker_id="w")
    assert journal_call(claim.lease, "lookup", {"n": 1}).seq == 1  # no compensation
    assert record_call_result(claim.lease, 1, ok=True, output={"n": 1}) == Recorded("succeeded")
    assert journal_call(claim.lease, "lookup", {"n": 2}).seq == 2  # no compensation, left pending

    cancel_run(workflow.community_id, run.pk)

    row = AgentRun.objects.get(id=agent_run_id)
    assert (row.state, row.unwinding, row.failure_code) == ("cancelled", False, "workflow_canceled")
    assert row.lease_generation == claim.lease.lease_generation + 1
    journal = JournalEntry.objects.filter(run_id=agent_run_id).order_by("seq")
    assert [(e.status, e.uncertain) for e in journal] == [("succeeded", False), ("failed", True)]
    assert claim_agent_runs(workflow.community_id, [a], worker_id="w2") == []
    assert h.ledger_lines() == []
