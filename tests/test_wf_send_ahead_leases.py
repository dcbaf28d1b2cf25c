"""Sends claimed ahead (issue 31) under a slow completer and a stop: their leases are renewed
while they wait in the completer's queue (never lapse there), and a send whose lease lapsed and
was reclaimed by another orchestrator is sent once: the stale holder's batch is fenced."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows import completer as completer_module
from buzz_delivery.workflows import orchestrator as orchestrator_module
from buzz_delivery.workflows.models import Step
from buzz_delivery.workflows.orchestrator import OrchestratorConfig, run_orchestrator
from buzz_delivery.workflows.registry import workflow_function
from buzz_delivery.workflows.services import claim_steps
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from buzz_delivery.workflows.testing import function_step, send_step
from tests.conftest import BARRIER_TIMEOUT
from tests.wf_support import backdate_step_lease, start
from tests.wf_support import wait_until as _wait_until


def wait_until(condition, what: str, timeout: float = 60) -> None:
    _wait_until(condition, what, timeout)


TARGETS = [random32(), random32()]
SENDS = 6
ENTERED = threading.Event()
GATE = threading.Event()


@workflow_function("test.send_ahead_lease_gate")
def gate(input: dict, context: object) -> dict:
    """Holds the only step thread until the test opens the gate."""
    ENTERED.set()
    GATE.wait(BARRIER_TIMEOUT)
    return {}


@pytest.fixture
def workflow(community):
    return WorkflowFactory(community=community)


def sends(community_id) -> list[Step]:
    return list(Step.objects.filter(community_id=community_id, key="send"))


def deliveries_per_run(community_id) -> dict:
    counts: dict = {}
    for run_id in WorkflowAgentDelivery.objects.filter(community_id=community_id).values_list("run_id", flat=True):
        counts[run_id] = counts.get(run_id, 0) + 1
    return counts


class HeldSends:
    """``send_messages`` held at a gate (a slow completer), recording what it was given."""

    def __init__(self, monkeypatch) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.outcomes: list = []
        real = completer_module.send_messages

        def held(community, claims):
            self.entered.set()
            self.gate.wait(BARRIER_TIMEOUT)
            outcomes = real(community, claims)
            self.outcomes.extend(outcomes)
            return outcomes

        monkeypatch.setattr(completer_module, "send_messages", held)


def orchestrate(config: OrchestratorConfig, stop: threading.Event, summaries: list) -> threading.Thread:
    def run() -> None:
        try:
            summaries.append(run_orchestrator(config, stop=stop, handle_signals=False))
        finally:
            connection.close()

    runner = threading.Thread(target=run)
    runner.start()
    return runner


@pytest.mark.django_db(transaction=True)
def test_sends_waiting_in_a_slow_completer_keep_their_leases(workflow, monkeypatch):
    held = HeldSends(monkeypatch)
    ENTERED.clear()
    GATE.clear()
    community = workflow.community_id
    start(workflow, {"steps": [function_step("block", "test.send_ahead_lease_gate")]})
    stop = threading.Event()
    summaries: list = []
    config = OrchestratorConfig(community_id=community, concurrency=1, poll_interval=0.1, lease_seconds=15)
    runner = orchestrate(config, stop, summaries)
    try:
        assert ENTERED.wait(BARRIER_TIMEOUT)
        for i in range(SENDS):
            start(workflow, {"steps": [send_step("send", TARGETS, content=f"m{i}")]})
        assert held.entered.wait(BARRIER_TIMEOUT), "the sends never reached the completer"
        # Held in the completer past a renewal round: renewed, as a step thread's claim is.
        wait_until(lambda: all(s.renewals >= 1 for s in sends(community)), what="renewals of the held sends")
        held.gate.set()
        wait_until(lambda: [s.state for s in sends(community)] == ["waiting"] * SENDS, what="every send parked")
    finally:
        held.gate.set()
        GATE.set()
        stop.set()
        runner.join(BARRIER_TIMEOUT)
    assert set(deliveries_per_run(community).values()) == {len(TARGETS)}
    assert len(deliveries_per_run(community)) == SENDS


@pytest.mark.django_db(transaction=True)
def test_a_send_left_by_a_stopped_orchestrator_is_sent_once_by_the_next(workflow, monkeypatch):
    """SIGTERM's drain ends (grace over) while the sends claimed ahead wait in a stuck
    completer: their leases are left to lapse; the reaper readies them, another orchestrator
    sends them, and the stale completer, unstuck, writes nothing (fenced)."""
    held = HeldSends(monkeypatch)
    ENTERED.clear()
    GATE.clear()
    community = workflow.community_id
    start(workflow, {"steps": [function_step("block", "test.send_ahead_lease_gate")]})
    stop = threading.Event()
    summaries: list = []
    config = OrchestratorConfig(
        community_id=community, concurrency=1, poll_interval=0.1, lease_seconds=60, shutdown_grace=0.5
    )
    runner = orchestrate(config, stop, summaries)
    try:
        assert ENTERED.wait(BARRIER_TIMEOUT)
        for i in range(SENDS):
            start(workflow, {"steps": [send_step("send", TARGETS, content=f"m{i}")]})
        assert held.entered.wait(BARRIER_TIMEOUT), "the sends never reached the completer"
        GATE.set()
        stop.set()
        runner.join(BARRIER_TIMEOUT)
        assert not runner.is_alive()
        [summary] = summaries
        assert summary["abandoned"] >= 1, summary
        running = [s for s in sends(community) if s.state == "running"]
        assert running, "the held sends should still be running (their leases lapse)"
        for step in running:
            backdate_step_lease(step.pk)
        reap_workflow_steps()
        assert {s.state for s in sends(community)} <= {"ready", "waiting"}
        next_summaries: list = []
        config2 = OrchestratorConfig(community_id=community, concurrency=2, poll_interval=0.1, idle_exit=1.0)
        # The next orchestrator's batches go through the same (held) function: let them pass.
        held.gate.set()
        run2 = orchestrate(config2, threading.Event(), next_summaries)
        run2.join(BARRIER_TIMEOUT)
        wait_until(lambda: [s.state for s in sends(community)] == ["waiting"] * SENDS, what="every send parked")
    finally:
        held.gate.set()
        GATE.set()
        stop.set()
    # The stale completer got its turn too (gate open): nothing sent twice.
    assert len(deliveries_per_run(community)) == SENDS
    assert set(deliveries_per_run(community).values()) == {len(TARGETS)}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("async_functions", [False, True])
def test_a_stuck_completer_bounds_the_sends_claimed(workflow, monkeypatch, async_functions):
    """With the completer stuck on a batch, NOTIFY after NOTIFY claims no more than two batches
    of sends ahead (the rest stay ready for whoever is free). With ``async def`` functions the
    event loop's free places give the ordinary claim room, which sends (no loop place) never
    use up: the claim sizing for the mix still stops it within a third batch."""
    monkeypatch.setattr(orchestrator_module, "_any_async_function", lambda: async_functions)
    held = HeldSends(monkeypatch)
    ENTERED.clear()
    GATE.clear()
    community = workflow.community_id
    start(workflow, {"steps": [function_step("block", "test.send_ahead_lease_gate")]})
    stop = threading.Event()
    summaries: list = []
    batch = 8
    config = OrchestratorConfig(
        community_id=community, concurrency=1, poll_interval=0.05, lease_seconds=60, batch_size=batch
    )
    runner = orchestrate(config, stop, summaries)
    try:
        assert ENTERED.wait(BARRIER_TIMEOUT)
        start(workflow, {"steps": [send_step("send", TARGETS, content="first")]})
        assert held.entered.wait(BARRIER_TIMEOUT), "the sends never reached the completer"
        for i in range(4 * batch):  # one NOTIFY each
            start(workflow, {"steps": [send_step("send", TARGETS, content=f"m{i}")]})
        wait_until(
            lambda: sum(s.state == "running" for s in sends(community)) >= 2 * batch,
            what="two batches of sends claimed",
        )
        stop.wait(1.0)  # many more NOTIFYs and poll intervals: still bounded
        claimed = sum(s.state == "running" for s in sends(community))
        assert claimed <= 2 * batch + 1, claimed
        held.gate.set()
        GATE.set()
        wait_until(lambda: all(s.state == "waiting" for s in sends(community)), what="every send parked")
    finally:
        held.gate.set()
        GATE.set()
        stop.set()
        runner.join(BARRIER_TIMEOUT)
    assert len(deliveries_per_run(community)) == 4 * batch + 1
    assert set(deliveries_per_run(community).values()) == {len(TARGETS)}


@pytest.mark.django_db(transaction=True)
def test_a_send_readied_without_a_notify_is_claimed_ahead_at_the_next_poll(workflow, monkeypatch):
    """A send made ready again without a NOTIFY (its lease lapsed and the reaper readied it,
    as after a stopped orchestrator; or a retry's backoff gate passed) is claimed ahead at the
    next poll while every step thread is busy, not left until a thread frees."""
    monkeypatch.setattr(orchestrator_module, "_any_async_function", lambda: False)
    ENTERED.clear()
    GATE.clear()
    community = workflow.community_id
    start(workflow, {"steps": [send_step("send", TARGETS)]})
    [lost] = claim_steps(community, limit=1, lease_seconds=30, holder="gone")
    start(workflow, {"steps": [function_step("block", "test.send_ahead_lease_gate")]})
    stop = threading.Event()
    summaries: list = []
    config = OrchestratorConfig(community_id=community, concurrency=1, poll_interval=0.1, lease_seconds=60)
    runner = orchestrate(config, stop, summaries)
    try:
        assert ENTERED.wait(BARRIER_TIMEOUT)
        backdate_step_lease(lost.lease.step_id)
        reap_workflow_steps()  # ready again; the reaper sends no NOTIFY
        assert [s.state for s in sends(community)] == ["ready"]
        wait_until(lambda: [s.state for s in sends(community)] == ["waiting"], what="the reaped send sent", timeout=20)
        assert not GATE.is_set()
    finally:
        GATE.set()
        stop.set()
        runner.join(BARRIER_TIMEOUT)
    assert set(deliveries_per_run(community).values()) == {len(TARGETS)}
