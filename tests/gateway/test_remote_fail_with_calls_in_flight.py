"""The remote runtime's failure and approval while a thread the handler started keeps calling,
over HTTP against a live gateway (as tests/test_agents_fail_with_call_in_flight.py and
tests/test_agents_approval_calls_in_flight.py for the thread runtime).

On a handler error the remote runtime waited for the calls in flight outside the journal lock
(``_await_calls``), then failed the run: a call a leftover thread journaled between that wait and
the failure was closed uncertain and its compensation run while its tool still ran (the undo
before the effect, which stayed; a thread calling again and again met that gap at each of its
calls); and ``request_approval``, waiting the same way, waited as long as such a thread called
(found in review). Both now wait for the calls in flight under the journal lock, a while at a
time (``QUIET_HOLD_SECONDS``, doubled each round, the lock let go in between), then write the
failure or the park under it."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from django.test import override_settings

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import Created, intake_event
from buzz_delivery.gateway.remote_runs import RemoteRunContext, run_remote_claim
from buzz_delivery.testing import CommunityFactory
from tests.gateway import handlers as gh
from tests.gateway.support import enroll, new_agent

pytestmark = pytest.mark.django_db(transaction=True)

CAP = 15.0  # a calling thread stops by itself after this (a test that hangs is no test)


def _run(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    with override_settings(BUZZ_AGENTS={"MAX_TOOL_CALLS": 100_000}):  # the budget never ends a loop
        outcome = intake_event(community.id, "test", uuid.uuid4().hex, {}, agent.pubkey)
    assert isinstance(outcome, Created)
    return agent, outcome.run_id


def _entries(run_id):
    return list(
        JournalEntry.objects.filter(run_id=run_id)
        .order_by("seq")
        .values_list("seq", "kind", "status", "uncertain", "compensation_status")
    )


def test_a_call_journaled_after_the_wait_for_the_calls_in_flight_is_waited_for_before_the_failure(
    gateway_server, tmp_path, monkeypatch
):
    """A thread the handler left behind journals its call just after the runtime found none in
    flight and before it failed the run: the failure closed it uncertain and undid it while its
    tool still ran (the ledger read ``undo`` before ``call``). It is now waited for, then undone."""
    ledger = tmp_path / "ledger.txt"
    monkeypatch.setenv("GATEWAY_RUN_LEDGER", str(ledger))
    agent, run_id = _run(gateway_server)
    (claim,) = agent.claim_runs(worker_id="w")
    awaited, started = threading.Event(), threading.Event()
    seen: list = []
    original = RemoteRunContext._await_calls

    def await_calls(self):
        original(self)
        if not awaited.is_set():  # the first wait found nothing in flight: the call comes now
            awaited.set()
            assert started.wait(30)

    monkeypatch.setattr(RemoteRunContext, "_await_calls", await_calls)

    def slow_effect(args, key):
        started.set()
        threading.Event().wait(0.5)  # in flight when the runtime fails the run
        return gh.effect(args, key)

    def handler(ctx):
        def tool():
            try:
                assert awaited.wait(30)
                seen.append(ctx.call("slow", slow_effect, {"n": 1}, compensate=gh.undo))
            except BaseException as exc:
                seen.append(type(exc).__name__)

        threading.Thread(target=tool, daemon=True).start()
        raise RuntimeError("the handler gives up")

    outcome = run_remote_claim(agent, claim, handler, RemoteRunContext(agent, claim))
    threading.Event().wait(1.0)  # the slow call has ended either way
    key = f"{run_id}:1"
    assert ledger.read_text().splitlines() == [f"call {key}", f"undo {key}:compensate"]
    assert seen == [{"n": 1}]
    assert _entries(run_id) == [(1, "tool", "succeeded", False, "compensated")]
    run = AgentRun.objects.get(id=run_id)
    assert (outcome, run.state, run.failure_code) == ("compensated", "failed", "handler_error")


def _poller(ctx, stop, calling, made, seen):
    def poll(args, key):
        made.append(args["n"])
        calling.set()
        time.sleep(0.002)  # a tool that does something
        return args

    def caller():
        try:
            n = 0
            while not stop.is_set():
                n += 1
                ctx.call("poll", poll, {"n": n})
            seen.append("stopped by the test")
        except BaseException as exc:
            seen.append(type(exc).__name__)

    thread = threading.Thread(target=caller, daemon=True)
    thread.start()
    return thread


def _capped(agent, claim, handler, stop, threads):
    cap = threading.Timer(CAP, stop.set)
    cap.start()
    started = time.monotonic()
    try:
        outcome = run_remote_claim(agent, claim, handler, RemoteRunContext(agent, claim))
        return outcome, time.monotonic() - started
    finally:
        stop.set()
        cap.cancel()
        for thread in threads:
            thread.join(30)


@pytest.mark.parametrize("in_the_gap", [False, True])
def test_a_thread_calling_again_and_again_does_not_keep_a_failing_remote_run_from_ending(
    gateway_server, in_the_gap, monkeypatch
):
    """A thread the handler left behind makes call after call (a poller). The failure waited for
    the calls in flight outside the journal lock, then was sent: the poller's next call, journaled
    in that gap, was closed uncertain (``failed``, uncertain: in 5 of 8 runs before the fix, the
    failure and that journal request racing at the gateway; every run ``in_the_gap``, where the
    journal's answer reaches the runtime 0.5 s late and the failure is sent 0.2 s after the wait,
    as on a loaded machine). The failure is now written under the
    journal lock once no call is in flight, bounded (waited for a while at a time): the run
    fails, every call made is recorded, and the thread's next call is refused."""
    agent, run_id = _run(gateway_server)
    (claim,) = agent.claim_runs(worker_id="w")
    stop, calling = threading.Event(), threading.Event()
    made: list = []
    seen: list = []
    threads: list = []
    if in_the_gap:
        journal_call, await_calls = agent.journal_call, RemoteRunContext._await_calls

        def late(*args, **kwargs):
            outcome = journal_call(*args, **kwargs)
            time.sleep(0.5)  # journaled at the gateway, not yet counted in flight by the runtime
            return outcome

        def slow_to_wake(self):
            await_calls(self)
            time.sleep(0.2)  # the poller's next call is journaled by now

        agent.journal_call = late
        monkeypatch.setattr(RemoteRunContext, "_await_calls", slow_to_wake)

    def handler(ctx):
        threads.append(_poller(ctx, stop, calling, made, seen))
        assert calling.wait(30)
        raise RuntimeError("the handler gives up")

    outcome, took = _capped(agent, claim, handler, stop, threads)
    assert seen == ["RunAborted"], f"the thread was not refused after the failure ({took:.1f} s, {len(made)} calls)"
    assert took < CAP / 2, took
    run = AgentRun.objects.get(id=run_id)
    assert (outcome, run.state, run.failure_code) == ("failed", "failed", "handler_error")
    # each call made was recorded, none closed uncertain
    assert _entries(run_id) == [(n, "tool", "succeeded", False, None) for n in range(1, len(made) + 1)]


def test_a_thread_calling_again_and_again_does_not_keep_the_remote_approval_from_parking(gateway_server):
    """Another thread makes call after call while the handler asks for an approval: the approval
    waited as long as the thread called (found in review). The run parks now, and the thread's
    next call is refused (the run parked)."""
    agent, run_id = _run(gateway_server)
    (claim,) = agent.claim_runs(worker_id="w")
    stop, calling = threading.Event(), threading.Event()
    made: list = []
    seen: list = []
    threads: list = []

    def handler(ctx):
        threads.append(_poller(ctx, stop, calling, made, seen))
        assert calling.wait(30)
        return ctx.request_approval("ship?", 600)

    outcome, took = _capped(agent, claim, handler, stop, threads)
    assert (outcome, seen) == ("parked", ["_Parked"]), (outcome, seen, f"{took:.1f} s, {len(made)} calls")
    assert took < CAP / 2, took
    assert AgentRun.objects.get(id=run_id).state == "waiting_approval"
    calls = [(n, "tool", "succeeded", False, None) for n in range(1, len(made) + 1)]
    assert _entries(run_id) == [*calls, (len(made) + 1, "approval", "pending", False, None)]


def test_a_call_a_tool_in_flight_waits_for_on_another_thread_is_let_in_before_the_failure(
    gateway_server, tmp_path, monkeypatch
):
    """The failure waits for the calls in flight holding the journal lock; a call in flight whose
    tool starts a thread that calls, and waits for it, would wait for ever for that lock (the run
    hung, its lease renewed): the lock is let go between two rounds, the inner call is made, the
    outer one recorded, then the run fails and both are undone, inner first."""
    from buzz_delivery.inflight import InFlightCalls

    ledger = tmp_path / "ledger.txt"
    monkeypatch.setenv("GATEWAY_RUN_LEDGER", str(ledger))
    agent, run_id = _run(gateway_server)
    (claim,) = agent.claim_runs(worker_id="w")
    started, holding = threading.Event(), threading.Event()  # holding: the failure waits, lock held
    original = InFlightCalls.others_end_within

    def others_end_within(self, *args):
        holding.set()
        return original(self, *args)

    monkeypatch.setattr(InFlightCalls, "others_end_within", others_end_within)
    # The wait before the failure (outside the lock) would wait for the outer call, which waits
    # for the failure's: the failure's own wait is the one under test.
    monkeypatch.setattr(RemoteRunContext, "_await_calls", lambda self: None)
    seen: list = []

    def handler(ctx):
        def outer_tool(args, key):
            started.set()
            assert holding.wait(CAP)
            inner: list = []

            def inner_thread():
                try:
                    inner.append(ctx.call("inner", gh.effect, {"n": 2}, compensate=gh.undo))
                except BaseException as exc:
                    inner.append(type(exc).__name__)

            thread = threading.Thread(target=inner_thread, daemon=True)
            thread.start()
            thread.join(CAP)
            assert inner == [{"n": 2}], inner
            return gh.effect(args, key)

        def tool():
            try:
                seen.append(ctx.call("outer", outer_tool, {"n": 1}, compensate=gh.undo))
            except BaseException as exc:
                seen.append(type(exc).__name__)

        threading.Thread(target=tool, daemon=True).start()
        assert started.wait(30)
        raise RuntimeError("the handler gives up")

    began = time.monotonic()
    outcome = run_remote_claim(agent, claim, handler, RemoteRunContext(agent, claim))
    took = time.monotonic() - began
    assert seen == [{"n": 1}], seen
    assert took < CAP, took
    assert _entries(run_id) == [
        (1, "tool", "succeeded", False, "compensated"),
        (2, "tool", "succeeded", False, "compensated"),
    ]
    assert [line.split()[0] for line in ledger.read_text().splitlines()] == ["call", "call", "undo", "undo"]
    assert ledger.read_text().splitlines()[2] == f"undo {run_id}:2:compensate"  # inner first
    run = AgentRun.objects.get(id=run_id)
    assert (outcome, run.state, run.failure_code) == ("compensated", "failed", "handler_error")
