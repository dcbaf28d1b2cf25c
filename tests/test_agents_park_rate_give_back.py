"""Both agent runtimes: a rated call on another thread (task) of the handler whose units were
granted as the handler parked the run is stopped by the park before it is journaled, and its
units are given back, as when its journal write is refused (docs/flow-control.md).

A call waiting for its rate units is not in flight (it is journaled only once they are granted):
the park does not wait for it. Once parked, the call's check before its journal write raises
``_Parked`` (a ``BaseException`` since the park became one). The give-back was taken only on
``RunAborted`` (and a cancel): the park's stop left the 3 units spent for a tool never made,
where the journal write it replaced (refused: the run no longer running) gave them back.

The take is real; the wrapper around it holds the granted take back until the handler's park
is written (``ctx.parked``), so the park lands between the grant and the journal write."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from django.db import connections
from django.test import override_settings

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import claim_agent_runs
from buzz_delivery.models import RateLimit
from buzz_delivery.services import ratelimits
from tests.agents_support import AGENT, new_run
from tests.aio_worker_support import run_in_thread, waited

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 20.0
PERIOD = 86_400 * 31  # one window for the whole test
LIMITS = {"RATE_LIMITS": {"slow": {"limit": 5, "period": PERIOD}}}
STEP: dict = {}


def tool(args: dict, key: str) -> str:
    STEP["made"] = True
    return "made"


def used(community) -> int:
    return RateLimit.objects.get(community_id=community.id, key="slow").used


@pytest.fixture
def held_take(monkeypatch):
    """``ratelimits.take`` granted for real, then held until the handler's park is written."""
    STEP.clear()
    STEP["granted"] = threading.Event()
    real = ratelimits.take

    def take(community_id, rate_key, weight=1):
        outcome = real(community_id, rate_key, weight)
        if rate_key == "slow" and isinstance(outcome, ratelimits.Granted):
            STEP["granted"].set()
            deadline = time.monotonic() + WAIT
            while getattr(STEP.get("ctx"), "parked", None) is None:
                assert time.monotonic() < deadline, "the handler never parked"
                time.sleep(0.01)
        return outcome

    monkeypatch.setattr(ratelimits, "take", take)


def prepared(community):
    run_id = new_run(community.id)
    ratelimits.charge(community.id, "slow", 1)  # the window in use before the run: 1 of 5
    return run_id


def assert_parked_and_given_back(community, run_id) -> None:
    assert STEP.get("made") is None, STEP
    assert STEP.get("raised") == "_Parked", STEP
    run = AgentRun.objects.get(id=run_id)
    assert run.state == "waiting_approval", (run.state, run.failure_message)
    assert [e.kind for e in JournalEntry.objects.filter(run_id=run_id)] == ["approval"]
    assert used(community) == 1, "the 3 units of the call the park stopped were not given back"


def thread_handler(ctx):
    STEP["ctx"] = ctx

    def rated() -> None:
        try:
            ctx.call("rated", tool, {}, rate_key="slow", weight=3)
        except BaseException as exc:
            STEP["raised"] = type(exc).__name__
        finally:
            connections.close_all()

    caller = threading.Thread(target=rated, daemon=True)
    caller.start()
    try:
        assert STEP["granted"].wait(WAIT)
        return ctx.request_approval("ship?", 600)
    finally:
        caller.join(WAIT)


def test_the_thread_runtime_gives_back_the_units_of_a_call_the_park_stopped(community, held_take):
    with override_settings(BUZZ_DELIVERY=LIMITS):
        run_id = prepared(community)
        (claim,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
        out: list = []

        def handle() -> None:
            try:
                out.append(run_claim(claim, thread_handler))
            finally:
                connections.close_all()

        worker = threading.Thread(target=handle, daemon=True)
        worker.start()
        worker.join(WAIT * 2)
        assert not worker.is_alive() and out == ["parked"], (out, STEP)
        assert_parked_and_given_back(community, run_id)


async def async_handler(ctx):
    STEP["ctx"] = ctx

    async def rated() -> None:
        try:
            await ctx.call("rated", tool, {}, rate_key="slow", weight=3)
        except BaseException as exc:
            STEP["raised"] = type(exc).__name__

    caller = asyncio.ensure_future(rated())
    try:
        assert await waited(STEP["granted"])
        return await ctx.request_approval("ship?", 600)
    finally:
        await caller


def test_the_event_loop_runtime_gives_back_the_units_of_a_call_the_park_stopped(community, held_take):
    with override_settings(BUZZ_DELIVERY=LIMITS):
        run_id = prepared(community)
        counts = run_in_thread(community, async_handler)
        assert counts.get("parked") == 1, (counts, STEP)
        assert_parked_and_given_back(community, run_id)
