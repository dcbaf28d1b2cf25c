"""The remote runtime: a ``ctx.call`` made from inside another ``ctx.call``'s tool function of the
same run, on the same thread (nested). As in the thread runtime
(tests/test_agents_nested_call_replay.py) it was journaled and made, but a resumed run replays the
outer call from the journal without running its function: the nested call's entry was never
consumed and the handler's approval met it at its journal position, failing the run
``replay_mismatch`` (failed so before the fix). It is now refused at once with ``NestedCall``,
nothing journaled."""

from __future__ import annotations

import uuid

import pytest

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import Created, intake_event
from buzz_delivery.gateway.remote_runs import NestedCall, RemoteRunContext, run_remote_claim
from buzz_delivery.testing import CommunityFactory
from buzz_delivery.workflows.services import decide_approval
from tests.gateway.support import enroll, new_agent

pytestmark = pytest.mark.django_db(transaction=True)


def nested_then_approval(ctx):
    def outer(args, key):
        try:
            inner = ctx.call("inner", lambda a, k: {"n": 2}, {"n": 2})
        except NestedCall as exc:
            return {"error": type(exc).__name__, "outer_seq": exc.outer_seq, "text": str(exc)}
        return {"inner": inner}

    first = ctx.call("outer", outer, {"n": 1})
    decision = ctx.request_approval("ship?", 600)
    return {"first": first, "decision": decision["decision"]}


def test_a_remote_run_resumed_after_a_nested_call_replays_its_journal(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    created = intake_event(community.id, "test", uuid.uuid4().hex, {}, agent.pubkey)
    assert isinstance(created, Created)
    run_id = created.run_id

    (claim,) = agent.claim_runs(worker_id="w1")
    assert run_remote_claim(agent, claim, nested_then_approval, RemoteRunContext(agent, claim)) == "parked"
    decide_approval(community.id, AgentRun.objects.get(id=run_id).approval_id, "approved", "alice")

    (claim,) = agent.claim_runs(worker_id="w2")
    assert run_remote_claim(agent, claim, nested_then_approval, RemoteRunContext(agent, claim)) == "completed", (
        AgentRun.objects.get(id=run_id).failure_code
    )
    output = AgentRun.objects.get(id=run_id).output
    assert output["decision"] == "approved"
    assert (output["first"]["error"], output["first"]["outer_seq"]) == ("NestedCall", 1)
    assert "ctx.call('inner') from inside the tool function of call 1" in output["first"]["text"]
    journal = JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    entries = [(e.seq, e.kind, e.tool_name, e.status) for e in journal]
    assert entries == [(1, "tool", "outer", "succeeded"), (2, "approval", "approval", "succeeded")]
