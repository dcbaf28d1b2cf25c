"""Both agent runtimes: a rated call whose units are given back (its journal write refused or
shadow-blocked) and whose give-back raises still leaves the run's calls in flight, so the run
can end (docs/flow-control.md).

The give-back came after the call was counted in flight and outside the ``try``/``finally`` that
counts it out: when it raised, the call stayed counted for ever. Here the operator lowers the
key's limit in the settings while the call's journal write waits (its units were taken under the
old limit: the give-back's ``ratelimits.give_back`` now refuses them, ``ValidationError`` naming
``units``), and the write is shadow-blocked (a shadow run's destructive call: journaled
``failed``, its tool never made, its units given back). The call was made on a thread the
handler started: once it raised and the handler returned, the run's end waited for that call
(``_await_calls``: a call of another thread in flight) and the run never ended, its lease held.
Now the call leaves flight whatever its give-back raises, the error reaches its caller, and the
run completes.

The event-loop runtime already gave back inside the call's ``try``/``finally``; its test keeps
it so (moving its give-back before the ``try`` makes it fail).

A real transaction of another session holds the run's row (``FOR UPDATE``) once the call's take
was granted, so its journal statement waits for the lock; the settings change then, and the
holder rolls back."""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg
import pytest
from django.db import connection, connections
from django.test import override_settings

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import Context, run_claim
from buzz_delivery.agents.services import claim_agent_runs
from project.database_url import database_url
from tests.agents_support import AGENT, new_run
from tests.aio_worker_support import run_in_thread, waited
from tests.test_agents_rate_give_back import journal_writes_waiting_for_a_lock

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 20.0
PERIOD = 86_400 * 31  # one window for the whole test
LIMITS = {"RATE_LIMITS": {"slow": {"limit": 5, "period": PERIOD}}}
LOWERED = {"RATE_LIMITS": {"slow": {"limit": 2, "period": PERIOD}}}  # the 3 units taken are now too many
STEP: dict = {}


def tool(args: dict, key: str) -> str:
    STEP["made"] = True
    return "made"


def rated_call(ctx) -> None:
    """On a thread of the handler's: the rated call (shadow-blocked once taken)."""
    try:
        ctx.call("rated", tool, {}, rate_key="slow", weight=3, destructive=True)
    except BaseException as exc:
        STEP["raised"] = (type(exc).__name__, str(exc))
    finally:
        connections.close_all()


def handler(ctx):
    STEP["claimed"].set()
    assert STEP["held"].wait(WAIT)  # the run's row held: the take goes through, the write waits
    caller = threading.Thread(target=rated_call, args=(ctx,), daemon=True)
    caller.start()
    caller.join(WAIT)
    assert not caller.is_alive(), "the rated call never ended"
    return {"ok": True}


def lower_the_limit_as_the_write_waits(community_id, run_id, lowered) -> None:
    """Hold the run's row once its handler runs (the run claimed); once the call's journal write
    waits for it, lower the key's limit (``lowered.enable()``: the settings of the whole process)
    and let the write go (rollback)."""
    assert STEP["claimed"].wait(WAIT)
    holder = psycopg.connect(database_url(connection.settings_dict))
    try:
        holder.execute(
            "SELECT 1 FROM buzz_agents_run WHERE community_id = %s AND id = %s FOR UPDATE", [community_id, run_id]
        )
        STEP["held"].set()
        deadline = time.monotonic() + WAIT
        while not journal_writes_waiting_for_a_lock():
            assert time.monotonic() < deadline, "the journal write never waited for the held row"
            time.sleep(0.05)
        lowered.enable()
        STEP["lowered"] = True
        holder.rollback()
    finally:
        holder.close()


def test_a_rated_call_whose_give_back_raises_leaves_flight_and_the_run_completes(community):
    STEP.clear()
    STEP.update({name: threading.Event() for name in ("claimed", "held")})
    lowered = override_settings(BUZZ_DELIVERY=LOWERED)
    with override_settings(BUZZ_DELIVERY=LIMITS):
        run_id = new_run(community.id, shadow=True)
        (claim,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
        ctx = Context(claim)
        out: list = []

        def handle() -> None:
            try:
                out.append(run_claim(claim, handler, ctx))
            finally:
                connections.close_all()

        worker = threading.Thread(target=handle, daemon=True)
        worker.start()
        try:
            lower_the_limit_as_the_write_waits(community.id, run_id, lowered)
            worker.join(WAIT)
        finally:
            ended = not worker.is_alive()
            if not ended:  # let the stuck run go (its context lost), so the test ends
                ctx.mark_lost("test_over")
                worker.join(WAIT)
            if STEP.get("lowered"):
                lowered.disable()
        assert ended, f"the run never ended: its rated call stayed in flight ({STEP.get('raised')})"
        assert out == ["completed"], (out, STEP)
    raised, message = STEP["raised"]
    assert raised == "ValidationError" and "units" in message, STEP["raised"]  # the give-back's refusal
    assert STEP.get("made") is None
    (entry,) = JournalEntry.objects.filter(run_id=run_id)
    assert (entry.status, bool(entry.blocked_reason)) == ("failed", True)  # shadow-blocked, never made
    assert AgentRun.objects.get(id=run_id).state == "completed"


async def async_handler(ctx):
    STEP["claimed"].set()
    assert await waited(STEP["held"])  # the run's row held: the take goes through, the write waits
    call = asyncio.create_task(ctx.call("rated", tool, {}, rate_key="slow", weight=3, destructive=True))
    try:
        await call
    except BaseException as exc:
        STEP["raised"] = (type(exc).__name__, str(exc))
    STEP["in_flight"] = ctx.calls_in_flight
    return {"ok": True}


def test_the_event_loop_runtime_counts_a_call_whose_give_back_raises_out_of_flight(community):
    STEP.clear()
    STEP.update({name: threading.Event() for name in ("claimed", "held")})
    lowered = override_settings(BUZZ_DELIVERY=LOWERED)
    with override_settings(BUZZ_DELIVERY=LIMITS):
        run_id = new_run(community.id, shadow=True)
        try:
            counts = run_in_thread(
                community,
                async_handler,
                meanwhile=lambda: lower_the_limit_as_the_write_waits(community.id, run_id, lowered),
                handler_timeout=8,  # a call left in flight: the run ends lost at its deadline, not stuck
            )
        finally:
            if STEP.get("lowered"):
                lowered.disable()
    raised, message = STEP["raised"]
    assert raised == "ValidationError" and "units" in message, STEP["raised"]  # the give-back's refusal
    assert STEP["in_flight"] == (), f"the call was left in flight: {STEP['in_flight']}"
    assert counts.get("completed") == 1, counts
    assert STEP.get("made") is None
    (entry,) = JournalEntry.objects.filter(run_id=run_id)
    assert (entry.status, bool(entry.blocked_reason)) == ("failed", True)
    assert AgentRun.objects.get(id=run_id).state == "completed"
