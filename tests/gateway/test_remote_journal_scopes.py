"""The remote runtime replays by scope as the in-process one (tests/test_agents_journal_scopes.py):
the replay key (scope, index) goes through the gateway's calls and approvals and comes back in
the journal it reads on resume. Failed before the change: the threads' calls replayed out of
order and the fan-out's next call met another entry at their position (``ReplayMismatch``);
the Pydantic AI tools were made one at a time (the first never saw the last start)."""

from __future__ import annotations

import json
import uuid

import pytest

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import Created, intake_event
from buzz_delivery.gateway.remote_runs import RemoteRunContext, run_remote_claim
from buzz_delivery.testing import CommunityFactory
from buzz_delivery.workflows.services import decide_approval
from tests.gateway.support import enroll, new_agent
from tests.test_agents_journal_scopes import Cities, Ordered, _cities_agent, _fan_out_handler, _handler

pytestmark = pytest.mark.django_db(transaction=True)


def _setup(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    created = intake_event(community.id, "test", uuid.uuid4().hex, {}, agent.pubkey)
    assert isinstance(created, Created)
    return community, agent, created.run_id


def _run(agent, worker, handler):
    (claim,) = agent.claim_runs(worker_id=worker)
    return run_remote_claim(agent, claim, handler, RemoteRunContext(agent, claim))


def _approve(community, run_id):
    run = AgentRun.objects.get(id=run_id)
    assert run.state == "waiting_approval", (run.state, run.failure_code, run.failure_message)
    decide_approval(community.id, run.approval_id, "approved", "alice")


def test_remote_threads_in_scopes_replay_whatever_order_they_arrive_in(gateway_server):
    community, agent, run_id = _setup(gateway_server)
    first = Ordered(["w3", "w2", "w1"])
    assert _run(agent, "w1", first.handler) == "parked"
    keys = [(e.seq, e.scope, e.scope_index) for e in JournalEntry.objects.filter(run_id=run_id).order_by("seq")]
    assert keys == [(1, "w3", 1), (2, "w3", 2), (3, "w2", 1), (4, "w2", 2), (5, "w1", 1), (6, "w1", 2), (7, "", 1)]
    _approve(community, run_id)

    again = Ordered(["w1", "w2", "w3"])
    outcome = _run(agent, "w2", again.handler)
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert again.made == []
    assert run.output["outputs"]["w2"][1]["key"] == f"{run_id}:4"


def test_remote_fan_out_in_scopes_across_an_approval(gateway_server):
    community, agent, run_id = _setup(gateway_server)
    made: list = []
    assert _run(agent, "w1", _fan_out_handler(made)) == "parked"
    _approve(community, run_id)
    made.clear()
    outcome = _run(agent, "w2", _fan_out_handler(made))
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert made == [("after", 0)]
    assert run.output == {"fanned": {"parts": [10, 20]}, "decision": "approved", "after": {"ok": True}}


def test_remote_pydantic_ai_parallel_tool_calls_across_an_approval(gateway_server):
    community, agent, run_id = _setup(gateway_server)
    box: list = [None]
    first = Cities(box)
    assert _run(agent, "w1", _handler(_cities_agent(first, True), box)) == "parked"
    assert first.ended == ["c", "b", "a"]
    _approve(community, run_id)
    again = Cities(box)
    outcome = _run(agent, "w2", _handler(_cities_agent(again, True), box))
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert again.made == []
    keys = {e.scope: e.idempotency_key for e in JournalEntry.objects.filter(run_id=run_id, tool_name="lookup")}
    assert json.loads(run.output) == ["shipped"] + [{"city": c, "key": keys[f"tool:call-{c}"]} for c in "abc"]


def test_remote_pydantic_ai_parallel_tool_calls_through_the_worker_batcher(gateway_server):
    """The remote worker journals through its batcher (the batch form): a call journaled while
    another of the run is pending (the run ``waiting_tool``) must be journaled, as the one-run
    form does. Failed before the fix: the batch form matched only a ``running`` run, so the
    second parallel tool call was answered ``lease_lost`` and the run was given up."""
    from buzz_delivery.gateway.remote_runs import RunBatcher

    _, agent, run_id = _setup(gateway_server)
    box: list = [None]
    first = Cities(box)
    (claim,) = agent.claim_runs(worker_id="w1")
    ctx = RemoteRunContext(agent, claim, RunBatcher(agent))
    outcome = run_remote_claim(agent, claim, _handler(_cities_agent(first, False), box), ctx)
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (outcome, run.state, run.failure_code, run.failure_message)
    assert first.ended == ["c", "b", "a"]  # the three tools ran at once
    assert sorted(e.scope for e in JournalEntry.objects.filter(run_id=run_id, tool_name="lookup")) == [
        f"tool:call-{c}" for c in "abc"
    ]


def test_a_replay_key_spent_already_is_refused_by_field_and_nothing_is_written(gateway_server):
    """Trust nothing a caller writes: a client naming a (scope, index) its run holds already is
    answered 400 ``index`` (the one-run calls and approval routes and the batch), nothing written.
    Failed before the fix: the unique index's violation was a 500."""
    from buzz_delivery.gateway.client import GatewayHTTPError

    _, agent, run_id = _setup(gateway_server)
    (claim,) = agent.claim_runs(worker_id="w1")
    lease = claim.lease
    call = {"tool_name": "t", "args": {}, "cost": 0, "compensation": None, "destructive": False}
    assert agent.journal_call(lease, "t", {}, scope="s", index=1).outcome == "journaled"
    assert agent.record_result(lease, 1, ok=True, output=1).outcome == "recorded"
    for action, body in (
        ("calls", {**call, "scope": "s", "index": 1}),
        ("approval", {"prompt": "p", "deadline_seconds": 60, "scope": "s", "index": 1}),
    ):
        with pytest.raises(GatewayHTTPError) as refused:
            agent._run_post(lease, action, **body)
        assert (refused.value.status, refused.value.field) == (400, "index"), refused.value
    with pytest.raises(GatewayHTTPError) as refused:
        agent.run_batch("calls", [(lease, {**call, "scope": "s", "index": 1})])
    assert (refused.value.status, refused.value.field) == (400, "index"), refused.value
    run = AgentRun.objects.get(id=run_id)
    assert (run.tool_calls_used, run.state) == (1, "running")
    assert [(e.seq, e.scope, e.scope_index) for e in JournalEntry.objects.filter(run_id=run_id)] == [(1, "s", 1)]


def test_remote_openai_agents_run_journaled_before_function_call_scopes_resumes_making_nothing_twice(
    gateway_server, tmp_path, monkeypatch
):
    """As tests/test_openai_agents.py's: a run whose function calls an earlier release journaled
    one at a time in the root scope (through the gateway: no replay key sent, each entry's index
    its seq) resumes replaying them by position. Failed before: the effect was made again, then
    ``replay_mismatch``."""
    from tests.test_openai_agents import WithoutScopes, effect_then_refund, lines

    ledger = tmp_path / "ledger.txt"
    monkeypatch.setenv("AGENT_LEDGER", str(ledger))
    monkeypatch.delenv("AGENT_KILL", raising=False)
    community, agent, run_id = _setup(gateway_server)
    assert _run(agent, "w1", lambda ctx: effect_then_refund(WithoutScopes(ctx))) == "parked"
    keys = [(e.scope, e.scope_index, e.tool_name) for e in JournalEntry.objects.filter(run_id=run_id).order_by("seq")]
    assert keys == [("", None, "model:old"), ("", None, "effect"), ("", None, "model:old"), ("", None, "approval")]
    _approve(community, run_id)
    outcome = _run(agent, "w2", effect_then_refund)
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert lines(ledger, "call") == [f"call {run_id}:2"]
    assert run.output == "answers=[{'n': 1}, {'n': 7}]"
