"""Races between an operator's or a workflow's cancel and the transitions that move the same
run tree the other way (issue 28): each 50 times on real threads and connections. No error
reaches a caller (``deadlock detected`` was raised as is), each side gets a typed outcome, and
nothing is left non-terminal. And an agent run never starts after its workflow run's cancel."""

from __future__ import annotations

import os
import threading

import pytest
from django.db import connections

from buzz_delivery import services as core
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import (
    Accepted,
    AlreadyTerminal,
    Finished,
    Journaled,
    LeaseLost,
    RunEnded,
    accept_delivery,
    claim_agent_runs,
    complete_run,
    journal_call,
    reap_agent_runs,
)
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.services import AlreadyTerminal as StepAlreadyTerminal
from buzz_delivery.services import Cause, Settled
from buzz_delivery.services import LeaseLost as StepLeaseLost
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.models import Run
from buzz_delivery.workflows.services import (
    Canceled,
    cancel_run,
    claim_steps,
    complete_step,
    publish_definition,
    start_run,
)
from buzz_delivery.workflows.states import RUN_TERMINAL
from buzz_delivery.workflows.testing import function_step, run_until_idle, send_step
from tests.agents_support import backdate_run_lease
from tests.citus_mode import repetitions

pytestmark = pytest.mark.django_db(transaction=True)

REPETITIONS = repetitions("tests/test_lock_order_races.py", full=50, on_cluster=10)
AGENT_TERMINAL = ("completed", "failed", "cancelled", "timeout")


def race(first, second) -> tuple[object, object]:
    """Run both at once (a barrier), each on its own thread and connection; re-raise what either raised."""
    barrier = threading.Barrier(2, timeout=30)
    results: list = [None, None]
    errors: list[BaseException] = []

    def body(i: int, work) -> None:
        try:
            barrier.wait()
            results[i] = work()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=body, args=(i, w)) for i, w in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results[0], results[1]


def start(workflow) -> Run:
    return start_run(workflow.community_id, workflow.id, {}, cause=Cause.event(os.urandom(32)))


def test_an_operator_cancels_a_parent_while_its_child_completes(community):
    parent_wf, child_wf = WorkflowFactory(community=community), WorkflowFactory(community=community)
    publish_definition(community.id, child_wf.id, {"steps": [function_step("c", "noop")]})
    sub = {"key": "sub", "kind": "sub_workflow", "workflow": str(child_wf.id)}
    publish_definition(community.id, parent_wf.id, {"steps": [sub]})
    outcomes = set()
    for _ in range(REPETITIONS):
        parent = start(parent_wf)
        run_until_idle(community.id, max_steps=1)  # the sub_workflow step starts the child
        [child_step] = claim_steps(community.id, lease_seconds=30)
        assert Run.objects.get(pk=child_step.lease.run_id).parent_run_id == parent.pk

        canceled, completed = race(
            lambda parent=parent: cancel_run(community.id, parent.pk),
            lambda claim=child_step: complete_step(claim.lease, {"ok": True}),
        )

        assert isinstance(canceled, Canceled | StepAlreadyTerminal), canceled
        assert completed in (Settled("succeeded"), StepLeaseLost(), StepAlreadyTerminal("canceled")), completed
        assert Run.objects.get(pk=parent.pk).state in RUN_TERMINAL
        assert Run.objects.get(pk=child_step.lease.run_id).state in RUN_TERMINAL
        outcomes.add((type(canceled).__name__, type(completed).__name__))
    assert outcomes  # both orders are possible; neither raises


def _agent_run_of_a_workflow(community, workflow, agent, **budget):
    """A workflow run parked on one agent run (``await: agent_run``), that agent run claimed."""
    run = start(workflow)
    run_until_idle(community.id)
    delivery = WorkflowAgentDelivery.objects.get(run_id=run.pk)
    claim = core.claim_delivery(community.id, agent, delivery_id=delivery.id, lease_seconds=30)
    accepted = accept_delivery(claim.lease, **budget)
    assert isinstance(accepted, Accepted)
    (agent_claim,) = claim_agent_runs(community.id, [agent], worker_id="w", lease_seconds=30)
    return run, agent_claim


def test_a_workflow_cancel_against_one_of_its_agent_runs_completing(community):
    agent = random32()
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, {"steps": [send_step("ask", [agent], **{"await": "agent_run"})]})
    for _ in range(REPETITIONS):
        run, agent_claim = _agent_run_of_a_workflow(community, workflow, agent)

        canceled, completed = race(
            lambda run=run: cancel_run(community.id, run.pk),
            lambda claim=agent_claim: complete_run(claim.lease, {"done": True}),
        )

        assert isinstance(canceled, Canceled | StepAlreadyTerminal), canceled
        assert isinstance(completed, Finished | LeaseLost | AlreadyTerminal), completed
        assert Run.objects.get(pk=run.pk).state in RUN_TERMINAL
        assert AgentRun.objects.get(id=agent_claim.lease.run_id).state in AGENT_TERMINAL


def test_a_workflow_cancel_against_its_agent_run_journaling_a_compensable_call_never_drops_the_call(community):
    """The cancel locks the agent run before it judges the journal: a call journaled first is
    seen, and the run is sent to undo it (never ended with the call uncompensated); a call
    journaled after is refused."""
    compensation = {"function": "tests.agent_handlers:undo"}
    outcomes = set()
    for _ in range(REPETITIONS):
        # An agent of its own each time: the runs left unwinding before must not be claimed here.
        agent = random32()
        workflow = WorkflowFactory(community=community)
        steps = [send_step("ask", [agent], **{"await": "agent_run"})]
        publish_definition(community.id, workflow.id, {"steps": steps})
        run, agent_claim = _agent_run_of_a_workflow(community, workflow, agent)

        canceled, journaled = race(
            lambda run=run: cancel_run(community.id, run.pk),
            lambda claim=agent_claim: journal_call(claim.lease, "effect", {"n": 1}, compensation=compensation),
        )

        assert isinstance(canceled, Canceled), canceled
        agent_run = AgentRun.objects.get(id=agent_claim.lease.run_id)
        entries = JournalEntry.objects.filter(community_id=community.id, run_id=agent_run.id)
        if isinstance(journaled, Journaled):
            assert (agent_run.state, agent_run.unwinding, agent_run.failure_code) == (
                "pending",
                True,
                "workflow_canceled",
            )
            assert list(entries.values_list("status", "compensation_status")) == [("pending", None)]
        else:
            assert journaled == LeaseLost("cancelled"), journaled
            assert (agent_run.state, agent_run.failure_code) == ("cancelled", "workflow_canceled")
            assert not entries.exists()
        outcomes.add(type(journaled).__name__)
    assert outcomes  # mostly Journaled (the cancel does more before it reaches the agent run)


def test_a_workflow_cancel_against_the_agent_reaper_exhausting_one_of_its_runs(community):
    agent = random32()
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, {"steps": [send_step("ask", [agent], **{"await": "agent_run"})]})
    for _ in range(REPETITIONS):
        run, agent_claim = _agent_run_of_a_workflow(community, workflow, agent, max_attempts=1)
        backdate_run_lease(agent_claim.lease.run_id)

        canceled, reaped = race(lambda run=run: cancel_run(community.id, run.pk), reap_agent_runs)

        assert isinstance(canceled, Canceled | StepAlreadyTerminal), canceled
        assert reaped is not None
        assert Run.objects.get(pk=run.pk).state in RUN_TERMINAL
        assert AgentRun.objects.get(id=agent_claim.lease.run_id).state in AGENT_TERMINAL


def test_a_delivery_claimed_before_its_workflow_run_was_canceled_is_not_accepted_into_a_run(community):
    agent = random32()
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, {"steps": [send_step("ask", [agent], **{"await": "agent_run"})]})
    run = start(workflow)
    run_until_idle(community.id)
    delivery = WorkflowAgentDelivery.objects.get(run_id=run.pk)
    claim = core.claim_delivery(community.id, agent, delivery_id=delivery.id, lease_seconds=30)
    assert isinstance(cancel_run(community.id, run.pk), Canceled)

    outcome = accept_delivery(claim.lease)

    assert outcome == RunEnded("canceled")
    assert not AgentRun.objects.filter(community_id=community.id).exists()
    delivery.refresh_from_db()
    assert (delivery.status, delivery.failure_code) == ("failed", "run_canceled")


def test_accepts_racing_a_cancel_never_leave_an_agent_run_of_a_canceled_workflow_run(community):
    agent = random32()
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, {"steps": [send_step("ask", [agent], **{"await": "agent_run"})]})
    for _ in range(REPETITIONS):
        run = start(workflow)
        run_until_idle(community.id)
        delivery = WorkflowAgentDelivery.objects.get(run_id=run.pk)
        claim = core.claim_delivery(community.id, agent, delivery_id=delivery.id, lease_seconds=30)

        canceled, accepted = race(
            lambda run=run: cancel_run(community.id, run.pk), lambda claim=claim: accept_delivery(claim.lease)
        )

        assert isinstance(canceled, Canceled), canceled
        assert isinstance(accepted, Accepted | RunEnded), accepted
        live = AgentRun.objects.filter(community_id=community.id, delivery_id=delivery.id).exclude(
            state__in=AGENT_TERMINAL
        )
        assert not live.exists()  # accepted first: the cancel cancelled it; else none was created
