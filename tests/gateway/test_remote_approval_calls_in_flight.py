"""The remote worker's ``ctx.request_approval`` while another call of the run is in flight (a
handler running tools in parallel), over HTTP: it waits for the call, then parks the run; the
gateway answers ``calls_in_flight`` (not a 409 lease lost) while the holder's call is pending.
Found in review: before the fix the approval got ``lease_lost`` and the run was given up."""

from __future__ import annotations

import threading
import uuid

import pytest

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import Created, intake_event
from buzz_delivery.gateway.remote_runs import ApprovalBlockedByCalls, RemoteRunContext, run_remote_claim
from buzz_delivery.testing import CommunityFactory
from tests.gateway.support import enroll, new_agent

pytestmark = pytest.mark.django_db(transaction=True)


def _run(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    outcome = intake_event(community.id, "test", uuid.uuid4().hex, {}, agent.pubkey)
    assert isinstance(outcome, Created)
    return agent, outcome.run_id


def _entries(run_id):
    return [(e.seq, e.kind, e.status) for e in JournalEntry.objects.filter(run_id=run_id).order_by("seq")]


def test_the_gateway_answers_calls_in_flight_and_writes_nothing(gateway_server):
    agent, run_id = _run(gateway_server)
    (claim,) = agent.claim_runs(worker_id="w")
    assert agent.journal_call(claim.lease, "slow", {"n": 1}).outcome == "journaled"

    refused = agent.request_approval(claim.lease, "ship?", 600)
    assert (refused.outcome, refused.data["seqs"]) == ("calls_in_flight", [1])
    assert (AgentRun.objects.get(id=run_id).state, _entries(run_id)) == ("waiting_tool", [(1, "tool", "pending")])
    assert agent.record_result(claim.lease, 1, ok=True, output={}).outcome == "recorded"  # the lease holds
    assert agent.request_approval(claim.lease, "ship?", 600).outcome == "approval_requested"


def test_a_remote_thread_asking_for_approval_while_another_runs_a_tool_parks_the_run(gateway_server):
    agent, run_id = _run(gateway_server)
    (claim,) = agent.claim_runs(worker_id="w")
    in_tool, seen = threading.Event(), []

    def slow(args, key):
        in_tool.set()
        threading.Event().wait(0.5)
        return {"n": args["n"]}

    def handler(ctx):
        def tool():
            try:
                seen.append(ctx.call("slow", slow, {"n": 1}))
            except BaseException as exc:
                seen.append(repr(exc))

        worker = threading.Thread(target=tool)
        worker.start()
        assert in_tool.wait(30)
        try:
            return ctx.request_approval("ship?", 600)
        finally:
            worker.join(30)

    assert run_remote_claim(agent, claim, handler, RemoteRunContext(agent, claim)) == "parked"
    assert seen == [{"n": 1}]
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == ("waiting_approval", None)
    assert _entries(run_id) == [(1, "tool", "succeeded"), (2, "approval", "pending")]


def test_a_remote_approval_asked_from_inside_a_call_is_a_typed_error(gateway_server):
    agent, run_id = _run(gateway_server)
    (claim,) = agent.claim_runs(worker_id="w")

    def handler(ctx):
        def asks(args, key):
            try:
                ctx.request_approval("from within", 600)
            except ApprovalBlockedByCalls as exc:
                return {"seqs": list(exc.seqs)}
            return {"seqs": None}

        return ctx.call("asks", asks, {})

    assert run_remote_claim(agent, claim, handler, RemoteRunContext(agent, claim)) == "completed"
    assert AgentRun.objects.get(id=run_id).output == {"seqs": [1]}
    assert _entries(run_id) == [(1, "tool", "succeeded")]


def test_a_remote_approval_waiting_for_a_call_does_not_block_that_calls_nested_call(gateway_server):
    """The approval waited for the calls in flight holding the journal lock, and a call nested in
    the one it waited for needed that lock: the run hung, its heartbeat keeping the lease (found
    in review: hung before the fix). A nested call is now refused at once (``NestedCall``,
    tests/gateway/test_remote_nested_call.py): the outer call fails with it and the run parks."""
    agent, run_id = _run(gateway_server)
    (claim,) = agent.claim_runs(worker_id="w")
    in_tool, seen = threading.Event(), []

    def handler(ctx):
        def outer(args, key):
            in_tool.set()
            threading.Event().wait(0.5)  # the approval waits for this call by now
            return {"inner": ctx.call("inner", lambda a, k: {"n": a["n"]}, {"n": 2})}

        def tool():
            try:
                seen.append(ctx.call("outer", outer, {"n": 1}))
            except BaseException as exc:
                seen.append(repr(exc))

        worker = threading.Thread(target=tool, daemon=True)
        worker.start()
        assert in_tool.wait(30)
        try:
            return ctx.request_approval("ship?", 600)
        finally:
            worker.join(30)

    done: list[str] = []
    runner = threading.Thread(
        target=lambda: done.append(run_remote_claim(agent, claim, handler, RemoteRunContext(agent, claim))),
        daemon=True,
    )
    runner.start()
    runner.join(20)
    assert done == ["parked"], "the approval hung on the nested call it kept from its journal lock"
    assert len(seen) == 1 and seen[0].startswith("ToolCallFailed(\"1: ctx.call('inner') from inside"), seen
    assert AgentRun.objects.get(id=run_id).state == "waiting_approval"
    assert _entries(run_id) == [(1, "tool", "failed"), (2, "approval", "pending")]


@pytest.mark.parametrize("second_call", [False, True])
def test_a_remote_run_completes_only_once_its_calls_in_flight_are_recorded(gateway_server, second_call):
    """A handler returning while a call it started on another thread is in flight: the completion
    was refused (the run 'waiting_tool', run again) or, another call recorded meanwhile, the run
    completed with the call pending, its result never recorded (found in review: failed before
    the fix)."""
    agent, run_id = _run(gateway_server)
    (claim,) = agent.claim_runs(worker_id="w")
    seen: list = []

    def slow(args, key):
        threading.Event().wait(0.5)  # in flight when the handler returns
        return {"n": args["n"]}

    def handler(ctx):
        def tool():
            try:
                seen.append(ctx.call("slow", slow, {"n": 1}))
            except BaseException as exc:
                seen.append(repr(exc))

        threading.Thread(target=tool, daemon=True).start()
        threading.Event().wait(0.2)  # the slow call is journaled by now
        if second_call:
            ctx.call("fast", lambda a, k: {"n": a["n"]}, {"n": 2})
        return {"done": True}

    assert run_remote_claim(agent, claim, handler, RemoteRunContext(agent, claim)) == "completed"
    threading.Event().wait(1.0)
    assert seen == [{"n": 1}]
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.output) == ("completed", {"done": True})
    assert _entries(run_id) == [(1, "tool", "succeeded")] + ([(2, "tool", "succeeded")] if second_call else [])


def test_a_remote_run_failing_compensates_a_call_in_flight_only_after_it_happened(
    gateway_server, tmp_path, monkeypatch
):
    """A handler raising while a call it started on another thread is in flight: the run was
    failed at once, the call marked uncertain and its compensation run while the tool still ran
    (the undo before the effect). Found in review: failed before the fix."""
    from tests.gateway import handlers as gh

    ledger = tmp_path / "ledger.txt"
    monkeypatch.setenv("GATEWAY_RUN_LEDGER", str(ledger))
    agent, run_id = _run(gateway_server)
    (claim,) = agent.claim_runs(worker_id="w")
    seen: list = []

    def slow_effect(args, key):
        threading.Event().wait(0.5)  # in flight when the handler raises
        return gh.effect(args, key)

    def handler(ctx):
        def tool():
            try:
                seen.append(ctx.call("slow", slow_effect, {"n": 1}, compensate=gh.undo))
            except BaseException as exc:
                seen.append(type(exc).__name__)

        threading.Thread(target=tool, daemon=True).start()
        threading.Event().wait(0.2)  # the slow call is journaled by now
        raise RuntimeError("the handler gives up")

    outcome = run_remote_claim(agent, claim, handler, RemoteRunContext(agent, claim))
    threading.Event().wait(1.0)
    key = f"{run_id}:1"
    lines = ledger.read_text().splitlines()
    assert lines[0] == f"call {key}" and len(lines) == 2 and lines[1].startswith(f"undo {key}"), lines
    assert seen == [{"n": 1}]
    entry = JournalEntry.objects.get(run_id=run_id, seq=1)
    assert (entry.status, entry.uncertain, entry.compensation_status) == ("succeeded", False, "compensated")
    assert (outcome, AgentRun.objects.get(id=run_id).state) == ("compensated", "failed")
