"""``request_approval`` while another call of the same holder is in flight (tools run in
parallel: one asks for an approval while another runs).

The run is ``waiting_tool`` while a call is in flight, and the park required ``running``: the
approval got ``LeaseLost("lease is not current")`` although the lease held, and the runtime gave
the run up (an attempt spent, ``attempts_exhausted`` on the last). A result recorded for a second
call set the run ``running`` with the first still pending, and the park then released the lease
under it: the first call's result could no longer be recorded. Now the park requires none of the
holder's own calls pending (else :class:`CallsInFlight`, nothing written), and the runtimes wait
for their calls in flight before they ask. Found in review: each test failed before the fix
(``LeaseLost`` / ``lost``, or the run parked with call 1 pending).
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections
from django.test import override_settings

from buzz_delivery.agents.exceptions import ApprovalBlockedByCalls
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import (
    ApprovalRequested,
    CallsInFlight,
    Journaled,
    Recorded,
    claim_agent_runs,
    journal_call,
    record_call_result,
    request_approval,
)
from buzz_delivery.workflows.models import Approval
from tests.agents_support import AGENT, claim, new_run

pytestmark = pytest.mark.django_db(transaction=True)


def _state(run_id):
    run = AgentRun.objects.get(id=run_id)
    entries = [(e.seq, e.kind, e.status) for e in JournalEntry.objects.filter(run_id=run_id).order_by("seq")]
    return run.state, run.tool_calls_used, run.lease_until is not None, entries


def test_request_approval_with_a_call_in_flight_answers_calls_in_flight_and_writes_nothing(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    assert isinstance(journal_call(lease, "slow", {"n": 1}), Journaled)
    before = _state(run_id)

    assert request_approval(lease, prompt="ship?", deadline_seconds=600) == CallsInFlight((1,))
    assert _state(run_id) == before == ("waiting_tool", 1, True, [(1, "tool", "pending")])
    assert not Approval.objects.filter(community_id=community.id).exists()

    assert isinstance(record_call_result(lease, 1, ok=True, output={"n": 1}), Recorded)
    assert isinstance(request_approval(lease, prompt="ship?", deadline_seconds=600), ApprovalRequested)
    assert _state(run_id)[0] == "waiting_approval"


def test_a_recorded_second_call_does_not_let_the_run_park_under_the_first(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    assert isinstance(journal_call(lease, "a", {"n": 1}), Journaled)
    assert isinstance(journal_call(lease, "b", {"n": 2}), Journaled)
    assert isinstance(record_call_result(lease, 2, ok=True, output={}), Recorded)  # the run is 'running' again

    assert request_approval(lease, deadline_seconds=600) == CallsInFlight((1,))
    assert _state(run_id) == ("running", 2, True, [(1, "tool", "pending"), (2, "tool", "succeeded")])
    assert isinstance(record_call_result(lease, 1, ok=True, output={}), Recorded)  # its lease still holds


def test_a_thread_asking_for_approval_while_another_runs_a_tool_parks_the_run_after_the_call(community):
    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    in_tool, seen = threading.Event(), []

    def slow(args, key):
        in_tool.set()
        threading.Event().wait(0.5)  # in flight while the handler's thread asks for the approval
        return {"n": args["n"]}

    def handler(ctx):
        def tool():
            try:
                seen.append(ctx.call("slow", slow, {"n": 1}))
            except BaseException as exc:
                seen.append(repr(exc))
            finally:
                connections.close_all()

        worker = threading.Thread(target=tool)
        worker.start()
        assert in_tool.wait(30)
        try:
            return ctx.request_approval("ship?", 600)
        finally:
            worker.join(30)

    assert run_claim(claimed, handler) == "parked"
    assert seen == [{"n": 1}]
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.attempts, run.failure_code) == ("waiting_approval", claimed.run.attempts, None)
    assert _state(run_id)[3] == [(1, "tool", "succeeded"), (2, "approval", "pending")]


def test_an_approval_asked_from_inside_a_call_is_a_typed_error_not_a_lost_run(community):
    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)

    def handler(ctx):
        def asks(args, key):
            try:
                ctx.request_approval("from within", 600)
            except ApprovalBlockedByCalls as exc:
                return {"seqs": list(exc.seqs), "text": str(exc)}
            return {"seqs": None}

        return ctx.call("asks", asks, {})

    assert run_claim(claimed, handler) == "completed"
    run = AgentRun.objects.get(id=run_id)
    assert run.output["seqs"] == [1]
    assert "call(s) 1 of this run are in flight" in run.output["text"]
    assert _state(run_id)[3] == [(1, "tool", "succeeded")]  # no approval, no journal slot spent
    assert not Approval.objects.filter(community_id=community.id).exists()


def test_a_call_starting_while_the_approval_waits_for_the_calls_in_flight_does_not_hang_it(community):
    """A third thread's ``ctx.call`` that starts while ``request_approval`` holds the journal lock
    (waiting for the first call) must not be counted in flight before it holds its position:
    counted, it waited for the lock the approval held, the approval waited for it, and the run
    hung while its heartbeat kept the lease (found in the lead's review of the fix)."""
    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    in_tool, release, late = threading.Event(), threading.Event(), []

    def slow(args, key):
        in_tool.set()
        assert release.wait(30)
        return {"n": args["n"]}

    def handler(ctx):
        def tool(n, out):
            try:
                out.append(ctx.call("slow", slow, {"n": n}))
            except BaseException as exc:
                out.append(type(exc).__name__)
            finally:
                connections.close_all()

        first = threading.Thread(target=tool, args=(1, []))
        first.start()
        assert in_tool.wait(30)
        third = threading.Thread(target=tool, args=(2, late))

        def start_third_then_release():
            threading.Event().wait(0.3)  # the approval holds the journal lock by now
            third.start()
            threading.Event().wait(0.3)  # the third call waits for that lock
            release.set()

        helper = threading.Thread(target=start_third_then_release)
        helper.start()
        try:
            return ctx.request_approval("ship?", 600)
        finally:
            helper.join(30)
            first.join(30)
            third.join(30)

    done: list[str] = []
    runner = threading.Thread(target=lambda: done.append(run_claim(claimed, handler)), daemon=True)
    runner.start()
    runner.join(20)
    assert done == ["parked"], "the approval hung on a call waiting for its journal lock"
    # The late call started while the approval waited (outside the journal lock: a call nested
    # in the one it waits for must journal, tests/test_agents_approval_nested_call.py), and the
    # approval waited for it too before it parked.
    assert late == [{"n": 2}]
    assert AgentRun.objects.get(id=run_id).state == "waiting_approval"
    assert _state(run_id)[3] == [(1, "tool", "succeeded"), (2, "tool", "succeeded"), (3, "approval", "pending")]


CAP = 15.0  # the calling thread stops by itself after this (a test that hangs is no test)


def test_a_thread_calling_again_and_again_does_not_keep_the_approval_from_parking(community):
    """Another thread makes call after call (a poller) while the handler asks for an approval:
    the approval waited for the calls in flight outside the journal lock, and each new call took
    the lock in the gap between that wait and the park (the calling thread was running; the
    asking one had to wake): the approval waited as long as the thread called (found in review,
    as the event-loop runtime's was). They are now waited for under the lock, a while at a time:
    the run parks, and the thread's next call is refused (the run parked)."""
    with override_settings(BUZZ_AGENTS={"MAX_TOOL_CALLS": 100_000}):  # the budget never ends the loop
        run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    stop, calling = threading.Event(), threading.Event()
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
                with ctx.scope("poller"):
                    n = 0
                    while not stop.is_set():
                        n += 1
                        ctx.call("poll", poll, {"n": n})
                seen.append("stopped by the test")
            except BaseException as exc:
                seen.append(type(exc).__name__)
            finally:
                connections.close_all()

        threads.append(threading.Thread(target=caller, daemon=True))
        threads[0].start()
        assert calling.wait(30)
        return ctx.request_approval("ship?", 600)

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
    assert (outcome, seen) == ("parked", ["_Parked"]), (outcome, seen, f"{took:.1f} s, {len(made)} calls")
    assert took < CAP / 2, took
    state, _, _, entries = _state(run_id)
    assert state == "waiting_approval"
    assert entries == [(n, "tool", "succeeded") for n in range(1, len(made) + 1)] + [
        (len(made) + 1, "approval", "pending")
    ]
