"""Both agent runtimes: the rate units a call took are given back when its journal write is then
refused (here its lease lapsed while the write waited for the run's row), so a call that never
ran spends nothing of the provider's window, as the delivery worker gives back a claim's units it
did not use (docs/flow-control.md).

Before, the units stayed spent: the window granted fewer calls than its limit for every call
refused after its take (a run cancelled, parked or lost as its rated call was journaled).

A real transaction of another session holds the run's row (``FOR UPDATE``) once the call's take
was granted, so its journal statement waits for the lock; the holder then ends the run's lease
(its ``lease_until`` in the past, as time passing would) and commits: the write is refused
``LeaseLost``, nothing journaled, and the window is back at what it was before the call."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.db import connection, connections
from django.test import override_settings

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import claim_agent_runs
from buzz_delivery.models import RateLimit
from buzz_delivery.services import ratelimits
from project.database_url import database_url
from tests.agents_support import AGENT, new_run
from tests.aio_worker_support import run_in_thread, waited
from tests.citus_support import CITUS_MODE

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 20.0
PERIOD = 86_400 * 31  # one window for the whole test
LIMITS = {"RATE_LIMITS": {"slow": {"limit": 5, "period": PERIOD}}}
STEP: dict = {}


def tool(args: dict, key: str) -> str:
    STEP["made"] = True
    return "made"


def journal_writes_waiting_for_a_lock() -> int:
    """The journal writes waiting for a lock: the single form spends the call on the run's row
    first; the batched one's text (cut at ``track_activity_query_size``) names the call's tool."""
    view = "citus_stat_activity" if CITUS_MODE else "pg_stat_activity"
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT count(*) FROM {view} WHERE wait_event_type = 'Lock'"
            " AND (query LIKE '%%tool_calls_used%%' OR query LIKE '%%''{rated}''::text[]%%')"
        )
        return cursor.fetchone()[0]


def end_the_lease_as_the_write_waits(community_id, run_id) -> None:
    """Hold the run's row once the handler runs (its take, on the rate-limit row, is not held);
    once its journal write waits for it, lapse the lease in the same transaction and commit."""
    assert STEP["taken"].wait(WAIT)
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
        holder.execute(
            "UPDATE buzz_agents_run SET lease_until = now() - interval '1 hour' WHERE community_id = %s AND id = %s",
            [community_id, run_id],
        )
        holder.commit()
    finally:
        holder.close()


def used(community) -> int:
    return RateLimit.objects.get(community_id=community.id, key="slow").used


def prepared(community):
    STEP.clear()
    STEP.update({name: threading.Event() for name in ("taken", "held")})
    run_id = new_run(community.id)
    ratelimits.charge(community.id, "slow", 1)  # the window in use before the run: 1 of 5
    return run_id


def thread_handler(ctx):
    STEP["taken"].set()
    assert STEP["held"].wait(WAIT)  # the run's row held: the take goes through, the write waits
    try:
        return ctx.call("rated", tool, {}, rate_key="slow", weight=3)
    except BaseException as exc:
        STEP["raised"] = type(exc).__name__
        raise


def test_the_thread_runtime_gives_back_the_units_of_a_call_whose_journal_write_was_refused(community):
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
        try:
            end_the_lease_as_the_write_waits(community.id, run_id)
        finally:
            worker.join(WAIT)
        assert not worker.is_alive() and out == ["lost"], (out, STEP)
        assert (STEP.get("raised"), STEP.get("made")) == ("RunAborted", None), STEP
        assert not JournalEntry.objects.filter(run_id=run_id).exists()
        assert AgentRun.objects.get(id=run_id).state == "running"  # left to its (lapsed) lease
        assert used(community) == 1, "the 3 units of the call never made were not given back"


async def async_handler(ctx):
    STEP["taken"].set()
    assert await waited(STEP["held"])  # the run's row held: the take goes through, the write waits
    try:
        return await ctx.call("rated", tool, {}, rate_key="slow", weight=3)
    except BaseException as exc:
        STEP["raised"] = type(exc).__name__
        raise


def test_the_event_loop_runtime_gives_back_the_units_of_a_call_whose_journal_write_was_refused(community):
    with override_settings(BUZZ_DELIVERY=LIMITS):
        run_id = prepared(community)
        counts = run_in_thread(
            community, async_handler, meanwhile=lambda: end_the_lease_as_the_write_waits(community.id, run_id)
        )
        assert counts.get("lost") == 1, counts
        assert (STEP.get("raised"), STEP.get("made")) == ("RunAborted", None), STEP
        assert not JournalEntry.objects.filter(run_id=run_id).exists()
        assert used(community) == 1, "the 3 units of the call never made were not given back"
