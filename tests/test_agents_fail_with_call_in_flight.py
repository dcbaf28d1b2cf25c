"""A handler that raises while a call it started on another thread is still in flight.

The runtime failed the run at once: ``fail_run`` found the call pending, marked it failed and
uncertain and, the call carrying a compensation, unwound it, running the compensation while the
tool was still running on the other thread: the undo came first and undid nothing, the effect
came after it and stayed (the call's result then refused: the run had ended). The runtimes now
wait for the handler's calls in flight before they fail the run, so the compensation undoes an
effect that happened (found in review: the ledger read ``undo`` before ``call`` before the fix)."""

from __future__ import annotations

import threading

import pytest
from django.db import connections

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import claim_agent_runs
from tests import agent_handlers as h
from tests.agents_support import AGENT, new_run

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    path = tmp_path / "ledger.txt"
    monkeypatch.setenv("AGENT_LEDGER", str(path))
    return path


STARTED = threading.Event()  # the slow call's tool runs: it was journaled


def _slow_effect(args, key):
    STARTED.set()
    threading.Event().wait(0.5)  # in flight when the handler raises
    return h.effect(args, key)


@pytest.fixture(autouse=True)
def _not_started():
    STARTED.clear()


def test_a_failing_run_compensates_a_call_in_flight_only_after_it_happened(community, ledger):
    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    seen: list = []

    def handler(ctx):
        def tool():
            try:
                seen.append(ctx.call("slow", _slow_effect, {"n": 1}, compensate=h.undo))
            except BaseException as exc:
                seen.append(type(exc).__name__)
            finally:
                connections.close_all()

        threading.Thread(target=tool, daemon=True).start()
        assert STARTED.wait(30)  # the slow call is journaled and in flight
        raise RuntimeError("the handler gives up")

    outcome = run_claim(claimed, handler)
    threading.Event().wait(1.0)  # the slow call has ended either way
    key = f"{run_id}:1"
    assert h.ledger_lines() == [f"call {key}", f"undo {key}:compensate"]
    assert seen == [{"n": 1}]
    entry = JournalEntry.objects.get(run_id=run_id, seq=1)
    assert (entry.status, entry.uncertain, entry.compensation_status) == ("succeeded", False, "compensated")
    run = AgentRun.objects.get(id=run_id)
    assert (outcome, run.state, run.failure_code) == ("compensated", "failed", "handler_error")


def test_a_call_journaled_after_the_wait_for_the_calls_in_flight_is_waited_for_before_the_failure(
    community, ledger, monkeypatch
):
    """A thread the handler left behind journals its call just after the runtime found none in
    flight, and before it failed the run (in CI on a loaded cluster, the call of the test above
    came that late): the failure closed it uncertain and undid it while its tool still ran (the
    ledger read ``undo`` before ``call``). The failure is now written under the journal lock,
    once no call is in flight: the call is waited for, then compensated."""
    from buzz_delivery.agents import runtime

    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    awaited = threading.Event()
    seen: list = []
    original = runtime.Context._await_calls

    def await_calls(self):
        original(self)
        if not awaited.is_set():  # the first wait found nothing in flight: the call comes now
            awaited.set()
            assert STARTED.wait(30)

    monkeypatch.setattr(runtime.Context, "_await_calls", await_calls)

    def handler(ctx):
        def tool():
            try:
                assert awaited.wait(30)
                seen.append(ctx.call("slow", _slow_effect, {"n": 1}, compensate=h.undo))
            except BaseException as exc:
                seen.append(type(exc).__name__)
            finally:
                connections.close_all()

        threading.Thread(target=tool, daemon=True).start()
        raise RuntimeError("the handler gives up")

    outcome = run_claim(claimed, handler)
    key = f"{run_id}:1"
    assert h.ledger_lines() == [f"call {key}", f"undo {key}:compensate"]
    assert seen == [{"n": 1}]
    entry = JournalEntry.objects.get(run_id=run_id, seq=1)
    assert (entry.status, entry.uncertain, entry.compensation_status) == ("succeeded", False, "compensated")
    run = AgentRun.objects.get(id=run_id)
    assert (outcome, run.state, run.failure_code) == ("compensated", "failed", "handler_error")
