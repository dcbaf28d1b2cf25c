"""``request_approval`` while another thread's call is in flight and that call's tool makes a
nested ``ctx.call``.

The approval waited for the calls in flight while holding the journal lock; the outer call's
tool then asked for that lock for its nested call, so the outer call never ended, the approval
never stopped waiting, and the run hung while its heartbeat kept the lease (found in review:
the test hung, ``done == []``, before the fix). A nested call is now refused at once
(``NestedCall``, tests/test_agents_nested_call_replay.py): the outer call fails with it, is
recorded, and the approval parks the run."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connections

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import claim_agent_runs
from tests.agents_support import AGENT, new_run

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_approval_waiting_for_a_call_does_not_block_that_calls_nested_call(community):
    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    in_tool, seen = threading.Event(), []

    def handler(ctx):
        def outer(args, key):
            in_tool.set()
            threading.Event().wait(0.5)  # the approval waits for this call by now
            return {"inner": ctx.call("inner", lambda a, k: {"n": a["n"]}, {"n": 2})}

        def tool():
            try:
                seen.append(ctx.call("outer", outer, {"n": 1}))
            except BaseException as exc:
                seen.append(repr(exc))
            finally:
                connections.close_all()

        worker = threading.Thread(target=tool, daemon=True)
        worker.start()
        assert in_tool.wait(30)
        try:
            return ctx.request_approval("ship?", 600)
        finally:
            worker.join(30)

    done: list[str] = []
    runner = threading.Thread(target=lambda: done.append(run_claim(claimed, handler)), daemon=True)
    runner.start()
    runner.join(20)
    assert done == ["parked"], "the approval hung on the nested call it kept from its journal lock"
    assert len(seen) == 1 and seen[0].startswith("ToolCallFailed(\"1: ctx.call('inner') from inside"), seen
    assert AgentRun.objects.get(id=run_id).state == "waiting_approval"
    entries = [
        (e.seq, e.kind, e.tool_name, e.status) for e in JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    ]
    assert entries == [
        (1, "tool", "outer", "failed"),
        (2, "approval", "approval", "pending"),
    ]


def test_an_approval_waiting_for_a_call_does_not_block_calls_that_call_fans_out_to_threads(community):
    """A tool that runs ``ctx.call``s on threads of its own (a fan-out) and waits for them: those
    calls are not nested in it by thread, and an approval waiting for the tool kept them from
    starting (its journal lock, or a gate on new calls): the tool waited for them, the approval
    for the tool, and the run hung with its heartbeat keeping the lease."""
    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    in_tool, seen = threading.Event(), []

    def handler(ctx):
        def part(n):
            try:
                return ctx.call("part", lambda a, k: {"n": a["n"]}, {"n": n})
            finally:
                connections.close_all()

        def fan_out(args, key):
            in_tool.set()
            threading.Event().wait(0.5)  # the approval waits for this call by now
            with ThreadPoolExecutor(2) as pool:
                return {"parts": [r["n"] for r in pool.map(part, (2, 3))]}

        def tool():
            try:
                seen.append(ctx.call("fan_out", fan_out, {"n": 1}))
            except BaseException as exc:
                seen.append(repr(exc))
            finally:
                connections.close_all()

        worker = threading.Thread(target=tool, daemon=True)
        worker.start()
        assert in_tool.wait(30)
        try:
            return ctx.request_approval("ship?", 600)
        finally:
            worker.join(30)

    done: list[str] = []
    runner = threading.Thread(target=lambda: done.append(run_claim(claimed, handler)), daemon=True)
    runner.start()
    runner.join(20)
    assert done == ["parked"], "the approval hung on the calls its awaited call fans out"
    assert seen == [{"parts": [2, 3]}]
    assert AgentRun.objects.get(id=run_id).state == "waiting_approval"
    kinds = sorted((e.kind, e.tool_name, e.status) for e in JournalEntry.objects.filter(run_id=run_id))
    assert kinds == [
        ("approval", "approval", "pending"),
        ("tool", "fan_out", "succeeded"),
        ("tool", "part", "succeeded"),
        ("tool", "part", "succeeded"),
    ]
    assert JournalEntry.objects.get(run_id=run_id, kind="approval").seq == 4
