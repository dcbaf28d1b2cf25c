"""The event-loop agent worker runs plain (sync) tools on threads every community's runs share
(``agent-user``, and the threads an async tool starts on ``ctx.tool_threads``): each call runs
as the delivery worker runs a plain handler (``aio_runtime.plain_user_code``,
:class:`~buzz_delivery.usercode.UserCode`), so what one call leaves on the thread's connection
never reaches the next, maybe another community's run: its session state (a ``TEMP`` table, a
``SET``) is discarded, and a transaction it left open is rolled back, its connection discarded
and the call failed (``transaction_left_open``, recorded as a tool that raised: the handler gets
:class:`ToolCallFailed`); a plain handler's run fails ``transaction_left_open``.

One user thread (``in_flight=1``), two communities' runs, real worker, loop and threads."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from django.db import connection, transaction

from buzz_delivery.agents.exceptions import ToolCallFailed
from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import intake_event
from buzz_delivery.testing import CommunityFactory
from tests.agents_support import AGENT

pytestmark = pytest.mark.django_db(transaction=True)


def look_then_leave(args: dict, key: str) -> dict:
    """A plain tool: what the thread's connection shows of earlier calls, then leave ``args['leave']``."""
    seen = {"autocommit": connection.get_autocommit()}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT to_regclass('pg_temp.agent_leak') IS NOT NULL, nullif(current_setting('buzz.leak', true), ''),"
            " pg_current_xact_id_if_assigned() IS NOT NULL"
        )
        seen["temp_table"], seen["setting"], seen["in_write_transaction"] = cursor.fetchone()
        if args["leave"] == "session":
            cursor.execute("CREATE TEMP TABLE IF NOT EXISTS agent_leak (secret text)")
            cursor.execute("INSERT INTO agent_leak VALUES (%s)", [args["community"]])
            cursor.execute("SET buzz.leak = 'left by the last call'")
    if args["leave"] == "transaction":
        transaction.set_autocommit(False)
        with connection.cursor() as cursor:
            cursor.execute("CREATE TABLE agent_left_open (x int)")  # a write: the transaction has an xid
    return seen


async def _call(ctx, leave: str) -> dict:
    args = {"leave": leave, "community": str(ctx.lease.community_id)}
    fn: Any = look_then_leave
    if ctx.input["via"] == "tool_threads":  # an async tool that runs it on a thread it starts

        async def fn(args: dict, key: str) -> dict:
            return await asyncio.get_running_loop().run_in_executor(ctx.tool_threads, look_then_leave, args, key)

    try:
        return {"seen": await ctx.call(f"leave_{leave}", fn, args)}
    except ToolCallFailed as exc:
        return {"failed": str(exc)}


async def handler(ctx):
    """One call leaving ``input['leave']``, then one that only looks (on the same thread)."""
    return [await _call(ctx, ctx.input["leave"]), await _call(ctx, "nothing")]


def serve(communities: list, n: int) -> dict:
    worker = AsyncAgentWorker(
        AsyncWorkerConfig(
            handler=handler,
            agents=[AGENT],
            communities=[c.id for c in communities],
            exit_when_idle=True,
            poll_seconds=0.1,
            lease_seconds=15,
            in_flight=1,  # one run at a time, and one user thread: every call on one connection
            connections=1,
            worker_id="aio-hygiene",
        )
    )
    counts = worker.run()
    assert counts["completed"] == n, counts
    return counts


def clean() -> dict:
    return {"autocommit": True, "temp_table": False, "setting": None, "in_write_transaction": False}


VIA = pytest.mark.parametrize("via", ["plain_tool", "tool_threads"])


@VIA
def test_session_state_a_plain_tool_leaves_never_reaches_another_community_s_call_on_its_thread(community, via):
    other = CommunityFactory()
    events = [
        intake_event(c.id, "test", f"s{c.id}", {"leave": "session", "via": via}, AGENT) for c in (community, other)
    ]
    runs = [e.run_id for e in events]
    serve([community, other], 2)
    outputs = [AgentRun.objects.get(id=r).output for r in runs]
    # Without the clean-up every call after the first saw the first's TEMP table (holding its
    # community's rows: row-level security does not cover it) and its setting, whichever
    # community's run it was in: a cross-community leak.
    assert outputs == [[{"seen": clean()}, {"seen": clean()}]] * 2


@VIA
def test_a_plain_tool_that_leaves_a_transaction_open_fails_and_the_next_call_on_its_thread_is_clean(community, via):
    other = CommunityFactory()
    events = [
        intake_event(c.id, "test", f"t{c.id}", {"leave": "transaction", "via": via}, AGENT) for c in (community, other)
    ]
    runs = [e.run_id for e in events]
    serve([community, other], 2)
    for run_id in runs:
        (first, then) = AgentRun.objects.get(id=run_id).output
        # Failed as a tool that raised (the handler got ToolCallFailed), recorded so.
        assert "transaction_left_open" in first["failed"] and "autocommit was left off" in first["failed"]
        assert then == {"seen": clean()}  # not inside the transaction left open, whoever's it was
        entry = JournalEntry.objects.get(run_id=run_id, tool_name="leave_transaction")
        assert entry.status == "failed" and "transaction_left_open" in entry.error
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass('agent_left_open')")
        assert cursor.fetchone()[0] is None  # rolled back: nothing it wrote there is kept


def leaves_autocommit_off(ctx) -> dict:
    """A plain handler (on a user thread) that leaves a transaction open."""
    transaction.set_autocommit(False)
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return {"ok": True}


def test_a_plain_handler_that_leaves_a_transaction_open_fails_its_run_transaction_left_open(community):
    run_id = intake_event(community.id, "test", "h", {}, AGENT).run_id
    worker = AsyncAgentWorker(
        AsyncWorkerConfig(
            handler=leaves_autocommit_off,
            agents=[AGENT],
            communities=[community.id],
            exit_when_idle=True,
            poll_seconds=0.1,
            lease_seconds=15,
            in_flight=1,
            connections=1,
            worker_id="aio-hygiene",
        )
    )
    counts = worker.run()
    assert counts["failed"] == 1, counts
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == ("failed", "transaction_left_open")
    assert "autocommit was left off" in run.failure_message


async def leaves_outside_any_call(ctx):
    """An async handler that runs plain code on ``ctx.tool_threads`` itself, outside any call
    (the first community's run leaves ``input['leave']`` there), then one call that only looks."""
    if ctx.input["first"]:
        args = {"leave": ctx.input["leave"], "community": str(ctx.lease.community_id)}
        try:
            await asyncio.get_running_loop().run_in_executor(ctx.tool_threads, look_then_leave, args, "")
        except Exception as exc:  # (what the thread's code left open, raised to the handler)
            return {"failed": str(exc)}
    return [await _call(ctx, "nothing")]


@pytest.mark.parametrize("leave", ["session", "transaction"])
def test_what_code_on_tool_threads_outside_any_call_leaves_never_reaches_another_community_s_call(community, leave):
    """``ctx.tool_threads`` is the user threads every community's runs share: a thread a handler
    starts there outside any call runs in its run's community too, cleaned after it."""
    other = CommunityFactory()
    first = intake_event(community.id, "test", "o1", {"leave": leave, "first": True, "via": "plain_tool"}, AGENT)
    then = intake_event(other.id, "test", "o2", {"leave": leave, "first": False, "via": "plain_tool"}, AGENT)
    worker = AsyncAgentWorker(
        AsyncWorkerConfig(
            handler=leaves_outside_any_call,
            agents=[AGENT],
            communities=[community.id, other.id],
            exit_when_idle=True,
            poll_seconds=0.1,
            lease_seconds=15,
            in_flight=1,  # one user thread: the other community's call runs on the same connection
            connections=1,
            worker_id="aio-hygiene",
        )
    )
    counts = worker.run()
    assert counts["completed"] == 2, counts
    # Without the scope and clean-up around it, the other community's call saw the TEMP table
    # (holding the first community's id) and the setting, or ran inside the transaction left
    # open (autocommit off: its writes never committed, nothing judged).
    assert AgentRun.objects.get(id=then.run_id).output == [{"seen": clean()}]
    output = AgentRun.objects.get(id=first.run_id).output
    if leave == "transaction":
        assert "transaction_left_open" in output["failed"]
    else:
        assert output == [{"seen": clean()}]


def parks_with_autocommit_off(ctx) -> dict:
    """A plain handler that asks for an approval (the run parks: the bridge raises the park
    through it) with a transaction of its own left open."""
    transaction.set_autocommit(False)
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return ctx.request_approval("ok?", 600)


def test_a_plain_handler_parked_with_a_transaction_left_open_is_counted_parked_not_failed(community):
    """The park (the runtime's own stop, as a lost run's) passes through unchanged: the run
    waits for its approval. As the async handlers' (aio_runtime.async_user_code)."""
    run_id = intake_event(community.id, "test", "p", {}, AGENT).run_id
    worker = AsyncAgentWorker(
        AsyncWorkerConfig(
            handler=parks_with_autocommit_off,
            agents=[AGENT],
            communities=[community.id],
            exit_when_idle=True,
            poll_seconds=0.1,
            lease_seconds=15,
            in_flight=1,
            connections=1,
            worker_id="aio-hygiene",
        )
    )
    counts = worker.run()
    run = AgentRun.objects.get(id=run_id)
    assert run.state == "waiting_approval", (counts, run.state, run.failure_code)
    assert (counts.get("parked"), counts.get("lost", 0), counts.get("failed", 0)) == (1, 0, 0), counts


def slow_and_leaves_open(args: dict, key: str) -> dict:
    transaction.set_autocommit(False)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_sleep(0.5)")
    return {"ok": True}


async def times_out_on_a_left_open_call(ctx):
    try:
        async with asyncio.timeout(0.1):
            await ctx.call("slow", slow_and_leaves_open, {})
    except TimeoutError:
        timed_out = True
    task = asyncio.current_task()
    assert task is not None
    return [{"timed_out": timed_out, "cancelling": task.cancelling()}, await _call(ctx, "nothing")]


def test_a_timeout_around_a_plain_call_that_leaves_a_transaction_open_is_a_timeout_and_recorded_failed(community):
    """``asyncio.timeout()`` around the call still raises TimeoutError (the cancel count back at
    0), and the call, landed once its thread ends, is recorded failed transaction_left_open."""
    run_id = intake_event(community.id, "test", "to", {"via": "plain_tool"}, AGENT).run_id
    worker = AsyncAgentWorker(
        AsyncWorkerConfig(
            handler=times_out_on_a_left_open_call,
            agents=[AGENT],
            communities=[community.id],
            exit_when_idle=True,
            poll_seconds=0.1,
            lease_seconds=15,
            in_flight=1,
            connections=1,
            worker_id="aio-hygiene",
        )
    )
    counts = worker.run()
    assert counts["completed"] == 1, counts
    assert AgentRun.objects.get(id=run_id).output == [{"timed_out": True, "cancelling": 0}, {"seen": clean()}]
    entry = JournalEntry.objects.get(run_id=run_id, tool_name="slow")
    assert entry.status == "failed" and "transaction_left_open" in entry.error, (entry.status, entry.error)


_KEPT: list = []  # what a tool keeps past its call (an iterator still reading: its cursor stays open)


def reads_with_an_iterator_or_looks(args: dict, key: str) -> dict:
    """The first community's tool leaves a server-side cursor (``.iterator()``, WITH HOLD outside
    a transaction) open, half read; the other's lists and reads what cursors its connection has."""
    if args["keep"]:
        rows = AgentRun.objects.values_list("community_id", flat=True).iterator(chunk_size=1)
        next(rows)
        _KEPT.append(rows)
        return {"kept": True}
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM pg_cursors")
        names = [name for (name,) in cursor.fetchall()]
        read = []
        for name in names:
            cursor.execute(f'FETCH ALL FROM "{name}"')
            read += [str(c) for (c,) in cursor.fetchall()]
    return {"cursors": names, "read": read}


async def keeps_a_cursor_or_looks(ctx):
    args = {"keep": ctx.input["keep"]}
    return await ctx.call("cursor", reads_with_an_iterator_or_looks, args)


def test_a_server_side_cursor_a_plain_tool_leaves_open_is_closed_before_another_community_s_call(community):
    """An ORM ``.iterator()`` declares a server-side cursor (WITH HOLD: its rows, the first
    community's, kept past the transaction); a tool that keeps it past its call (a reference,
    an exception's traceback in a cycle) left it on the shared connection: the next call there,
    another community's, found it in ``pg_cursors`` and read the first community's rows from it."""
    other = CommunityFactory()
    intake_event(community.id, "test", "keep", {"keep": True}, AGENT)
    looks = intake_event(other.id, "test", "look", {"keep": False}, AGENT).run_id
    _KEPT.clear()
    worker = AsyncAgentWorker(
        AsyncWorkerConfig(
            handler=keeps_a_cursor_or_looks,
            agents=[AGENT],
            communities=[community.id, other.id],
            exit_when_idle=True,
            poll_seconds=0.1,
            lease_seconds=15,
            in_flight=1,
            connections=1,
            worker_id="aio-hygiene",
        )
    )
    try:
        worker.run()
    finally:
        _KEPT.clear()
    assert AgentRun.objects.get(id=looks).output == {"cursors": [], "read": []}
