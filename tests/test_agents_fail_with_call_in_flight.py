"""A handler that raises while a call it started on another thread is still in flight.

The runtime failed the run at once: ``fail_run`` found the call pending, marked it failed and
uncertain and, the call carrying a compensation, unwound it, running the compensation while the
tool was still running on the other thread: the undo came first and undid nothing, the effect
came after it and stayed (the call's result then refused: the run had ended). The runtimes now
wait for the handler's calls in flight before they fail the run, so the compensation undoes an
effect that happened (found in review: the ledger read ``undo`` before ``call`` before the fix)."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections
from django.test import override_settings

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


CAP = 15.0  # the leftover thread stops calling by itself after this (a test that hangs is no test)


def _quick(args, key):
    return args


def test_a_thread_calling_again_and_again_does_not_keep_a_failing_run_from_ending(community):
    """A thread the handler left behind makes call after call (a poller): the failure waited for
    the calls in flight outside the journal lock, and each new call took the lock in the gap
    between that wait and the failure (the thread was running; the failing one had to wake):
    the run never failed while the thread called (its lease renewed meanwhile), and ended only
    once the thread stopped on its own (found in review). The calls are now waited for under the
    lock, a while at a time, as the event-loop runtime's ``quiet()``: the run fails, and the
    thread's next call is refused after it (nothing journaled)."""
    with override_settings(BUZZ_AGENTS={"MAX_TOOL_CALLS": 100_000}):  # the budget never ends the loop
        run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    stop = threading.Event()
    calling = threading.Event()
    seen: list = []
    made: list = []
    threads: list = []

    def poll(args, key):
        made.append(args["n"])
        calling.set()
        time.sleep(0.002)  # a tool that does something
        return args

    def handler(ctx):
        def caller():
            try:
                n = 0
                while not stop.is_set():
                    n += 1
                    ctx.call("poll", poll, {"n": n})
                seen.append("stopped by the test")
            except BaseException as exc:
                seen.append(type(exc).__name__)
            finally:
                connections.close_all()

        thread = threading.Thread(target=caller, daemon=True)
        threads.append(thread)
        thread.start()
        assert calling.wait(30)
        raise RuntimeError("the handler gives up")

    cap = threading.Timer(CAP, stop.set)
    cap.start()
    started = time.monotonic()
    try:
        outcome = run_claim(claimed, handler)
        took = time.monotonic() - started
    finally:
        stop.set()
        cap.cancel()
        threads[0].join(30)
    assert seen == ["RunAborted"], f"the thread was not refused after the failure ({took:.1f} s, {len(made)} calls)"
    assert took < CAP / 2, took
    run = AgentRun.objects.get(id=run_id)
    assert (outcome, run.state, run.failure_code) == ("failed", "failed", "handler_error")
    entries = list(JournalEntry.objects.filter(run_id=run_id).values_list("status", "uncertain"))
    assert entries == [("succeeded", False)] * len(made), entries  # each call made was recorded, none undone


def test_a_call_a_tool_in_flight_waits_for_on_another_thread_is_let_in_before_the_failure(community, ledger):
    """The failure waits for the calls in flight holding the journal lock; a call in flight whose
    tool starts a thread that calls, and waits for it, would wait for ever for that lock (the run
    hung, its lease renewed): the lock is let go between two rounds, the inner call is made, the
    outer one recorded, then the run fails and both are compensated, inner first."""
    from buzz_delivery.agents import runtime
    from buzz_delivery.inflight import InFlightCalls

    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    holding = threading.Event()  # the failure waits for the calls in flight, the journal lock held
    original = InFlightCalls.others_end_within

    def others_end_within(self, *args):
        holding.set()
        return original(self, *args)

    seen: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(InFlightCalls, "others_end_within", others_end_within)
        # The wait before the handler's end is judged (outside the lock) would wait for the outer
        # call, which waits for the failure's: the failure's own wait is the one under test.
        mp.setattr(runtime.Context, "_await_calls", lambda self: None)

        def handler(ctx):
            def outer_tool(args, key):
                STARTED.set()
                assert holding.wait(30)
                inner: list = []

                def inner_thread():
                    try:
                        with ctx.scope("inner"):
                            inner.append(ctx.call("inner", h.effect, {"n": 2}, compensate=h.undo))
                    except BaseException as exc:
                        inner.append(type(exc).__name__)
                    finally:
                        connections.close_all()

                thread = threading.Thread(target=inner_thread, daemon=True)
                thread.start()
                thread.join(CAP)
                assert inner == [{"n": 2}], inner
                return h.effect(args, key)

            def tool():
                try:
                    with ctx.scope("outer"):
                        seen.append(ctx.call("outer", outer_tool, {"n": 1}, compensate=h.undo))
                except BaseException as exc:
                    seen.append(type(exc).__name__)
                finally:
                    connections.close_all()

            threading.Thread(target=tool, daemon=True).start()
            assert STARTED.wait(30)
            raise RuntimeError("the handler gives up")

        started = time.monotonic()
        outcome = run_claim(claimed, handler)
        took = time.monotonic() - started
    assert seen == [{"n": 1}], seen
    assert took < CAP, took
    statuses = sorted(
        JournalEntry.objects.filter(run_id=run_id).values_list("status", "uncertain", "compensation_status")
    )
    assert statuses == [("succeeded", False, "compensated")] * 2, statuses
    assert [line.split()[0] for line in h.ledger_lines()] == ["call", "call", "undo", "undo"], h.ledger_lines()
    run = AgentRun.objects.get(id=run_id)
    assert (outcome, run.state, run.failure_code) == ("compensated", "failed", "handler_error")


RATE_PERIOD = 86_400 * 31  # one window for the whole test


def test_a_rated_call_a_leftover_thread_asks_after_the_failure_is_refused_and_gives_its_units_back(community, ledger):
    """A thread the handler left behind calls (with a rate limit) once the run's failure is
    written: refused with ``RunAborted`` (its tool never made, nothing journaled), and the units
    it took go back to their window."""
    from buzz_delivery.agents import services as s
    from buzz_delivery.models import RateLimit
    from buzz_delivery.services import ratelimits

    failed = threading.Event()
    original = s.fail_run

    def fail_run(*args, **kwargs):
        outcome = original(*args, **kwargs)
        failed.set()
        return outcome

    seen: list = []
    threads: list = []
    with (
        override_settings(BUZZ_DELIVERY={"RATE_LIMITS": {"slow": {"limit": 5, "period": RATE_PERIOD}}}),
        pytest.MonkeyPatch.context() as mp,
    ):
        mp.setattr(s, "fail_run", fail_run)
        run_id = new_run(community.id)
        ratelimits.charge(community.id, "slow", 1)  # the window in use before the run: 1 of 5
        (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)

        def handler(ctx):
            def late():
                try:
                    assert failed.wait(30)
                    seen.append(ctx.call("rated", h.effect, {"n": 1}, compensate=h.undo, rate_key="slow", weight=3))
                except BaseException as exc:
                    seen.append(type(exc).__name__)
                finally:
                    connections.close_all()

            threads.append(threading.Thread(target=late, daemon=True))
            threads[0].start()
            raise RuntimeError("the handler gives up")

        outcome = run_claim(claimed, handler)
        threads[0].join(30)
    assert seen == ["RunAborted"], seen
    assert h.ledger_lines() == []  # the tool was never made
    assert not JournalEntry.objects.filter(run_id=run_id).exists()
    assert RateLimit.objects.get(community_id=community.id, key="slow").used == 1
    run = AgentRun.objects.get(id=run_id)
    assert (outcome, run.state, run.failure_code) == ("failed", "failed", "handler_error")
