"""The event-loop runtime: a rated call whose journal write is answered without a call to make
(here shadow-blocked: a shadow run's destructive call) gives its units back; its task cancelled
by the handler's own code (``task.cancel()``, a sibling failing in a ``TaskGroup``, a
``wait_for``) while that give-back statement runs, the call still lands.

Before, the give-back was awaited after the call had been counted in flight and before the
block that lands it: the cancel there left it in flight for ever, so the run's end (which waits,
under the journal lock, for none of its calls in flight) never came. The run hung until its
handler deadline and was then left to its lease (``lost``), the handler's output never recorded.

A real transaction of another session holds the run's row until the call's journal write waits
for it, and then the rate-limit row, so the give-back waits for that one as the task is cancelled."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from django.db import connection
from django.test import override_settings

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.models import RateLimit
from buzz_delivery.services import ratelimits
from tests.agents_support import new_run
from tests.aio_worker_support import run_in_thread, waited
from tests.citus_support import CITUS_MODE
from tests.tenant_locks import rows_held

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 20.0
PERIOD = 86_400 * 31  # one window for the whole test
LIMITS = {"RATE_LIMITS": {"slow": {"limit": 5, "period": PERIOD}}}
STEP: dict = {}


def tool(args: dict, key: str) -> str:
    STEP["made"] = True
    return "made"


async def cancels_its_rated_call_as_it_gives_back(ctx):
    STEP["claimed"].set()
    assert await waited(STEP["run_held"])
    task = asyncio.create_task(ctx.call("rated", tool, {}, rate_key="slow", weight=3, destructive=True))
    assert await waited(STEP["give_back_sent"])
    task.cancel()
    STEP["cancel_sent"].set()
    try:
        STEP["returned"] = await task
    except asyncio.CancelledError:
        STEP["returned"] = "cancelled"
    STEP["in_flight"] = ctx.calls_in_flight
    return "done"


def waiting_for_a_lock(*patterns: str) -> int:
    view = "citus_stat_activity" if CITUS_MODE else "pg_stat_activity"
    where = " OR ".join("query LIKE %s" for _ in patterns)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {view} WHERE wait_event_type = 'Lock' AND ({where})", list(patterns))
        return cursor.fetchone()[0]


def until(test, message: str) -> None:
    deadline = time.monotonic() + WAIT
    while not test():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


def test_a_rated_call_cancelled_as_it_gives_back_its_units_lands_and_the_run_ends(community):
    STEP.clear()
    STEP.update({name: threading.Event() for name in ("claimed", "run_held", "give_back_sent", "cancel_sent")})
    with override_settings(BUZZ_DELIVERY=LIMITS):
        run_id = new_run(community.id, shadow=True)
        ratelimits.charge(community.id, "slow", 1)  # the window in use before the run: 1 of 5
        window = RateLimit.objects.get(community_id=community.id, key="slow")

        def hold_the_rows():
            assert STEP["claimed"].wait(WAIT)
            with rows_held(AgentRun, community.id, run_id) as release_run:
                STEP["run_held"].set()  # the take goes through (its row is free), the write waits
                until(
                    lambda: waiting_for_a_lock("%%tool_calls_used%%", "%%''{rated}''::text[]%%"),
                    "the journal write never waited for the held run",
                )
                with rows_held(RateLimit, community.id, window.id):
                    release_run()  # journaled shadow-blocked: the give-back waits for the rate row
                    until(
                        lambda: waiting_for_a_lock("%%UPDATE %%buzz_delivery_rate_limit%%"),
                        "the give-back never waited for the held rate-limit row",
                    )
                    STEP["give_back_sent"].set()
                    assert STEP["cancel_sent"].wait(WAIT)
                    time.sleep(0.3)  # the cancel lands in the call's task as the give-back waits

        # The deadline bounds the whole handler, the lock waits it is shown through included (Citus
        # statements are slow on a loaded CI): 30 s, still well within the worker's bound, so a
        # call left in flight for ever still ends the run lost at it.
        counts = run_in_thread(
            community, cancels_its_rated_call_as_it_gives_back, meanwhile=hold_the_rows, handler_timeout=30
        )
        run = AgentRun.objects.get(id=run_id)
        assert STEP["returned"] == "cancelled" and "made" not in STEP, STEP
        assert STEP["in_flight"] == (), f"the cancelled call was left in flight: {STEP['in_flight']}"
        assert (run.state, counts.get("completed")) == ("completed", 1), (counts, run.state, run.failure_code)
        entry = JournalEntry.objects.get(run_id=run_id)
        assert entry.status == "failed" and entry.blocked_reason, (entry.status, entry.blocked_reason)
        assert RateLimit.objects.get(id=window.id).used == 1, "the units of the blocked call were not given back"


async def cancels_its_rated_call_as_it_takes(ctx):
    STEP["claimed"].set()
    assert await waited(STEP["rate_held"])
    task = asyncio.create_task(ctx.call("rated", tool, {}, rate_key="slow", weight=3))
    assert await waited(STEP["take_sent"])
    task.cancel()
    STEP["cancel_sent"].set()
    try:
        STEP["returned"] = await task
    except asyncio.CancelledError:
        STEP["returned"] = "cancelled"
    STEP["in_flight"] = ctx.calls_in_flight
    return "done"


def test_a_rated_call_cancelled_as_its_take_runs_gives_its_units_back(community):
    """The take is one statement on a pool thread: cancelling its awaiter does not stop it, and
    it commits. Before, the units it took stayed spent (the call ended ``CancelledError``, never
    made, its units never given back); now its outcome is awaited through the cancel and, granted,
    given back before the cancel goes on."""
    STEP.clear()
    STEP.update({name: threading.Event() for name in ("claimed", "rate_held", "take_sent", "cancel_sent")})
    with override_settings(BUZZ_DELIVERY=LIMITS):
        run_id = new_run(community.id)
        ratelimits.charge(community.id, "slow", 1)  # the window in use before the run: 1 of 5
        window = RateLimit.objects.get(community_id=community.id, key="slow")

        def hold_the_rate_row():
            assert STEP["claimed"].wait(WAIT)
            with rows_held(RateLimit, community.id, window.id):
                STEP["rate_held"].set()
                until(
                    lambda: waiting_for_a_lock("%%INSERT INTO %%buzz_delivery_rate_limit%%"),
                    "the take never waited for the held rate-limit row",
                )
                STEP["take_sent"].set()
                assert STEP["cancel_sent"].wait(WAIT)
                time.sleep(0.3)  # the cancel lands in the call's task as its take waits

        counts = run_in_thread(community, cancels_its_rated_call_as_it_takes, meanwhile=hold_the_rate_row)
        run = AgentRun.objects.get(id=run_id)
        assert STEP["returned"] == "cancelled" and "made" not in STEP, STEP
        assert (run.state, counts.get("completed")) == ("completed", 1), (counts, run.state, run.failure_code)
        assert not JournalEntry.objects.filter(run_id=run_id).exists()
        assert RateLimit.objects.get(id=window.id).used == 1, "the units of the cancelled call's take stayed spent"
