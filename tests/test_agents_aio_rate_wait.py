"""The event-loop runtime: a call waiting for its rate limit (``ctx.call(..., rate_key=...)``)
does not hold the run's journal lock while it waits.

Before, the wait was taken holding the lock (between taking the call's index and journaling
it): the run's other tasks' calls (and its approvals, its end) waited behind it for as long as
the provider's window lasted. Now the call takes its units before it takes its index (the lock
let go meanwhile), then journals under the lock as before: the index taken and the seq given
still under one hold. Here a free call of another task is made and recorded while the rated
one waits; the rated one is then cancelled in its wait (nothing journaled for it)."""

from __future__ import annotations

import asyncio

import pytest
from django.test import override_settings

from buzz_delivery.agents.models import AgentRun, JournalEntry
from tests.agents_support import new_run
from tests.aio_worker_support import run_in_thread

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 20.0
# One unit a window this long: a rated call waits (up to the window's end) for the next one.
PERIOD = 40
SEEN: dict = {}


async def calls_while_another_task_waits_for_its_rate(ctx):
    async def tool(args, key):
        SEEN.setdefault("made", []).append(args["name"])
        return args["name"]

    async def call(name, **kwargs):
        with ctx.scope(name):
            return await ctx.call(name, tool, {"name": name}, **kwargs)

    # A rated call that waits: the first takes the window's unit; should a window begin between
    # its take and the next call's (both granted at once), the one after that waits.
    for n in range(1, 4):
        rated = asyncio.ensure_future(call(f"rated{n}", rate_key="slow"))
        for _ in range(int(WAIT / 0.01)):
            if ctx.rate_waits or rated.done():
                break
            await asyncio.sleep(0.01)
        if ctx.rate_waits:
            break
        await rated
    SEEN["waiting"] = f"rated{n}"
    await call("free")  # another task's call, no rate key
    SEEN["rated_still_waiting"] = not rated.done() and SEEN["waiting"] not in SEEN.get("made", [])
    rated.cancel()
    try:
        await rated
    except asyncio.CancelledError:
        SEEN["rated_cancelled"] = True
    return "done"


def test_a_call_waiting_for_its_rate_limit_lets_the_runs_other_calls_through(community):
    SEEN.clear()
    run_id = new_run(community.id)
    with override_settings(BUZZ_DELIVERY={"RATE_LIMITS": {"slow": {"limit": 1, "period": PERIOD}}}):
        counts = run_in_thread(community, calls_while_another_task_waits_for_its_rate)
    run = AgentRun.objects.get(id=run_id)
    assert run.state == "completed", (counts, run.state, run.failure_code, run.failure_message)
    assert SEEN["rated_still_waiting"] is True, SEEN  # free was made and recorded during the rated one's wait
    granted = [name for name in SEEN["made"] if name.startswith("rated")]
    assert SEEN.get("rated_cancelled") is True and SEEN["made"] == [*granted, "free"], SEEN
    assert 1 <= len(granted) <= 2 and SEEN["waiting"] not in granted, SEEN
    entries = [(e.scope, e.status) for e in JournalEntry.objects.filter(run_id=run_id).order_by("seq")]
    assert entries == [*((name, "succeeded") for name in granted), ("free", "succeeded")], entries
