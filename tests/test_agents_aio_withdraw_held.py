"""The event-loop runtime: a call cancelled (by the handler's own code) while its journal
write's batch is out, under a worker's lock-wait bound (a worker serving several communities).

Its batch out, the write cannot be withdrawn: the call waits for its outcome. When the batch
comes back unwritten (it waited past the bound for the run's row, held by a long transaction),
its items are queued again for their community's turn. Before, the cancelled call's item went
back with them and its task waited for as long as the row was held (a ``wait_for`` around the
call, a failing ``TaskGroup`` sibling: held for the length of another's transaction), then was
journaled and closed 'not made'. Now an item asked back while its batch was out is dropped
when the batch comes back unwritten: nothing written, the cancel goes on at once."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
from django.db import connection, connections

from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.testing import CommunityFactory
from tests.agents_support import AGENT, new_run
from tests.aio_worker_support import waited
from tests.citus_support import CITUS_MODE
from tests.tenant_locks import rows_held

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 20.0
STEP: dict = {}


async def cancels_a_call_whose_write_waits_for_a_lock(ctx):
    async def tool(args, key):
        STEP["made"] = True
        return "made"

    async def branch():
        with ctx.scope("x"):
            return await ctx.call("x", tool, {})

    STEP["claimed"].set()
    assert await waited(STEP["held"])
    task = asyncio.ensure_future(branch())
    assert await waited(STEP["cancel"])  # the write's batch is out: it waits for the held row
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    STEP["task_cancelled"] = task.cancelled()
    STEP["task_done"].set()
    assert await waited(STEP["released"])
    return "done"


def journal_writes_waiting_for_a_lock() -> int:
    view = "citus_stat_activity" if CITUS_MODE else "pg_stat_activity"
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {view} WHERE wait_event_type = 'Lock' AND query LIKE '%%scope_index%%'")
        return cursor.fetchone()[0]


def test_a_cancelled_call_whose_write_comes_back_unwritten_ends_without_waiting_for_the_lock(community):
    STEP.clear()
    STEP.update({name: threading.Event() for name in ("claimed", "held", "cancel", "task_done", "released")})
    other = CommunityFactory()
    run_id = new_run(community.id)
    config = AsyncWorkerConfig(
        handler=cancels_a_call_whose_write_waits_for_a_lock,
        agents=[AGENT],
        communities=[community.id, other.id],  # several: batches wait for a lock within a bound
        exit_when_idle=True,
        poll_seconds=0.1,
        lease_seconds=60,  # longer than WAIT: the holder keeps its lease while the row is held
        worker_id="aio-test",
        in_flight=4,
        connections=2,
    )
    out: list = []

    def work() -> None:
        try:
            out.append(AsyncAgentWorker(config).run())
        finally:
            connections.close_all()

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    try:
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
            # The batch comes back unwritten within the bound; the cancel then goes on, the row
            # still held (before, the task waited for the row's release).
            ended_while_held = STEP["task_done"].wait(WAIT)
        STEP["released"].set()
    finally:
        STEP["released"].set()
        worker.join(60)
    assert not worker.is_alive(), "the run is stuck"
    assert ended_while_held, "the cancelled call waited for the held row"
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == ("completed", None), (out, run.failure_code, run.failure_message)
    assert STEP["task_cancelled"] is True and "made" not in STEP
    assert list(JournalEntry.objects.filter(run_id=run_id)) == []  # nothing written for it
