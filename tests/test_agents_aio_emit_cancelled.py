"""The event-loop runtime: an ``emit`` whose task is cancelled (by the handler's own code: a
sibling failing in an ``asyncio.TaskGroup``) while its statement is on its way.

The emit is one statement on a pool thread: cancelling its awaiter does not stop it, and it
commits. Before, the emitting task ended ``CancelledError`` at once, its lock let go and its
position not advanced while the chunk was still being written: the handler went on to emit its
next chunk, whose statement ran beside the first one (two chunks of one run in flight at once,
their order left to whichever took the run's row first), the runtime never counting the first.
Now, as the park (``test_agents_aio_park_cancelled``), the statement's outcome is awaited
through the handler's own cancels, the lock held meanwhile, the position advanced for a chunk
written, and then the cancel goes on: the next chunk is sent only after it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from django.db import connection

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import read_output
from tests.agents_support import new_run
from tests.aio_worker_support import run_in_thread, waited
from tests.citus_support import CITUS_MODE
from tests.tenant_locks import rows_held

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 20.0
BESIDE = 3.0  # how long the test looks for a second chunk's statement beside the first
STEP: dict = {}


async def a_sibling_fails_as_a_chunk_is_written(ctx):
    async def speak():
        await ctx.emit("first")

    async def sibling():
        assert await waited(STEP["emit_sent"])  # the chunk's statement waits for the held row
        raise ValueError("the sibling failed")

    STEP["claimed"].set()
    assert await waited(STEP["held"])
    try:
        async with asyncio.TaskGroup() as group:
            STEP["speak"] = group.create_task(speak())
            group.create_task(sibling())
    except* ValueError:
        pass
    STEP["second"] = await ctx.emit("second")
    return "done"


def emits_waiting_for_a_lock() -> int:
    view = "citus_stat_activity" if CITUS_MODE else "pg_stat_activity"
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT count(*) FROM {view} WHERE wait_event_type = 'Lock'"
            " AND query LIKE '%%INSERT INTO %%buzz_agents_output%%'"
        )
        return cursor.fetchone()[0]


def test_an_emit_whose_task_is_cancelled_as_it_is_written_holds_back_the_next_chunk(community):
    STEP.clear()
    STEP.update({name: threading.Event() for name in ("claimed", "held", "emit_sent")})
    run_id = new_run(community.id)

    def hold_the_run_while_it_emits():
        assert STEP["claimed"].wait(WAIT)
        with rows_held(AgentRun, community.id, run_id):
            STEP["held"].set()
            deadline = time.monotonic() + WAIT
            while not emits_waiting_for_a_lock():
                assert time.monotonic() < deadline, "the emit never waited for the held row"
                time.sleep(0.05)
            STEP["emit_sent"].set()
            deadline = time.monotonic() + WAIT
            while not (STEP["speak"].cancelling() or STEP["speak"].done()):  # the group cancels it
                assert time.monotonic() < deadline, "the emitting task was never cancelled"
                time.sleep(0.05)
            deadline = time.monotonic() + BESIDE  # the next chunk's statement beside it?
            while time.monotonic() < deadline and not STEP.get("beside"):
                STEP["beside"] = emits_waiting_for_a_lock() > 1
                time.sleep(0.05)

    counts = run_in_thread(community, a_sibling_fails_as_a_chunk_is_written, meanwhile=hold_the_run_while_it_emits)
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, counts.get("completed")) == ("completed", 1), (counts, run.state, run.failure_code)
    assert STEP["beside"] is False, "the next chunk was sent while the cancelled one was still being written"
    assert STEP["speak"].cancelled(), STEP  # the cancel went on once the chunk was written
    assert STEP["second"] == 2, STEP
    page = read_output(community.id, run_id)
    assert [(c.seq, c.chunk) for c in page.chunks] == [(1, "first"), (2, "second")], page
