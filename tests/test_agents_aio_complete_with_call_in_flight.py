"""The event-loop runtime: an async handler that returns while a call it started in a task of
its own is still in flight. The run completed (or, with that call alone in flight, the run
'waiting_tool', was refused as lost and run again) with the call pending, its result never
recorded. Now the completion waits for the call (found in review: failed before the fix)."""

from __future__ import annotations

import asyncio

import pytest

from buzz_delivery.agents.models import AgentRun, JournalEntry
from tests.agents_support import new_run
from tests.test_agents_aio import in_process

pytestmark = pytest.mark.django_db(transaction=True)

SEEN: list = []


async def _slow(args, key):
    await asyncio.sleep(0.5)  # in flight when the handler returns
    return {"n": args["n"]}


async def returns_with_a_call_in_flight(ctx):
    async def tool():
        try:
            SEEN.append(await ctx.call("slow", _slow, {"n": 1}))
        except BaseException as exc:
            SEEN.append(repr(exc))

    ctx.background = asyncio.ensure_future(tool())  # kept referenced while it runs
    await asyncio.sleep(0.1)  # the slow call is journaled by now
    return {"done": True}


def test_an_async_run_completes_only_once_its_call_in_flight_is_recorded(community):
    SEEN.clear()
    run_id = new_run(community.id)
    _, counts = in_process(community, returns_with_a_call_in_flight, in_flight=4, connections=2)
    assert counts.get("completed") == 1, counts
    assert SEEN == [{"n": 1}]
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.output) == ("completed", {"done": True})
    assert not counts.get("lost"), counts
    entries = [(e.seq, e.tool_name, e.status) for e in JournalEntry.objects.filter(run_id=run_id)]
    assert entries == [(1, "slow", "succeeded")]


async def raises_with_a_call_in_flight(ctx):
    from tests import agent_handlers as h

    async def slow_effect(args, key):
        await asyncio.sleep(0.5)  # in flight when the handler raises
        return h.effect(args, key)

    async def tool():
        try:
            SEEN.append(await ctx.call("slow", slow_effect, {"n": 1}, compensate=h.undo))
        except BaseException as exc:
            SEEN.append(type(exc).__name__)

    ctx.background = asyncio.ensure_future(tool())
    await asyncio.sleep(0.1)
    raise RuntimeError("the handler gives up")


def test_an_async_run_failing_compensates_a_call_in_flight_only_after_it_happened(community, tmp_path, monkeypatch):
    """Failed at once, the run's call in flight was marked uncertain and compensated while the
    tool still ran (the undo before the effect). Found in review: failed before the fix."""
    from tests import agent_handlers as h

    monkeypatch.setenv("AGENT_LEDGER", str(tmp_path / "ledger.txt"))
    SEEN.clear()
    run_id = new_run(community.id)
    _, counts = in_process(community, raises_with_a_call_in_flight, in_flight=4, connections=2)
    key = f"{run_id}:1"
    assert h.ledger_lines() == [f"call {key}", f"undo {key}:compensate"], counts
    assert SEEN == [{"n": 1}]
    entry = JournalEntry.objects.get(run_id=run_id, seq=1)
    assert (entry.status, entry.uncertain, entry.compensation_status) == ("succeeded", False, "compensated")
    assert AgentRun.objects.get(id=run_id).state == "failed"
