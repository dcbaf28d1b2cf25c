"""The event-loop runtime: a call that waits for its rate limit keeps the index it was called
at, so a resumed run replays each call of a scope from the same entry.

Two calls of one scope made at once (``asyncio.gather`` or tasks in the run's root scope): a
rated one called first, then a free one. The rated one waits for its window with the journal
lock let go (branch ``loopfix``); it took its index only once its units were granted, so the
free one, called after it, took index 1 and the rated one index 2. A resumed handler makes the
same calls in the same order: the rated one (its entry written or not) found the free one's
entry at index 1 and failed the run ``ReplayMismatch`` (or, with the same tool and arguments,
replayed another call's result). Now the index is taken when the call is made, under the lock,
as before the change, and only the wait for the units is outside it."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from django.test import override_settings

from buzz_delivery.agents.exceptions import RunAborted
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import reap_agent_runs
from buzz_delivery.services import ratelimits
from tests.agents_support import backdate_run_lease, make_claimable, new_run
from tests.aio_worker_support import run_in_thread

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 20.0  # bound of the wait for the rated call to start waiting (or end)
PERIOD = 86_400 * 31  # one window: exhausted before the first invocation, it does not end meanwhile
SEEN: dict = {}


async def rated_then_free_in_one_scope(ctx):
    """The same program in both invocations: ``rated`` called first (in a task), then ``free``
    once ``rated`` waits for its units or has ended. The first invocation is lost (the holder
    crashes) once ``free`` is recorded, ``rated`` still waiting."""

    async def tool(args, key):
        SEEN.setdefault("made", []).append((SEEN["phase"], args["name"]))
        return args["name"]

    rated = asyncio.ensure_future(ctx.call("tool", tool, {"name": "rated"}, rate_key="slow"))
    for _ in range(int(WAIT / 0.01)):
        if ctx.rate_waits or rated.done():
            break
        await asyncio.sleep(0.01)
    SEEN.setdefault("rated_waited", []).append(ctx.rate_waits > 0)
    free = await ctx.call("tool", tool, {"name": "free"})
    if SEEN["phase"] == 1:
        ctx.mark_lost("test_reclaim")  # the holder is lost, rated still waiting for its units
        with contextlib.suppress(RunAborted):
            await rated
        raise RunAborted("the run was lost")
    return {"rated": await rated, "free": free}


def test_a_rated_call_waiting_in_a_scope_keeps_its_index_for_the_replay_after_a_reclaim(community):
    SEEN.clear()
    SEEN["phase"] = 1
    run_id = new_run(community.id)
    with override_settings(BUZZ_DELIVERY={"RATE_LIMITS": {"slow": {"limit": 1, "period": PERIOD}}}):
        ratelimits.charge(community.id, "slow", 1)  # the window's unit spent: the rated call waits
        counts = run_in_thread(community, rated_then_free_in_one_scope)
    assert counts.get("lost") == 1, counts
    assert SEEN["rated_waited"] == [True] and SEEN["made"] == [(1, "free")], SEEN

    backdate_run_lease(run_id)  # time passing for the lost holder: reclaimed, claimable again
    assert reap_agent_runs().reclaimed == 1
    make_claimable(run_id)
    SEEN["phase"] = 2
    with override_settings(BUZZ_DELIVERY={"RATE_LIMITS": {"slow": {"limit": 100, "period": PERIOD}}}):
        counts = run_in_thread(community, rated_then_free_in_one_scope)
    run = AgentRun.objects.get(id=run_id)
    assert run.state == "completed", (counts, run.state, run.failure_code, run.failure_message)
    assert run.output == {"rated": "rated", "free": "free"}, run.output
    assert SEEN["made"] == [(1, "free"), (2, "rated")], SEEN  # free replayed, never made twice
    rows = JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    entries = [(e.seq, e.replay_key, e.args["name"], e.status) for e in rows]
    assert entries == [(1, ("", 2), "free", "succeeded"), (2, ("", 1), "rated", "succeeded")], entries
