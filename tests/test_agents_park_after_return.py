"""The thread runtime: a thread the handler left behind parks the run after the handler ended
(returned, or raised), as the runtime ends the turn.

The turn's end was judged by ``ctx.parked`` only right after the handler; the park written after
that reached the runtime's own end: its completion (or failure) was refused, the run parked
counted ``lost`` ("left to its lease" though it held none). And once ``ctx._check`` raised
``_Parked`` for a parked run, the runtime's own wait for the leftover thread's calls
(``_await_calls``, ``except RunAborted`` only) let ``_Parked`` out of ``run_claim``: into the
worker's loop (``worker_error``, the whole worker stopped by one run's thread). Now the end is
judged by the park's record there too: ``parked``.

The leftover thread parks while the runtime's completion (failure) is held back (the real
statement, sent once the park is written; the failure before it takes the journal lock), so the
park lands first every time."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections

from buzz_delivery.agents import runtime
from buzz_delivery.agents import services as s
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import claim_agent_runs
from buzz_delivery.workflows.services import decide_approval
from tests.agents_support import AGENT, new_run

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 20.0
STEP: dict = {}


@pytest.fixture
def held_end(monkeypatch):
    """``complete_run`` / ``fail_run`` of the turn sent once the leftover thread parked."""
    STEP.clear()
    STEP["ending"] = threading.Event()

    def held(real):
        def end(lease, *args, **kwargs):
            STEP["ending"].set()
            deadline = time.monotonic() + WAIT
            while getattr(STEP.get("ctx"), "parked", None) is None:
                assert time.monotonic() < deadline, "the leftover thread never parked"
                time.sleep(0.01)
            return real(lease, *args, **kwargs)

        return end

    monkeypatch.setattr(s, "complete_run", held(s.complete_run))
    # The failure is written under the journal lock a park takes (a call journaled as it is
    # written was undone before it happened): held before it takes that lock.
    monkeypatch.setattr(runtime.Context, "_fail_when_quiet", held(runtime.Context._fail_when_quiet))


def handler_leaving_a_thread(ends: str):
    def handler(ctx):
        STEP["ctx"] = ctx

        def leftover() -> None:
            try:
                assert STEP["ending"].wait(WAIT)
                ctx.request_approval("ship?", 600)
            except BaseException as exc:
                STEP["raised"] = type(exc).__name__
            finally:
                connections.close_all()

        if "decision" not in STEP:
            STEP["thread"] = threading.Thread(target=leftover, daemon=True)
            STEP["thread"].start()
        if ends == "raises":
            raise ValueError("ended before its thread")
        return {"went_on": True}

    return handler


@pytest.mark.parametrize("ends", ["returns", "raises"])
def test_a_park_of_a_thread_the_handler_left_ends_the_turn_parked(community, held_end, ends):
    run_id = new_run(community.id)
    (claim,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    out: list = []

    def turn() -> None:
        try:
            out.append(run_claim(claim, handler_leaving_a_thread(ends)))
        except BaseException as exc:
            out.append(f"escaped {type(exc).__name__}")
        finally:
            connections.close_all()

    runner = threading.Thread(target=turn, daemon=True)
    runner.start()
    runner.join(WAIT * 2)
    STEP["thread"].join(WAIT)
    assert out == ["parked"], (out, STEP)
    assert STEP.get("raised") == "_Parked", STEP
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == ("waiting_approval", None), (run.state, run.failure_message)
    decide_approval(community.id, run.approval_id, "approved", "alice")
