"""The thread runtime: a ``ctx.call`` made from inside another ``ctx.call``'s tool function of the
same run (nested, on the same thread).

It was journaled after the outer call and made. But a resumed run (after an approval, a crash)
replays the outer call from the journal without running its tool function, so the nested call's
entry was never consumed: the handler's next call or approval met it at its journal position and
the run failed ``ReplayMismatch`` (``test_a_run_resumed_after_a_nested_call_...`` failed so
before the fix). Nested calls are now refused at once with :class:`NestedCall`, nothing journaled,
as the event-loop runtime does. Calls a tool fans out to threads of its own are not nested and
stay allowed (tests/test_agents_approval_nested_call.py)."""

from __future__ import annotations

import pytest

from buzz_delivery.agents.exceptions import NestedCall
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import claim_agent_runs
from buzz_delivery.workflows.services import decide_approval
from tests.agents_support import AGENT, new_run

pytestmark = pytest.mark.django_db(transaction=True)


def _claim(community, worker):
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id=worker, lease_seconds=30)
    return claimed


def _entries(run_id):
    return [(e.seq, e.kind, e.tool_name, e.status) for e in JournalEntry.objects.filter(run_id=run_id).order_by("seq")]


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


def test_a_run_resumed_after_a_nested_call_replays_its_journal(community):
    run_id = new_run(community.id)
    assert run_claim(_claim(community, "w1"), nested_then_approval) == "parked"
    decide_approval(community.id, AgentRun.objects.get(id=run_id).approval_id, "approved", "alice")

    outcome = run_claim(_claim(community, "w2"), nested_then_approval)
    run = AgentRun.objects.get(id=run_id)
    assert (outcome, run.failure_code) == ("completed", None)
    assert run.output["decision"] == "approved"
    assert (run.output["first"]["error"], run.output["first"]["outer_seq"]) == ("NestedCall", 1)
    assert "ctx.call('inner') from inside the tool function of call 1" in run.output["first"]["text"]
    assert _entries(run_id) == [(1, "tool", "outer", "succeeded"), (2, "approval", "approval", "succeeded")]
