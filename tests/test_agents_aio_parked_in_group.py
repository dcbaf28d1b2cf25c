"""The event-loop runtime: a run that parks for an approval asked inside an
``asyncio.TaskGroup`` (or a framework that runs its tools in one).

The group wraps the runtime's park signal in an ``ExceptionGroup``. Before, it reached the
worker as the handler's failure: ``run_claim`` tried to fail the run (its lease already
released by the park: refused) and counted it ``lost``, logging a failure code; the run itself
stayed parked. Now a group whose leaves include the park is the park (``parked``), the park
having been written; one whose leaves are all the runtime's own stops (``RunAborted``) is
``lost``; any other group stays the handler's failure."""

from __future__ import annotations

import asyncio

import pytest

from buzz_delivery.agents.models import AgentRun, JournalEntry
from tests.agents_support import new_run
from tests.aio_worker_support import run_in_thread

pytestmark = pytest.mark.django_db(transaction=True)


async def parks_in_a_task_group(ctx):
    async def ask():
        with ctx.scope("ask"):
            return await ctx.request_approval("ok?", 600)

    async with asyncio.TaskGroup() as group:
        group.create_task(ask())
    return "never"


async def parks_in_a_task_group_while_a_sibling_fails_on_its_cancel(ctx):
    """The park cancels the sibling, whose cleanup raises: the group holds both."""
    sibling_waits = asyncio.Event()

    async def sibling():
        try:
            sibling_waits.set()
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise ValueError("cleanup failed") from None

    async def ask():
        await sibling_waits.wait()
        with ctx.scope("ask"):
            return await ctx.request_approval("ok?", 600)

    async with asyncio.TaskGroup() as group:
        group.create_task(sibling())
        group.create_task(ask())
    return "never"


@pytest.mark.parametrize("handler", [parks_in_a_task_group, parks_in_a_task_group_while_a_sibling_fails_on_its_cancel])
def test_a_park_inside_a_task_group_is_counted_parked(community, handler, caplog):
    run_id = new_run(community.id)
    caplog.set_level("INFO", logger="buzz_delivery.agents")
    counts = run_in_thread(community, handler)
    run = AgentRun.objects.get(id=run_id)
    assert run.state == "waiting_approval", (counts, run.state, run.failure_code, run.failure_message)
    assert (counts.get("parked"), counts.get("lost", 0), counts.get("failed", 0)) == (1, 0, 0), counts
    assert [e.kind for e in JournalEntry.objects.filter(run_id=run_id)] == ["approval"]
    lines = [r.getMessage() for r in caplog.records if str(run_id) in r.getMessage()]
    assert any(line.startswith("parked run=") for line in lines), lines
    assert not any("code=" in line or line.startswith(("lost", "run_error")) for line in lines), lines
