"""The event-loop runtime: a ``ctx.call`` made from inside another ``ctx.call``'s tool function
of the same run. The outer call holds the run's call lock until it is recorded and the nested
call waited for that lock: the run hung for ever while the heartbeat kept its lease. Now the
nested call raises :class:`NestedCall` at once (nothing journaled for it), naming the call it is
nested in; so does ``request_approval`` (``ApprovalBlockedByCalls``). Each test hung before the
fix (the worker thread still running at the timeout)."""

from __future__ import annotations

import pytest

from buzz_delivery.agents.exceptions import ApprovalBlockedByCalls, NestedCall
from buzz_delivery.agents.models import AgentRun, JournalEntry
from tests.agents_support import new_run
from tests.aio_worker_support import run_in_thread

pytestmark = pytest.mark.django_db(transaction=True)


def _run_with_timeout(community, handler):
    return run_in_thread(community, handler, stuck="the worker hung on the nested call")


def _entries(run_id):
    return [(e.seq, e.tool_name, e.status) for e in JournalEntry.objects.filter(run_id=run_id).order_by("seq")]


async def nested_async(ctx):
    async def inner(args, key):
        return {"n": 2}

    async def outer(args, key):
        try:
            await ctx.call("inner", inner, {"n": 2})
        except NestedCall as exc:
            return {"error": type(exc).__name__, "outer_seq": exc.outer_seq, "text": str(exc)}
        return {"error": None}

    return await ctx.call("outer", outer, {"n": 1})


def nested_sync(ctx):
    def outer(args, key):
        try:
            ctx.call("inner", lambda a, k: {"n": 2}, {"n": 2})
        except NestedCall as exc:
            return {"error": type(exc).__name__, "outer_seq": exc.outer_seq, "text": str(exc)}
        return {"error": None}

    return ctx.call("outer", outer, {"n": 1})


@pytest.mark.parametrize("handler", [nested_async, nested_sync], ids=["async", "sync_bridge"])
def test_a_nested_call_is_a_typed_error_at_once_not_a_hang(community, handler):
    run_id = new_run(community.id)
    counts = _run_with_timeout(community, handler)
    assert counts.get("completed") == 1, counts
    output = AgentRun.objects.get(id=run_id).output
    assert (output["error"], output["outer_seq"]) == ("NestedCall", 1)
    assert "ctx.call('inner') from inside the tool function of call 1" in output["text"]
    assert _entries(run_id) == [(1, "outer", "succeeded")]  # nothing journaled for the nested call


async def approval_inside_a_call(ctx):
    async def outer(args, key):
        try:
            await ctx.request_approval("from within", 600)
        except ApprovalBlockedByCalls as exc:
            return {"seqs": list(exc.seqs)}
        return {"seqs": None}

    return await ctx.call("outer", outer, {})


def test_an_approval_asked_from_inside_a_call_is_a_typed_error_not_a_hang(community):
    run_id = new_run(community.id)
    counts = _run_with_timeout(community, approval_inside_a_call)
    assert counts.get("completed") == 1, counts
    assert AgentRun.objects.get(id=run_id).output == {"seqs": [1]}
    assert _entries(run_id) == [(1, "outer", "succeeded")]
