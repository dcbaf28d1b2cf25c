"""The event-loop runtime: an approval's park whose task is cancelled (by the handler's own
code: a sibling failing in an ``asyncio.TaskGroup``) while its statement is on its way.

The park is one statement on a pool thread: cancelling its awaiter does not stop it, and it
commits (the run ``waiting_approval``, its lease released, an approval asked of a human). Before,
the asking task ended ``CancelledError`` and the runtime never learnt the run had parked: the
group held only the sibling's error, so the worker took it for the handler's failure, tried to
fail the run (refused: it is parked) and counted it ``lost`` ("left to its lease"), the run
parked all the same. Now the park's outcome is awaited (a statement's time) and, written, it
is the park (:class:`_Parked`, not the cancel): counted ``parked``, the sibling's error logged
``parked_with_errors``, as a park raised through a group is."""

from __future__ import annotations

import asyncio
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


async def a_sibling_fails_as_the_park_is_written(ctx):
    async def ask():
        with ctx.scope("ask"):
            return await ctx.request_approval("ok?", 600)

    async def sibling():
        assert await waited(STEP["park_sent"])  # the park's statement waits for the held row
        raise ValueError("the sibling failed")

    STEP["claimed"].set()
    assert await waited(STEP["held"])
    async with asyncio.TaskGroup() as group:
        STEP["ask"] = group.create_task(ask())
        group.create_task(sibling())
    return "never"


def parks_waiting_for_a_lock() -> int:
    view = "citus_stat_activity" if CITUS_MODE else "pg_stat_activity"
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT count(*) FROM {view} WHERE wait_event_type = 'Lock' AND query LIKE '%%waiting_approval%%'"
        )
        return cursor.fetchone()[0]


def test_a_park_whose_task_is_cancelled_as_it_is_written_is_counted_parked(community, caplog):
    STEP.clear()
    STEP.update({name: threading.Event() for name in ("claimed", "held", "park_sent")})
    run_id = new_run(community.id)
    caplog.set_level("INFO", logger="buzz_delivery.agents")

    def hold_the_run_while_it_parks():
        assert STEP["claimed"].wait(WAIT)
        with rows_held(AgentRun, community.id, run_id):
            STEP["held"].set()
            for _ in range(int(WAIT / 0.05)):
                if parks_waiting_for_a_lock():
                    break
                threading.Event().wait(0.05)
            else:
                raise AssertionError("the park never waited for the held row")
            STEP["park_sent"].set()
            for _ in range(int(WAIT / 0.05)):  # the group cancels the asking task: then released
                if STEP["ask"].cancelling() or STEP["ask"].done():
                    break
                threading.Event().wait(0.05)
            else:
                raise AssertionError("the asking task was never cancelled")

    counts = run_in_thread(community, a_sibling_fails_as_the_park_is_written, meanwhile=hold_the_run_while_it_parks)
    run = AgentRun.objects.get(id=run_id)
    assert run.state == "waiting_approval", (counts, run.state, run.failure_code, run.failure_message)
    assert (counts.get("parked"), counts.get("lost", 0), counts.get("failed", 0)) == (1, 0, 0), counts
    assert [e.kind for e in JournalEntry.objects.filter(run_id=run_id)] == ["approval"]
    lines = [r.getMessage() for r in caplog.records if str(run_id) in r.getMessage()]
    assert any(line.startswith("parked_with_errors") and "the sibling failed" in line for line in lines), lines
    assert not any(line.startswith(("lost", "run_error")) for line in lines), lines
