"""The event-loop runtime under ``asyncio.timeout()`` in the handler: a runtime statement whose
awaiter is cancelled by the timeout as it runs (awaited through the cancel, its outcome acted on:
``AsyncContext._outlasting``) lets the cancel go on as the ``CancelledError`` the timeout sent,
so the timeout turns it into ``TimeoutError`` and the task's cancel count is back to 0
(``asyncio.timeout`` and ``TaskGroup`` judge their cancels by ``Task.uncancel()``).

A rated call whose units go back on a cancel's way out (its take granted as the timeout
cancelled it, its journal write closed 'not made', or the call cancelled waiting for the journal
lock): the operator lowered the key's limit in the settings since the take, so the give-back is
refused (``ValidationError`` naming ``units``). Before, that ``ValidationError`` replaced the
pending ``CancelledError``: the timeout never fired as ``TimeoutError`` (the handler saw a
``ValidationError`` from a call it had given up on), a cancel lost. Now the refusal logs
(``rate_give_back_refused``), the units stay spent, and the cancel goes on.

The emit's and the park's tests keep what the one mechanism did for each already (an emit's
cancel goes on, its chunk counted, one ``CancelledError`` for two cancels; a park written
supersedes the timeout's cancel, its count back to 0); the rated calls' tests each fail with
their fix reverted.

Real transactions of another session hold the rows the statements wait for; the timeout is
made to expire (``reschedule``) once the statement waits, and the row let go once the handler's
task is seen cancelling."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import read_output
from buzz_delivery.models import RateLimit
from buzz_delivery.services import ratelimits
from tests.agents_support import new_run
from tests.aio_worker_support import run_in_thread, waited
from tests.citus_support import CITUS_MODE
from tests.tenant_locks import rows_held
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


async def sent(ctx: Any) -> None:
    assert await waited(STEP["sent"])  # the statement waits for a held row


def handler_under_a_timeout(
    what: Callable[[Any], Awaitable[Any]],
    after: Callable[[Any], Awaitable[Any]] | None = None,
    ready: Callable[[Any], Awaitable[None]] = sent,
    cancels: int = 1,
):
    """A handler that awaits ``what(ctx)`` inside ``asyncio.timeout()``, the timeout expiring
    once ``ready(ctx)`` returned (by default: the test saw its statement wait, ``STEP['sent']``);
    what the handler saw is kept in ``STEP`` (``raised``, ``cancelling``: its task's cancel
    count after the block). ``cancels``: how many cancels it gets (the timeout's, then more of
    ``Task.cancel()``)."""

    async def handler(ctx):
        me = asyncio.current_task()
        loop = asyncio.get_running_loop()
        assert me is not None

        async def expire(timeout: asyncio.Timeout) -> None:
            await ready(ctx)
            timeout.reschedule(loop.time())  # expires now: the timeout cancels the handler's task
            while not (me.cancelling() or "raised" in STEP):  # cancelling, or cancelled already
                await asyncio.sleep(0.01)
            for _ in range(cancels - 1):
                me.cancel()  # another cancel, as the statement still runs
                await asyncio.sleep(0.01)
            STEP["cancelled"].set()

        STEP["claimed"].set()
        assert await waited(STEP["held"])
        expiring = None
        try:
            async with asyncio.timeout(None) as timeout:
                expiring = asyncio.create_task(expire(timeout))
                STEP["returned"] = await what(ctx)
            STEP["raised"] = None
        except TimeoutError:
            STEP["raised"] = "TimeoutError"
        except asyncio.CancelledError:
            STEP["raised"] = "CancelledError"  # the timeout did not recognise its cancel
        except Exception as exc:
            STEP["raised"] = f"{type(exc).__name__}: {exc}"
        if expiring is not None:
            await expiring
        STEP["cancelling"] = me.cancelling()
        while me.uncancel():  # the cancels the handler has taken care of
            pass
        STEP["in_flight"] = ctx.calls_in_flight
        if after is not None:
            STEP["after"] = await after(ctx)
        return "done"

    return handler


def waiting_for_a_lock(pattern: str) -> int:
    view = "citus_stat_activity" if CITUS_MODE else "pg_stat_activity"
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {view} WHERE wait_event_type = 'Lock' AND query LIKE %s", [pattern])
        return cursor.fetchone()[0]


def until(test: Callable[[], Any], message: str) -> None:
    deadline = time.monotonic() + WAIT
    while not test():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


def fresh_steps() -> None:
    STEP.clear()
    STEP.update({name: threading.Event() for name in ("claimed", "held", "sent", "cancelled")})


def cancelled_as_it_waits(waits: Callable[[], Any], lowered: Any = None) -> None:
    """Once the statement waits for the held row: the timeout expires; once the handler's task is
    cancelling, the key's limit lowered (``lowered.enable()``, when given); then the row let go
    (leaving the caller's ``rows_held`` block)."""
    until(waits, "the statement never waited for the held row")
    STEP["sent"].set()
    assert STEP["cancelled"].wait(WAIT), "the timeout never cancelled the handler's task"
    if lowered is not None:
        lowered.enable()
        STEP["lowered"] = True


def test_an_emit_timed_out_as_it_is_written_raises_timeout_error_and_counts_its_chunk(community):
    fresh_steps()
    run_id = new_run(community.id)

    def hold_the_run():
        assert STEP["claimed"].wait(WAIT)
        with rows_held(AgentRun, community.id, run_id):
            STEP["held"].set()
            cancelled_as_it_waits(lambda: waiting_for_a_lock("%%INSERT INTO %%buzz_agents_output%%"))

    handler = handler_under_a_timeout(lambda ctx: ctx.emit("first"), after=lambda ctx: ctx.emit("second"))
    counts = run_in_thread(community, handler, meanwhile=hold_the_run)
    assert (STEP["raised"], STEP["cancelling"]) == ("TimeoutError", 0), STEP
    assert STEP["after"] == 2, STEP  # the first chunk, written through the cancel, was counted
    assert counts.get("completed") == 1, counts
    page = read_output(community.id, run_id)
    assert [(c.seq, c.chunk) for c in page.chunks] == [(1, "first"), (2, "second")], page


def test_an_emit_cancelled_twice_as_it_is_written_raises_one_cancelled_error_and_counts_its_chunk(community):
    """The timeout's cancel, then another (``Task.cancel()``) as the statement still runs: one
    ``CancelledError`` goes on (the timeout sees a cancel not its own: no ``TimeoutError``), the
    task's count at 1, the chunk counted."""
    fresh_steps()
    run_id = new_run(community.id)

    def hold_the_run():
        assert STEP["claimed"].wait(WAIT)
        with rows_held(AgentRun, community.id, run_id):
            STEP["held"].set()
            cancelled_as_it_waits(lambda: waiting_for_a_lock("%%INSERT INTO %%buzz_agents_output%%"))

    handler = handler_under_a_timeout(lambda ctx: ctx.emit("first"), after=lambda ctx: ctx.emit("second"), cancels=2)
    counts = run_in_thread(community, handler, meanwhile=hold_the_run)
    assert (STEP["raised"], STEP["cancelling"]) == ("CancelledError", 1), STEP
    assert STEP["after"] == 2, STEP
    assert counts.get("completed") == 1, counts
    page = read_output(community.id, run_id)
    assert [(c.seq, c.chunk) for c in page.chunks] == [(1, "first"), (2, "second")], page


def test_a_rated_call_timed_out_as_it_takes_raises_timeout_error_when_its_give_back_is_refused(community):
    fresh_steps()
    lowered = override_settings(BUZZ_DELIVERY=LOWERED)
    with override_settings(BUZZ_DELIVERY=LIMITS):
        run_id = new_run(community.id)
        ratelimits.charge(community.id, "slow", 1)  # the window in use before the run: 1 of 5
        window = RateLimit.objects.get(community_id=community.id, key="slow")

        def hold_the_rate_row():
            assert STEP["claimed"].wait(WAIT)
            with rows_held(RateLimit, community.id, window.id):
                STEP["held"].set()
                cancelled_as_it_waits(lambda: waiting_for_a_lock("%%INSERT INTO %%buzz_delivery_rate_limit%%"), lowered)

        handler = handler_under_a_timeout(lambda ctx: ctx.call("rated", tool, {}, rate_key="slow", weight=3))
        try:
            counts = run_in_thread(community, handler, meanwhile=hold_the_rate_row)
        finally:
            if STEP.get("lowered"):
                lowered.disable()
        assert (STEP["raised"], STEP["cancelling"]) == ("TimeoutError", 0), STEP
        assert "made" not in STEP and STEP["in_flight"] == (), STEP
        assert counts.get("completed") == 1, counts
        assert AgentRun.objects.get(id=run_id).state == "completed"
        assert not JournalEntry.objects.filter(run_id=run_id).exists()
        assert RateLimit.objects.get(id=window.id).used == 4  # the give-back refused: the units stay spent


def test_a_rated_call_timed_out_as_it_is_journaled_raises_timeout_error_when_its_give_back_is_refused(community):
    """Its write out (shadow-blocked: a shadow run's destructive call) as the timeout cancels
    it: written all the same, the call closed, its units given back (refused), then the cancel."""
    fresh_steps()
    lowered = override_settings(BUZZ_DELIVERY=LOWERED)
    with override_settings(BUZZ_DELIVERY=LIMITS):
        run_id = new_run(community.id, shadow=True)

        def hold_the_run():
            assert STEP["claimed"].wait(WAIT)
            with rows_held(AgentRun, community.id, run_id):
                STEP["held"].set()  # the take goes through (its row is free), the write waits
                cancelled_as_it_waits(journal_writes_waiting_for_a_lock, lowered)

        handler = handler_under_a_timeout(
            lambda ctx: ctx.call("rated", tool, {}, rate_key="slow", weight=3, destructive=True)
        )
        try:
            counts = run_in_thread(community, handler, meanwhile=hold_the_run)
        finally:
            if STEP.get("lowered"):
                lowered.disable()
        assert (STEP["raised"], STEP["cancelling"]) == ("TimeoutError", 0), STEP
        assert "made" not in STEP and STEP["in_flight"] == (), STEP
        assert counts.get("completed") == 1, counts
        assert AgentRun.objects.get(id=run_id).state == "completed"
        (entry,) = JournalEntry.objects.filter(run_id=run_id)
        assert (entry.status, bool(entry.blocked_reason)) == ("failed", True)


def test_a_rated_call_timed_out_waiting_for_the_journal_lock_raises_timeout_error_when_its_give_back_is_refused(
    community,
):
    """Its units taken, it waits for the run's journal lock (taken by another task of the
    handler, ``ctx.quiet()``, as its take waited for the held rate-limit row); the key's limit
    lowered, the timeout cancels it: nothing journaled, its units given back (refused), then the
    cancel."""
    fresh_steps()
    STEP["lock_held"] = threading.Event()
    lowered = override_settings(BUZZ_DELIVERY=LOWERED)
    release = asyncio.Event()

    async def hold(ctx) -> None:
        async with ctx.quiet():
            STEP["lock_held"].set()
            await release.wait()

    async def the_call_waits_for_the_lock(ctx) -> None:
        assert await waited(STEP["sent"])  # its take waits for the held rate-limit row
        STEP["holder"] = asyncio.create_task(hold(ctx))
        # CPython's asyncio.Lock keeps its waiters in _waiters: the rated call, its take done
        deadline = time.monotonic() + WAIT
        while not ctx._journaling._waiters:
            assert time.monotonic() < deadline, "the rated call never waited for the journal lock"
            await asyncio.sleep(0.01)
        lowered.enable()
        STEP["lowered"] = True

    async def let_go(ctx) -> None:
        release.set()
        await STEP["holder"]

    with override_settings(BUZZ_DELIVERY=LIMITS):
        run_id = new_run(community.id)
        ratelimits.charge(community.id, "slow", 1)  # the window in use before the run: 1 of 5
        window = RateLimit.objects.get(community_id=community.id, key="slow")

        def hold_the_rate_row():
            assert STEP["claimed"].wait(WAIT)
            with rows_held(RateLimit, community.id, window.id):
                STEP["held"].set()
                until(
                    lambda: waiting_for_a_lock("%%INSERT INTO %%buzz_delivery_rate_limit%%"),
                    "the take never waited for the held rate-limit row",
                )
                STEP["sent"].set()
                assert STEP["lock_held"].wait(WAIT), "the journal lock was never taken"

        handler = handler_under_a_timeout(
            lambda ctx: ctx.call("rated", tool, {}, rate_key="slow", weight=3),
            after=let_go,
            ready=the_call_waits_for_the_lock,
        )
        try:
            counts = run_in_thread(community, handler, meanwhile=hold_the_rate_row)
        finally:
            if STEP.get("lowered"):
                lowered.disable()
        assert (STEP["raised"], STEP["cancelling"]) == ("TimeoutError", 0), STEP
        assert "made" not in STEP and STEP["in_flight"] == (), STEP
        assert counts.get("completed") == 1, counts
        assert AgentRun.objects.get(id=run_id).state == "completed"
        assert not JournalEntry.objects.filter(run_id=run_id).exists()
        assert RateLimit.objects.get(id=window.id).used == 4  # the give-back refused: the units stay spent


def test_a_rated_call_timed_out_before_its_take_ran_raises_timeout_error_when_the_take_is_refused(community):
    """Its take queued for the worker's one pool connection (busy: an emit of the handler waits
    for the held run row) as the timeout cancels it; the key's limit then lowered under its
    units, the take refuses them when it runs (``ValidationError`` naming ``weight``, nothing
    taken). Before, that error replaced the pending cancel; now the cancel goes on."""
    fresh_steps()
    lowered = override_settings(BUZZ_DELIVERY=LOWERED)

    async def emits_then_calls(ctx):
        STEP["emitting"] = asyncio.create_task(ctx.emit("first"))
        assert await waited(STEP["sent"])  # the emit, waiting for the held row, holds the pool's one connection
        STEP["calling"] = True  # from here to its take's statement queued, nothing awaits
        return await ctx.call("rated", tool, {}, rate_key="slow", weight=3)

    async def the_take_is_queued(ctx) -> None:
        while not STEP.get("calling"):  # seen here: the handler's task awaits its take
            await asyncio.sleep(0.01)

    async def the_emit_ends(ctx):
        return await STEP["emitting"]

    with override_settings(BUZZ_DELIVERY=LIMITS):
        run_id = new_run(community.id)

        def hold_the_run():
            assert STEP["claimed"].wait(WAIT)
            with rows_held(AgentRun, community.id, run_id):
                STEP["held"].set()
                cancelled_as_it_waits(lambda: waiting_for_a_lock("%%INSERT INTO %%buzz_agents_output%%"), lowered)

        handler = handler_under_a_timeout(emits_then_calls, after=the_emit_ends, ready=the_take_is_queued)
        try:
            counts = run_in_thread(community, handler, meanwhile=hold_the_run, connections=1)
        finally:
            if STEP.get("lowered"):
                lowered.disable()
        assert (STEP["raised"], STEP["cancelling"]) == ("TimeoutError", 0), STEP
        assert "made" not in STEP and STEP["in_flight"] == () and STEP["after"] == 1, STEP
        assert counts.get("completed") == 1, counts
        assert AgentRun.objects.get(id=run_id).state == "completed"
        assert not JournalEntry.objects.filter(run_id=run_id).exists()
        assert not RateLimit.objects.filter(community_id=community.id, key="slow").exists()  # nothing taken


async def parks_under_a_timeout(ctx):
    me = asyncio.current_task()
    loop = asyncio.get_running_loop()
    assert me is not None

    async def expire(timeout: asyncio.Timeout) -> None:
        assert await waited(STEP["sent"])  # the park waits for the held run row
        timeout.reschedule(loop.time())
        while not (me.cancelling() or "raised" in STEP):
            await asyncio.sleep(0.01)
        STEP["cancelled"].set()

    STEP["claimed"].set()
    assert await waited(STEP["held"])
    try:
        async with asyncio.timeout(None) as timeout:
            expiring = asyncio.create_task(expire(timeout))
            await ctx.request_approval("ok?")
    except BaseException as exc:  # the park (the runtime's own _Parked), not the timeout
        STEP["raised"] = type(exc).__name__
        STEP["cancelling"] = me.cancelling()
        await expiring
        raise
    return "never"


def test_a_park_timed_out_as_it_is_written_parks_the_run(community):
    fresh_steps()
    run_id = new_run(community.id)

    def hold_the_run():
        assert STEP["claimed"].wait(WAIT)
        with rows_held(AgentRun, community.id, run_id):
            STEP["held"].set()
            cancelled_as_it_waits(lambda: waiting_for_a_lock("%%waiting_approval%%"))

    counts = run_in_thread(community, parks_under_a_timeout, meanwhile=hold_the_run)
    assert (STEP["raised"], STEP["cancelling"]) == ("_Parked", 0), STEP  # the park supersedes the timeout's cancel
    assert AgentRun.objects.get(id=run_id).state == "waiting_approval"
    assert (counts.get("parked"), counts.get("lost", 0), counts.get("failed", 0)) == (1, 0, 0), counts
    assert [e.kind for e in JournalEntry.objects.filter(run_id=run_id)] == ["approval"]
