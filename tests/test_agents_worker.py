"""``run_agent_worker``'s loop in this process with real threads and connections (SPEC 12
"Runtime"): the LISTEN wake, the handler deadline and the shutdown grace."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig
from tests.agents_support import AGENT, new_run
from tests.worker_support import RUN_CLAIM_OPENING, wait_for_poll_since_listening

pytestmark = pytest.mark.django_db(transaction=True)


def quick(ctx):
    return {"ok": True}


class Gate:
    """A handler that blocks until released (or 600 s), then tries one more journaled call."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.error: BaseException | None = None

    def __call__(self, ctx):
        self.entered.set()
        self.release.wait(600)
        try:
            ctx.call("late", lambda args, key: {"made": True}, {})
        except BaseException as exc:
            self.error = exc
            raise
        return {"late": True}


def start(worker: AgentWorker) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def main():
        try:
            out.update(worker.run())
        finally:
            connections.close_all()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return thread, out


def wait_for(predicate, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s")


def state_of(run_id) -> str:
    return AgentRun.objects.get(id=run_id).state


def test_a_new_run_wakes_an_idle_worker_long_before_its_next_poll(community):
    worker = AgentWorker(
        WorkerConfig(handler=quick, agents=[AGENT], communities=[community.id], poll_seconds=600, worker_id="w")
    )
    thread, out = start(worker)
    try:
        wait_for(lambda: worker.listener is not None and worker.listener.is_alive(), 60)
        # Idle: its poll after the LISTEN found nothing; the next one is 600 s away.
        wait_for_poll_since_listening(RUN_CLAIM_OPENING)
        run_id = new_run(community.id)
        wait_for(lambda: state_of(run_id) == "completed", 60)  # a hint, or not within 60 s
    finally:
        worker.stop()
        thread.join(10)
    assert out["completed"] == 1 and out["woken"] >= 1


def test_a_handler_past_its_deadline_is_given_up_and_writes_nothing_more(community, settings):
    # A 3 s lease renewed every second: a wait of 1.5 s shows no renewal (a 15 s lease made it 5.5 s).
    settings.BUZZ_DELIVERY = {**settings.BUZZ_DELIVERY, "MIN_LEASE_SECONDS": 1}
    gate = Gate()
    worker = AgentWorker(
        WorkerConfig(
            handler=gate, agents=[AGENT], communities=[community.id], lease_seconds=3, handler_timeout=0.5,
            poll_seconds=0.2, worker_id="w", listen=False,
        )
    )  # fmt: skip
    run_id = new_run(community.id)
    thread, out = start(worker)
    try:
        assert gate.entered.wait(60)
        # The heartbeat checks deadlines every 0.25 s: given up about 0.75 s after its hold at the
        # latest; a handler that was never given up holds its run until released (600 s).
        wait_for(lambda: worker.heartbeat.timed_out == 1, 60)
        assert run_id not in worker.heartbeat.held
        # Read once given up, not when the handler entered: a claim slowed by load past half a
        # heartbeat period lets the first renewal round come before the deadline (as it should).
        renewed_at = AgentRun.objects.get(id=run_id).heartbeat_at
        time.sleep(1.5)  # more than one heartbeat period (lease/3 = 1 s): nothing renewed it
        assert AgentRun.objects.get(id=run_id).heartbeat_at == renewed_at
        gate.release.set()
        wait_for(lambda: gate.error is not None, 5)
    finally:
        worker.stop()
        thread.join(10)
    assert type(gate.error).__name__ == "RunAborted"
    assert not JournalEntry.objects.filter(run_id=run_id).exists()
    assert state_of(run_id) == "running"  # left to lapse: the reaper reclaims it
    assert (out["timed_out"], out["lost"], out.get("completed", 0)) == (1, 1, 0)


def test_the_shutdown_grace_ends_the_drain_and_abandons_what_is_still_in_flight(community):
    gate = Gate()
    worker = AgentWorker(
        WorkerConfig(
            handler=gate, agents=[AGENT], communities=[community.id], lease_seconds=30, shutdown_grace=0.5,
            poll_seconds=0.2, worker_id="w", listen=False,
        )
    )  # fmt: skip
    run_id = new_run(community.id)
    thread, out = start(worker)
    assert gate.entered.wait(60)
    worker.stop()
    # The 0.5 s grace and the stop (0.6 s here); without the grace the drain waits for the handler,
    # held here for 600 s: 60 s leaves a loaded machine room.
    wait_for(lambda: not thread.is_alive(), 60)
    assert out["abandoned"] == 1
    gate.release.set()
    wait_for(lambda: gate.error is not None, 5)
    assert type(gate.error).__name__ == "RunAborted"
    assert not JournalEntry.objects.filter(run_id=run_id).exists()
    assert state_of(run_id) == "running"


def test_without_a_grace_problem_the_drain_lets_the_in_flight_run_finish(community):
    gate = Gate()
    worker = AgentWorker(
        WorkerConfig(
            handler=gate, agents=[AGENT], communities=[community.id], lease_seconds=30, shutdown_grace=10,
            poll_seconds=0.2, worker_id="w", listen=False,
        )
    )  # fmt: skip
    run_id = new_run(community.id)
    thread, out = start(worker)
    assert gate.entered.wait(60)
    worker.stop()
    time.sleep(0.3)
    gate.release.set()
    thread.join(10)
    assert gate.error is None and out.get("abandoned", 0) == 0
    assert state_of(run_id) == "completed"
