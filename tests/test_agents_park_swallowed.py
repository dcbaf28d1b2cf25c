"""A handler that catches the park around the call that parks its run (a bare ``except``, a
framework's tool wrapper catching ``BaseException``; ``except Exception`` did too while
``_Parked`` was an ``Exception``, a retry library retrying it): the park is written (the run ``waiting_approval``,
its lease released, a person asked), but ``_Parked`` never reaches the runtime.

Before, the runtime judged by the exception alone: the handler going on and returning (or
raising something else) had its completion or failure refused (the lease is released) and the
run was counted ``lost``, "left to its lease" though it holds none; a later ``ctx.call`` was
refused as a lost lease (``RunAborted``). Now the runtime judges by its own record that the run
parked: the turn ends ``parked`` whatever the handler does after, any later ``ctx.call`` /
``emit`` / ``request_approval`` raises ``_Parked`` again (nothing written), and the run resumes
on its approval exactly as if the park had reached the runtime. Both runtimes."""

from __future__ import annotations

import threading

import pytest

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import claim_agent_runs
from buzz_delivery.workflows.services import decide_approval
from tests.agents_support import AGENT, new_run
from tests.aio_worker_support import run_in_thread

pytestmark = pytest.mark.django_db(transaction=True)

MODES = ("returns", "raises", "calls", "emits")


def after_swallowing(mode: str, ctx, seen: list[str]):
    """What the handler does once it swallowed the park (sync form)."""
    if mode == "raises":
        raise ValueError("went on after the park")
    try:
        if mode == "calls":
            ctx.call("after", lambda args, key: {"n": args["n"]}, {"n": 1})
        elif mode == "emits":
            ctx.emit("after the park")
    except BaseException as exc:
        seen.append(type(exc).__name__)
    return {"went_on": True}


def sync_handler(mode: str, seen: list[str]):
    def handler(ctx):
        try:
            decision = ctx.request_approval("ship?", 600)
        except BaseException as exc:  # a wrapper that catches everything (a bare except)
            seen.append(type(exc).__name__)
            return after_swallowing(mode, ctx, seen)
        return {"decision": decision["decision"]}

    return handler


def async_handler(mode: str, seen: list[str]):
    async def handler(ctx):
        try:
            decision = await ctx.request_approval("ship?", 600)
        except BaseException as exc:
            seen.append(type(exc).__name__)
            if mode == "raises":
                raise ValueError("went on after the park") from None
            try:
                if mode == "calls":
                    await ctx.call("after", lambda args, key: {"n": args["n"]}, {"n": 1})
                elif mode == "emits":
                    await ctx.emit("after the park")
            except BaseException as later:
                seen.append(type(later).__name__)
            return {"went_on": True}
        return {"decision": decision["decision"]}

    return handler


def assert_parked_and_resumes(community, run_id, seen, mode, resume) -> None:
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == ("waiting_approval", None), (run.state, run.failure_message)
    entries = [(e.kind, e.status) for e in JournalEntry.objects.filter(run_id=run_id)]
    assert entries == [("approval", "pending")], entries  # nothing written after the park
    assert seen == ["_Parked"] + (["_Parked"] if mode in ("calls", "emits") else []), seen
    decide_approval(community.id, run.approval_id, "approved", "alice")
    resume()
    run.refresh_from_db()
    assert (run.state, run.output) == ("completed", {"decision": "approved"}), (run.state, run.failure_message)


@pytest.mark.parametrize("mode", MODES)
def test_thread_runtime_a_swallowed_park_ends_the_turn_parked(community, mode):
    run_id = new_run(community.id)
    seen: list[str] = []
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    done: list[str] = []
    runner = threading.Thread(target=lambda: done.append(run_claim(claimed, sync_handler(mode, seen))))
    runner.start()
    runner.join(30)
    assert done == ["parked"], done

    def resume():
        (again,) = claim_agent_runs(community.id, [AGENT], worker_id="w2", lease_seconds=30)
        assert run_claim(again, sync_handler(mode, [])) == "completed"

    assert_parked_and_resumes(community, run_id, seen, mode, resume)


@pytest.mark.parametrize("form", ("async", "sync"))
@pytest.mark.parametrize("mode", MODES)
def test_loop_runtime_a_swallowed_park_ends_the_turn_parked(community, mode, form):
    run_id = new_run(community.id)
    seen: list[str] = []
    make = async_handler if form == "async" else sync_handler
    counts = run_in_thread(community, make(mode, seen))
    assert (counts.get("parked"), counts.get("lost", 0), counts.get("failed", 0)) == (1, 0, 0), counts

    def resume():
        again = run_in_thread(community, make(mode, []))
        assert again.get("completed") == 1, again

    assert_parked_and_resumes(community, run_id, seen, mode, resume)


def test_a_retry_library_does_not_retry_a_park(community):
    """tenacity retries ``Exception`` by default (for ever, with its default ``stop``): a park that
    was one was asked again and again (each time refused) until its ``stop``. A park is a
    ``BaseException`` now, as ``asyncio.CancelledError`` is: passed through at once, not retried."""
    import tenacity

    run_id = new_run(community.id)
    attempts: list[int] = []

    def handler(ctx):
        @tenacity.retry(stop=tenacity.stop_after_attempt(5))
        def ask():
            attempts.append(1)
            return ctx.request_approval("ship?", 600)

        return {"decision": ask()["decision"]}

    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    assert run_claim(claimed, handler) == "parked"
    assert len(attempts) == 1, attempts
    run = AgentRun.objects.get(id=run_id)
    decide_approval(community.id, run.approval_id, "approved", "alice")
    (again,) = claim_agent_runs(community.id, [AGENT], worker_id="w2", lease_seconds=30)
    assert run_claim(again, handler) == "completed"
    run.refresh_from_db()
    assert run.output == {"decision": "approved"}
