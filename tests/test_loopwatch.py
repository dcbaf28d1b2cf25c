"""The event loop's watchdog (issue 29, ``buzz_delivery.loopwatch``): an ``async def`` handler
that calls blocking code without ``await`` holds the one thread every other task on the loop
needs. The worker keeps running; the watchdog names the blocking code in a warning and counts
the stall in the summary."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from buzz_delivery.loopwatch import LoopWatch
from buzz_delivery.testing import random32
from tests.test_worker_async import ASYNC, commit


def _blocks_the_loop_for_a_while() -> None:
    time.sleep(1.2)


def _run_on_a_loop_thread(coro_factory, threshold: float, caplog) -> LoopWatch:
    """Run ``coro_factory()`` on a fresh loop in its own thread, watched; returns the watch."""
    watches: list[LoopWatch] = []

    async def main() -> None:
        watch = LoopWatch(asyncio.get_running_loop(), name="test-loop", threshold=threshold, interval=0.05)
        watches.append(watch.start_here())
        try:
            await coro_factory()
            await asyncio.sleep(0.3)  # the watch sees the loop answer again
        finally:
            watch.stop()

    with caplog.at_level(logging.WARNING, logger="buzz_delivery.loop"):
        thread = threading.Thread(target=asyncio.run, args=(main(),))
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive()
    return watches[0]


def test_a_coroutine_that_blocks_is_named_in_a_warning_and_counted_once(caplog):
    async def blocks() -> None:
        await asyncio.sleep(0.1)
        _blocks_the_loop_for_a_while()

    watch = _run_on_a_loop_thread(blocks, threshold=0.3, caplog=caplog)
    assert watch.stalls == 1
    assert 0.9 < watch.stalled_seconds < 5
    blocked = [r.getMessage() for r in caplog.records if "event_loop_blocked" in r.getMessage()]
    assert len(blocked) == 1
    # The loop thread's stack at that moment: the blocking function and its line.
    assert "_blocks_the_loop_for_a_while" in blocked[0] and "time.sleep(1.2)" in blocked[0]
    assert any("event_loop_unblocked loop=test-loop" in r.getMessage() for r in caplog.records)


def test_a_busy_loop_that_awaits_is_never_taken_for_a_stall(caplog):
    async def many_waits() -> None:
        await asyncio.gather(*(asyncio.sleep(0.001 * (i % 50)) for i in range(2000)))
        for _ in range(20):
            time.sleep(0.02)  # short blocking slices, each well under the threshold
            await asyncio.sleep(0)

    watch = _run_on_a_loop_thread(many_waits, threshold=0.3, caplog=caplog)
    assert watch.stalls == 0
    assert not [r for r in caplog.records if "event_loop_blocked" in r.getMessage()]


def test_bad_thresholds_are_refused():
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="threshold and interval"):
            LoopWatch(loop, name="x", threshold=0)
        with pytest.raises(ValueError, match="threshold and interval"):
            LoopWatch(loop, name="x", interval=-1)
    finally:
        loop.close()


@pytest.mark.django_db(transaction=True)
def test_the_delivery_worker_names_an_async_handler_that_blocks_its_loop_and_still_settles_everything(
    community, start_worker
):
    target = random32()
    blocking = commit(community, target, 1, block=2)
    waiting = commit(community, target, 20, sleep=0.2)
    worker = start_worker(target, "--concurrency", "32", "--max-deliveries", "21", handler=ASYNC)
    assert worker.wait(timeout=60) == 0, worker.log()[-3000:]
    summary = worker.summary()
    assert summary["finished"] == 21 and summary["loop_stalls"] >= 1
    log = worker.log()
    assert "event_loop_blocked loop=buzz-worker-handlers" in log
    assert "async_waits" in log and 'time.sleep(float(script["block"]))' in log
    assert len(blocking) == 1 and len(waiting) == 20


@pytest.mark.django_db(transaction=True)
def test_the_event_loop_agent_worker_counts_a_handler_that_blocks_its_loop(community, caplog):
    from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig
    from buzz_delivery.agents.models import AgentRun
    from tests import agent_async_handlers as ah
    from tests.agents_support import AGENT, new_run

    run_id = new_run(community.id)
    config = AsyncWorkerConfig(
        handler=ah.blocks_the_loop, agents=[AGENT], communities=[community.id], exit_when_idle=True,
        poll_seconds=0.1, lease_seconds=15, worker_id="loopwatch-test", in_flight=4, connections=1,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="buzz_delivery.agents"):
        counts = AsyncAgentWorker(config).run()
    assert counts["completed"] == 1 and counts["loop_stalls"] == 1, counts
    assert AgentRun.objects.get(id=run_id).state == "completed"
    blocked = [r.getMessage() for r in caplog.records if "event_loop_blocked" in r.getMessage()]
    assert len(blocked) == 1 and "blocks_the_loop" in blocked[0]


@pytest.mark.django_db(transaction=True)
def test_the_orchestrator_counts_an_async_step_that_blocks_its_loop(community, caplog):
    from buzz_delivery.testing import WorkflowFactory
    from buzz_delivery.workflows.models import Step
    from buzz_delivery.workflows.orchestrator import OrchestratorConfig, run_orchestrator
    from buzz_delivery.workflows.testing import function_step
    from tests import wf_async_steps  # noqa: F401  (registers asteps.blocks)
    from tests.wf_support import start

    workflow = WorkflowFactory(community=community)
    run = start(workflow, {"steps": [function_step("b", "asteps.blocks")]})
    config = OrchestratorConfig(community_id=community.id, concurrency=1, idle_exit=0.5, poll_interval=0.1)
    with caplog.at_level(logging.WARNING, logger="buzz_delivery.workflows"):
        summary = run_orchestrator(config, handle_signals=False)
    assert (summary["awaited"], summary["loop_stalls"]) == (1, 1), summary
    assert Step.objects.get(run_id=run.pk, key="b").state == "succeeded"
    blocked = [r.getMessage() for r in caplog.records if "event_loop_blocked" in r.getMessage()]
    assert len(blocked) == 1 and "time.sleep(1.5)" in blocked[0]
