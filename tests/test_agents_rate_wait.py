"""The thread runtime: a call waiting for its rate limit (``ctx.call(..., rate_key=...)``) does not
hold the run's journal lock while it waits, and keeps the index it was called at.

Before, the wait was taken holding the journal lock (between taking the call's index and
journaling it): the run's other threads' calls and its approval waited behind it for as long as
the provider's window lasted (here a month: for ever). Now, as in the event-loop runtime, the
call takes its index when it is called, waits for its units with the lock let go, and is
journaled at that index once they are granted, so a resumed run replays each call of a scope
from its own entry (an index taken once the units were granted went to whichever call of the
scope came next: ``ReplayMismatch``).

Real threads of one handler on one Context, each on its own connection, the heartbeat renewing
the lease on its own; a call that does not get through within ``THROUGH`` seconds fails the test
(the handler then ends the run's wait itself, so the test never hangs)."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections
from django.test import override_settings

from buzz_delivery.agents.exceptions import RunAborted
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import Context, Heartbeat, run_claim
from buzz_delivery.agents.services import claim_agent_runs, reap_agent_runs
from buzz_delivery.models import RateLimit
from buzz_delivery.services import ratelimits
from tests.agents_support import AGENT, backdate_run_lease, make_claimable, new_run

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 20.0  # bound of the wait for the rated call to start waiting (or end)
THROUGH = 8.0  # how long a call (or an approval) made during the rated call's wait may take
PERIOD = 86_400 * 31  # one window: its unit spent before the run, it does not end meanwhile
SEEN: dict = {}


def tool(args: dict, key: str) -> str:
    SEEN.setdefault("made", []).append((SEEN["phase"], args["name"]))
    return args["name"]


def on_thread(target, *args) -> tuple[threading.Thread, list]:
    """``target(*args)`` on a thread of the handler (its own connection); its result or the
    exception it raised goes into the returned list."""
    out: list = []

    def body() -> None:
        try:
            out.append(target(*args))
        except BaseException as exc:
            out.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


def rated_waiting(ctx, call) -> tuple[threading.Thread, list]:
    """The rated call on a thread of its own, once it waits for its units (or has ended)."""
    thread, out = on_thread(call)
    deadline = time.monotonic() + WAIT
    while not ctx.rate_waits and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    SEEN.setdefault("rated_waited", []).append(ctx.rate_waits > 0)
    return thread, out


def through(ctx, call) -> object:
    """``call()`` on another thread within ``THROUGH`` seconds: its result; else the handler ends
    the rated call's wait itself (the run lost) and says so."""
    thread, out = on_thread(call)
    thread.join(THROUGH)
    if thread.is_alive():
        SEEN["stuck"] = True
        ctx.mark_lost("test_stuck")  # ends the rated call's wait: the test fails, never hangs
        thread.join(WAIT)
        raise RunAborted("a call was held back by the rated call's wait")
    (result,) = out
    if isinstance(result, BaseException):
        raise result
    return result


def with_heartbeat(claim, handler) -> str:
    ctx = Context(claim)
    beat = Heartbeat(every=0.2, lease_seconds=30)
    beat.hold(ctx)
    beat.start()
    try:
        return run_claim(claim, handler, ctx)
    finally:
        beat.stop.set()
        beat.join(WAIT)


def free_call_and_approval_while_a_rated_call_waits(ctx) -> str:
    def rated():
        with ctx.scope("rated"):
            return ctx.call("rated", tool, {"name": "rated"}, rate_key="slow")

    def free():
        with ctx.scope("free"):
            return ctx.call("free", tool, {"name": "free"})

    waiting, out = rated_waiting(ctx, rated)
    try:
        SEEN["free"] = through(ctx, free)  # another thread's call, no rate key
        SEEN["rated_still_waiting"] = waiting.is_alive() and not out
        return ctx.request_approval("ok?", 600)  # parks: the handler stops here
    finally:
        # The park released the lease: the heartbeat learns it and ends the rated call's wait.
        waiting.join(WAIT)
        SEEN["rated_ended"] = [type(o).__name__ for o in out]


def test_a_call_waiting_for_its_rate_limit_lets_the_runs_other_calls_and_its_approval_through(community):
    SEEN.clear()
    SEEN["phase"] = 1
    run_id = new_run(community.id)
    with override_settings(BUZZ_DELIVERY={"RATE_LIMITS": {"slow": {"limit": 1, "period": PERIOD}}}):
        ratelimits.charge(community.id, "slow", 1)  # the window's unit spent: the rated call waits
        (claim,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
        outcome = with_heartbeat(claim, free_call_and_approval_while_a_rated_call_waits)
    run = AgentRun.objects.get(id=run_id)
    assert not SEEN.get("stuck"), SEEN  # before: the free call waited for the rated one's window
    assert (outcome, run.state) == ("parked", "waiting_approval"), (outcome, run.state, run.failure_code, SEEN)
    assert SEEN["rated_waited"] == [True] and SEEN["rated_still_waiting"] is True, SEEN
    assert SEEN["free"] == "free" and SEEN["made"] == [(1, "free")], SEEN  # the rated tool never made
    assert SEEN["rated_ended"] == ["RunAborted"], SEEN  # its wait ended by the lost lease, nothing taken
    rows = JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    assert [(e.kind, e.replay_key, e.status) for e in rows] == [
        ("tool", ("free", 1), "succeeded"),
        ("approval", ("", 1), "pending"),
    ]
    assert RateLimit.objects.get(community_id=community.id, key="slow").used == 1


def rated_then_free_in_one_scope(ctx) -> dict:
    """The same program in both invocations: ``rated`` called first (on a thread), then ``free``
    once ``rated`` waits for its units or has ended. The first invocation is lost (the holder
    crashes) once ``free`` is recorded, ``rated`` still waiting."""
    waiting, out = rated_waiting(ctx, lambda: ctx.call("tool", tool, {"name": "rated"}, rate_key="slow"))
    free = through(ctx, lambda: ctx.call("tool", tool, {"name": "free"}))
    if SEEN["phase"] == 1:
        ctx.mark_lost("test_reclaim")  # the holder is lost, rated still waiting for its units
        waiting.join(WAIT)
        raise RunAborted("the run was lost")
    waiting.join(WAIT)
    (rated,) = out
    if isinstance(rated, BaseException):
        raise rated
    return {"rated": rated, "free": free}


def test_a_rated_call_waiting_in_a_scope_keeps_its_index_for_the_replay_after_a_reclaim(community):
    SEEN.clear()
    SEEN["phase"] = 1
    run_id = new_run(community.id)
    with override_settings(BUZZ_DELIVERY={"RATE_LIMITS": {"slow": {"limit": 1, "period": PERIOD}}}):
        ratelimits.charge(community.id, "slow", 1)  # the window's unit spent: the rated call waits
        (claim,) = claim_agent_runs(community.id, [AGENT], worker_id="w1", lease_seconds=30)
        assert with_heartbeat(claim, rated_then_free_in_one_scope) == "lost"
    assert not SEEN.get("stuck"), SEEN
    assert SEEN["rated_waited"] == [True] and SEEN["made"] == [(1, "free")], SEEN

    backdate_run_lease(run_id)  # time passing for the lost holder: reclaimed, claimable again
    assert reap_agent_runs().reclaimed == 1
    make_claimable(run_id)
    SEEN["phase"] = 2
    with override_settings(BUZZ_DELIVERY={"RATE_LIMITS": {"slow": {"limit": 100, "period": PERIOD}}}):
        (claim,) = claim_agent_runs(community.id, [AGENT], worker_id="w2", lease_seconds=30)
        assert with_heartbeat(claim, rated_then_free_in_one_scope) == "completed"
    run = AgentRun.objects.get(id=run_id)
    assert run.state == "completed", (run.state, run.failure_code, run.failure_message)
    assert run.output == {"rated": "rated", "free": "free"}, run.output
    assert SEEN["made"] == [(1, "free"), (2, "rated")], SEEN  # free replayed, never made twice
    rows = JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    entries = [(e.seq, e.replay_key, e.args["name"], e.status) for e in rows]
    assert entries == [(1, ("", 2), "free", "succeeded"), (2, ("", 1), "rated", "succeeded")], entries
