"""The event-loop runtime: a call whose task is cancelled (by the handler's own code) while its
journal write is on its way to the database.

Its batch already sent, the write cannot be withdrawn: the entry is written ``pending``. Before,
the call was no longer tracked as in flight (the cancel ended its task at once), so the run's
completion met a call of its holder still pending, asked again for ``APPROVAL_SETTLE_SECONDS``
and failed the run ``calls_in_flight``. Now the cancelled call waits for its write's outcome,
is tracked in flight, and is closed ``failed`` ("not made": its tool never ran), then the cancel
goes on: the run completes. A write still queued when its task is cancelled is withdrawn
(nothing written).

A call's result, likewise: its task cancelled while its record was still queued (the pool's
connection busy), the record was withdrawn and the call landed pending; the run's completion
failed ``calls_in_flight``. A record is now never withdrawn (unless the run is lost): it is
written, then the cancel goes on."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
from django.db import connection

from buzz_delivery.agents.models import AgentRun, JournalEntry
from tests.agents_support import new_run
from tests.aio_worker_support import run_in_thread, waited
from tests.citus_support import CITUS_MODE
from tests.tenant_locks import rows_held

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 20.0
STEP: dict = {}


async def cancels_a_call_as_it_is_journaled(ctx):
    """Task ``x`` calls; once its journal write waits in the database (the test holds the run's
    row), the handler cancels the task, then completes."""

    async def tool(args, key):
        STEP["made"] = True
        return "made"

    async def branch():
        with ctx.scope("x"):
            return await ctx.call("x", tool, {})

    STEP["claimed"].set()
    assert await waited(STEP["held"])
    task = asyncio.ensure_future(branch())
    assert await waited(STEP["cancel"])  # the write is sent: it waits for the held row
    task.cancel()
    STEP["cancelled"].set()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    STEP["task_cancelled"] = task.cancelled()
    return "done"


def journal_writes_waiting_for_a_lock() -> int:
    """Sessions writing a journal entry (the batch's statement names ``scope_index``) that wait
    for a lock now (on a Citus cluster, on every node)."""
    view = "citus_stat_activity" if CITUS_MODE else "pg_stat_activity"
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {view} WHERE wait_event_type = 'Lock' AND query LIKE '%%scope_index%%'")
        return cursor.fetchone()[0]


def test_a_call_cancelled_while_its_journal_write_is_sent_is_closed_and_the_run_completes(community):
    STEP.clear()
    STEP.update({name: threading.Event() for name in ("claimed", "held", "cancel", "cancelled")})
    run_id = new_run(community.id)

    def hold_the_run_while_the_call_is_journaled():
        assert STEP["claimed"].wait(WAIT)
        with rows_held(AgentRun, community.id, run_id):
            STEP["held"].set()
            for _ in range(int(WAIT / 0.05)):  # the journal batch waits for the run's row
                if journal_writes_waiting_for_a_lock():
                    break
                threading.Event().wait(0.05)
            else:
                raise AssertionError("the journal write never waited for the held row")
            STEP["cancel"].set()
            assert STEP["cancelled"].wait(WAIT)  # cancelled with its write on the way: then released

    counts = run_in_thread(
        community, cancels_a_call_as_it_is_journaled, meanwhile=hold_the_run_while_the_call_is_journaled
    )
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == ("completed", None), (counts, run.failure_code, run.failure_message)
    assert counts.get("completed") == 1, counts
    assert STEP["task_cancelled"] is True and "made" not in STEP  # the cancel went on; the tool never ran
    entries = list(JournalEntry.objects.filter(run_id=run_id).values_list("scope", "status", "error"))
    assert len(entries) == 1 and entries[0][:2] == ("x", "failed"), entries
    assert "not made" in entries[0][2], entries


async def cancels_a_call_while_its_record_is_queued(ctx):
    """Task ``x``'s tool runs; the test holds the run's row and task ``y``'s journal write waits
    for it on the pool's only connection; ``x``'s tool returns (its record queued behind ``y``'s
    write) and the handler cancels ``x``, then completes."""
    x_running, finish = asyncio.Event(), asyncio.Event()

    async def x_tool(args, key):
        x_running.set()
        await finish.wait()
        return "x"

    async def y_tool(args, key):
        return "y"

    async def in_scope(name, tool):
        with ctx.scope(name):
            return await ctx.call(name, tool, {})

    x = asyncio.ensure_future(in_scope("x", x_tool))
    await x_running.wait()
    STEP["x_running"].set()
    assert await waited(STEP["held"])
    y = asyncio.ensure_future(in_scope("y", y_tool))
    assert await waited(STEP["y_waits"])  # the pool's connection waits for the held row
    finish.set()
    batcher = ctx.runtime.batcher
    for _ in range(int(WAIT / 0.01)):  # x's result queued, not sent (the connection is busy)
        if any(op == "record" for op, _ in batcher._pending):
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("x's record never queued")
    x.cancel()
    STEP["cancelled"].set()
    with contextlib.suppress(asyncio.CancelledError):
        await x
    STEP["task_cancelled"] = x.cancelled()
    await y
    return "done"


def test_a_call_cancelled_while_its_record_is_queued_is_recorded_and_the_run_completes(community):
    STEP.clear()
    STEP.update({name: threading.Event() for name in ("x_running", "held", "y_waits", "cancelled")})
    run_id = new_run(community.id)

    def hold_the_run_while_x_is_recorded():
        assert STEP["x_running"].wait(WAIT)
        with rows_held(AgentRun, community.id, run_id):
            STEP["held"].set()
            for _ in range(int(WAIT / 0.05)):
                if journal_writes_waiting_for_a_lock():
                    break
                threading.Event().wait(0.05)
            else:
                raise AssertionError("y's journal write never waited for the held row")
            STEP["y_waits"].set()
            assert STEP["cancelled"].wait(WAIT)

    counts = run_in_thread(
        community, cancels_a_call_while_its_record_is_queued, meanwhile=hold_the_run_while_x_is_recorded, connections=1
    )
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == ("completed", None), (counts, run.failure_code, run.failure_message)
    assert STEP["task_cancelled"] is True  # recorded, then the cancel went on
    entries = dict(JournalEntry.objects.filter(run_id=run_id).values_list("scope", "status"))
    assert entries == {"x": "succeeded", "y": "succeeded"}, entries
