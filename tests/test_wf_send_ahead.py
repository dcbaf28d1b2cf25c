"""Sends claimed ahead (issue 31): a ``send_message`` step takes no step thread. The orchestrator
hands every send it claims straight to its completer, which sends a claim's sends in one
transaction, and with every step thread busy it still claims the community's ready sends (a
claim that takes only those, ``claim_steps(sends_only=True)``) once a NOTIFY says steps became
ready. So a batch holds every ready send, not one per step thread."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows import completer as completer_module
from buzz_delivery.workflows import orchestrator as orchestrator_module
from buzz_delivery.workflows.models import Step
from buzz_delivery.workflows.orchestrator import OrchestratorConfig, run_orchestrator
from buzz_delivery.workflows.registry import workflow_function
from buzz_delivery.workflows.services import claim_steps
from buzz_delivery.workflows.testing import function_step, send_step
from tests.conftest import BARRIER_TIMEOUT
from tests.wf_support import start, wait_until

TARGETS = [random32(), random32()]
ENTERED = threading.Event()
GATE = threading.Event()


@workflow_function("test.send_ahead_gate")
def gate(input: dict, context: object) -> dict:
    """Holds its step thread until the test opens the gate."""
    ENTERED.set()
    GATE.wait(BARRIER_TIMEOUT)
    return {}


@pytest.fixture
def workflow(community):
    return WorkflowFactory(community=community)


def step_states(community_id, key: str) -> list[str]:
    return list(Step.objects.filter(community_id=community_id, key=key).values_list("state", flat=True))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("async_functions", [False, True])
def test_sends_are_sent_in_one_batch_while_the_only_step_thread_is_busy(workflow, monkeypatch, async_functions):
    """Without ``async def`` functions the busy thread leaves no room: the sends are claimed
    ahead; with them the event loop's places make room, and the ordinary claim takes the sends,
    which still wait for no step thread."""
    monkeypatch.setattr(orchestrator_module, "_any_async_function", lambda: async_functions)
    batches: list[int] = []
    send_messages = completer_module.send_messages

    def recorded(community, claims):
        batches.append(len(claims))
        return send_messages(community, claims)

    monkeypatch.setattr(completer_module, "send_messages", recorded)
    ENTERED.clear()
    GATE.clear()
    community = workflow.community_id
    start(workflow, {"steps": [function_step("block", "test.send_ahead_gate")]})
    stop = threading.Event()
    summaries: list[dict] = []
    config = OrchestratorConfig(community_id=community, concurrency=1, poll_interval=0.1, lease_seconds=60)

    def run() -> None:
        try:
            summaries.append(run_orchestrator(config, stop=stop, handle_signals=False))
        finally:
            connection.close()

    runner = threading.Thread(target=run)
    runner.start()
    try:
        assert ENTERED.wait(BARRIER_TIMEOUT), "the blocking step never started"
        with transaction.atomic():  # ready together: one NOTIFY, one claim
            for i in range(10):
                start(workflow, {"steps": [send_step("send", TARGETS, content=f"m{i}")]})
        wait_until(lambda: step_states(community, "send") == ["waiting"] * 10, what="every send parked")
        # Sent while the only step thread still held the blocking step, all in one batch.
        assert not GATE.is_set() and step_states(community, "block") == ["running"]
        assert batches == [10], batches
    finally:
        GATE.set()
        wait_until(lambda: step_states(community, "block") == ["succeeded"], what="the blocking step done")
        stop.set()
        runner.join(BARRIER_TIMEOUT)
    [summary] = summaries
    assert summary["waiting"] == 10 and summary["errors"] == 0, summary
    assert summary["sends_ahead"] == (0 if async_functions else 10), summary
    assert summary["send_statements"] == 1, summary


@pytest.mark.django_db
def test_a_claim_of_sends_takes_only_the_ready_sends(workflow):
    start(workflow, {"steps": [function_step("f1"), send_step("s1", TARGETS)]})
    start(workflow, {"steps": [send_step("s2", TARGETS), function_step("f2")]})
    claims = claim_steps(workflow.community_id, limit=10, lease_seconds=30, sends_only=True)
    assert sorted(c.step.key for c in claims) == ["s1", "s2"]
    assert {c.step.kind for c in claims} == {"send_message"}
    assert step_states(workflow.community_id, "f1") == step_states(workflow.community_id, "f2") == ["ready"]
    assert claim_steps(workflow.community_id, limit=10, lease_seconds=30, sends_only=True) == []


@pytest.mark.django_db
def test_a_claim_of_sends_refuses_a_flag_that_is_not_a_bool_naming_it(workflow):
    from django.core.exceptions import ValidationError

    start(workflow, {"steps": [send_step("s1", TARGETS)]})
    with pytest.raises(ValidationError) as info:
        claim_steps(workflow.community_id, limit=10, sends_only="yes")  # type: ignore[arg-type]
    assert "sends_only" in str(info.value)
    assert step_states(workflow.community_id, "s1") == ["ready"]


@pytest.mark.django_db
def test_an_empty_claim_of_sends_stops_them_for_a_poll_interval_unless_a_send_is_claimed(workflow, monkeypatch):
    """A busy orchestrator of a community without sends pays at most one claim of sends a poll
    interval, however many NOTIFYs come; a send claimed meanwhile lifts the pause."""
    start(workflow, {"steps": [send_step("send", TARGETS)]})
    [send] = claim_steps(workflow.community_id, limit=1, lease_seconds=30)
    calls: list[dict] = []

    def counted(community, **kwargs):
        calls.append(kwargs)
        return []

    monkeypatch.setattr(orchestrator_module, "claim_steps", counted)
    config = OrchestratorConfig(community_id=workflow.community_id, poll_interval=60)
    orchestrator = orchestrator_module.Orchestrator(config, threading.Event())
    orchestrator.leading = True
    hint = str(workflow.community_id)
    assert orchestrator._claim_sends_ahead() is False
    assert [c["sends_only"] for c in calls] == [True]
    for _ in range(5):
        orchestrator._hinted(hint)
        assert orchestrator._claim_sends_ahead() is False
    assert len(calls) == 1
    orchestrator._to_sender([send])  # a send claimed (by a chain, say): sends are about
    orchestrator._hinted(hint)
    assert orchestrator._claim_sends_ahead() is False
    assert len(calls) == 2
    orchestrator.leading = False  # a follower never claims ahead
    orchestrator._to_sender([])
    orchestrator.sends_ahead_after = 0.0
    orchestrator._hinted(hint)
    assert orchestrator._claim_sends_ahead() is False and len(calls) == 2
