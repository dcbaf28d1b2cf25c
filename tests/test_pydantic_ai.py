"""Pydantic AI agents run durably on the journal (issue 35), on ``FunctionModel`` (no network):
every model request and tool call is a journal entry; a worker killed (SIGKILL) mid-run is
resumed by another ``run_agent_worker`` process that replays the recorded response and result
and makes nothing twice; an approval-requiring tool parks the run; budgets stop the agent."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import claim_agent_runs
from buzz_delivery.workflows.services import decide_approval
from tests import pydantic_ai_handlers as ph
from tests.agents_support import AGENT, new_run


def claim_one(community, worker="w"):
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id=worker, lease_seconds=30)
    return claimed


def entries(run_id):
    return list(
        JournalEntry.objects.filter(run_id=run_id).order_by("seq").values_list("seq", "kind", "tool_name", "status")
    )


def lines(ledger, prefix):
    return [x for x in (ledger.read_text().splitlines() if ledger.exists() else []) if x.startswith(prefix)]


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    path = tmp_path / "ledger.txt"
    monkeypatch.setenv("AGENT_LEDGER", str(path))
    monkeypatch.delenv("AGENT_KILL", raising=False)
    return path


THREE_EFFECTS = [
    (1, "tool", "model:three-effects", "succeeded"),
    (2, "tool", "effect", "succeeded"),
    (3, "tool", "model:three-effects", "succeeded"),
    (4, "tool", "effect", "succeeded"),
    (5, "tool", "model:three-effects", "succeeded"),
    (6, "tool", "effect", "succeeded"),
    (7, "tool", "model:three-effects", "succeeded"),
]


@pytest.mark.django_db
def test_every_model_request_and_tool_call_is_a_journal_entry_and_the_output_is_the_agents(community, ledger):
    run_id = new_run(community.id)
    outcome = run_claim(claim_one(community), ph.three_effects)
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", run.failure_message
    assert (run.state, run.output) == ("completed", "sum=6 keys=3")
    assert entries(run_id) == THREE_EFFECTS
    assert lines(ledger, "call") == [f"call {run_id}:{seq}" for seq in (2, 4, 6)]  # the journal's keys
    assert lines(ledger, "model") == [f"model {run_id}:{seq}" for seq in (1, 3, 5, 7)]
    response = JournalEntry.objects.get(run_id=run_id, seq=1).output
    assert response["parts"][0]["tool_name"] == "effect" and response["kind"] == "response"


@pytest.mark.django_db
def test_an_unregistered_compensation_is_refused_when_the_handler_is_built():
    from buzz_delivery.agents.integrations.pydantic_ai import DurableAgent
    from tests.agent_handlers import not_a_compensation

    with pytest.raises(ValueError, match="not a registered compensation"):
        DurableAgent(ph.three_effects_agent, compensations={"effect": not_a_compensation})


@pytest.mark.django_db
@pytest.mark.parametrize("decision", ["approved", "rejected"])
def test_an_approval_requiring_tool_parks_the_run_and_the_decision_resumes_it_once(community, ledger, decision):
    run_id = new_run(community.id)
    assert run_claim(claim_one(community), ph.approval) == "parked"
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.lease_until) == ("waiting_approval", None)
    assert lines(ledger, "refund") == []  # not made before the decision
    assert claim_agent_runs(community.id, [AGENT], worker_id="early") == []  # parked: nobody may claim it
    decide_approval(community.id, run.approval_id, decision, "alice")
    assert run_claim(claim_one(community, "w2"), ph.approval) == "completed"
    run = AgentRun.objects.get(id=run_id)
    if decision == "approved":
        assert run.output == "answers=[{'n': 7}]"
        assert lines(ledger, "refund") == [f"refund {run_id}:3"]  # made once, with its journal key
    else:
        assert run.output == "answers=['The operator (operator) rejected it.']"
        assert lines(ledger, "refund") == []
    # The first response is replayed on resume, not asked again (the approval is entry 2).
    assert lines(ledger, "model") == [f"model {run_id}:1", f"model {run_id}:{4 if decision == 'approved' else 3}"]
    assert claim_agent_runs(community.id, [AGENT], worker_id="late") == []


@pytest.mark.django_db
def test_a_budget_of_tool_calls_stops_the_agent_at_the_cap_with_budget_exceeded(community, ledger):
    run_id = new_run(community.id, max_tool_calls=3)  # model 1, effect 1, model 2; effect 2 is refused
    assert run_claim(claim_one(community), ph.three_effects) == "compensated"
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code, run.tool_calls_used) == ("failed", "budget_exceeded", 3)
    assert "tool_calls budget exhausted (3/3)" in run.failure_message
    assert lines(ledger, "call") == [f"call {run_id}:2"]
    assert lines(ledger, "undo") == [f"undo {run_id}:2:compensate"]  # the effect made is compensated
    assert [e[2] for e in entries(run_id)] == ["model:three-effects", "effect", "model:three-effects"]


@pytest.mark.django_db
def test_a_cost_budget_counts_model_usage_and_tool_costs_and_stops_the_agent_at_the_cap(community, ledger):
    # Each response costs 100 (charged with the next call), each effect 1: model 1 (0), effect 1
    # (101), model 2 (0), effect 2 (101), model 3 (0), effect 3 would bring it to 303 > 250.
    run_id = new_run(community.id, max_cost=250)
    assert run_claim(claim_one(community), ph.budgeted) == "compensated"
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code, run.cost_used) == ("failed", "budget_exceeded", 202)
    assert "cost budget exhausted" in run.failure_message
    assert lines(ledger, "call") == [f"call {run_id}:{seq}" for seq in (2, 4)]
    assert list(JournalEntry.objects.filter(run_id=run_id).order_by("seq").values_list("cost", flat=True)) == [
        0, 101, 0, 101, 0,
    ]  # fmt: skip


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("point", ["model:2", "inside_after_effect:2"])
def test_a_worker_killed_mid_run_is_resumed_by_another_process_that_replays_and_makes_nothing_twice(
    community, ledger, point
):
    """SIGKILL after model request 1 and tool call 1 were recorded (inside model request 2, or
    inside tool call 2 after its effect, which the tool's reconcile hook then finds): the next
    ``run_agent_worker`` process replays them, makes each model request and effect once in all,
    and ends with the output of a run never interrupted (``calm``, done by the same worker)."""
    from tests.test_agents_processes import reclaim, worker

    run_id = new_run(community.id)
    code, _, err = worker(community, "three_effects", ledger, kill=point, handler_module="tests.pydantic_ai_handlers")
    assert code == -9, err
    recorded = list(JournalEntry.objects.filter(run_id=run_id, status="succeeded").values_list("tool_name", flat=True))
    assert recorded[:2] == ["model:three-effects", "effect"]
    reclaim(run_id)
    calm = new_run(community.id)
    code, summary, err = worker(community, "three_effects", ledger, handler_module="tests.pydantic_ai_handlers")
    assert code == 0, err
    assert summary["completed"] == 2, AgentRun.objects.get(id=run_id).failure_message
    resumed, uninterrupted = AgentRun.objects.get(id=run_id), AgentRun.objects.get(id=calm)
    assert resumed.state == uninterrupted.state == "completed"
    assert resumed.output == uninterrupted.output == "sum=6 keys=3"
    assert entries(run_id) == THREE_EFFECTS
    mine = [x for x in lines(ledger, "call") + lines(ledger, "model") if str(run_id) in x]
    assert sorted(mine) == sorted(
        [f"call {run_id}:{seq}" for seq in (2, 4, 6)] + [f"model {run_id}:{seq}" for seq in (1, 3, 5, 7)]
    )  # each model request and each effect made once


DOC = Path(__file__).resolve().parent.parent / "docs" / "pydantic-ai.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


@pytest.mark.django_db
def test_the_docs_example_runs_as_written_and_completes_with_one_charge(ledger):
    (code,) = BLOCK.findall(DOC.read_text())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {"__name__": "pydantic_ai_doc"})
    assert out.getvalue().split() == ["completed", "1"]
    run = AgentRun.objects.get(output="charged: ch_1")
    assert [e[2] for e in entries(run.id)] == ["model:billing", "charge", "model:billing"]


@pytest.mark.django_db(transaction=True)
def test_under_the_event_loop_worker_handler_run_awaits_ctx_call_directly(community, ledger):
    """When the event-loop worker (issue 29, ``buzz_delivery.agents.loop_worker``) is there:
    ``DurableAgent.run`` is an async handler whose journaled calls are ``await ctx.call(...)``
    on the worker's own loop (no thread bridge), with the same journal and effects."""
    loop_worker = pytest.importorskip("buzz_delivery.agents.loop_worker", reason="the event-loop worker is not here")
    run_ids = [new_run(community.id) for _ in range(3)]
    config = loop_worker.AsyncWorkerConfig(
        handler=ph.three_effects.run,
        agents=[AGENT],
        communities=[community.id],
        exit_when_idle=True,
        poll_seconds=0.1,
        lease_seconds=15,
        worker_id="aio-pydantic-ai",
    )
    counts = loop_worker.AsyncAgentWorker(config).run()
    assert counts["completed"] == 3, counts
    for run_id in run_ids:
        assert AgentRun.objects.get(id=run_id).output == "sum=6 keys=3"
        assert entries(run_id) == THREE_EFFECTS
        assert [x for x in lines(ledger, "call") if str(run_id) in x] == [f"call {run_id}:{seq}" for seq in (2, 4, 6)]


@pytest.mark.django_db
def test_with_stream_text_each_model_response_s_text_is_a_chunk_of_the_run_s_output_stream(community, ledger):
    from buzz_delivery.agents.services.output import read_output

    run_id = new_run(community.id)
    assert run_claim(claim_one(community), ph.narrating) == "completed"
    page = read_output(community.id, run_id)
    assert [(c.seq, c.chunk) for c in page.chunks] == [(1, "Looking it up. "), (2, "Found 1.")]
    assert AgentRun.objects.get(id=run_id).output == "Found 1."
    other = new_run(community.id)
    assert run_claim(claim_one(community), ph.three_effects) == "completed"  # stream_text off: nothing
    assert read_output(community.id, other).chunks == ()


@pytest.mark.django_db
def test_a_run_journaled_before_tool_calls_had_scopes_resumes_making_nothing_twice(community, ledger):
    """review10: a run parked with its tool calls journaled one at a time in the root scope (the
    integration before its tool calls had scopes of their own; a deploy while the run waits for
    its approval) replays them by position. Failed before: each looked up in ``tool:<id>``, not
    found, the effect made again, then ``replay_mismatch``."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import FunctionModel

    from buzz_delivery.agents.integrations.pydantic_ai import DurableAgent
    from tests import agent_handlers as h
    from tests.test_openai_agents import WithoutScopes

    def model(messages, info):
        done = ph._returns(messages)
        if not done:
            return ModelResponse(parts=[ToolCallPart("effect", {"n": 1}, tool_call_id="call-1")])
        if len(done) == 1:
            return ModelResponse(parts=[ToolCallPart("refund", {"n": 7}, tool_call_id="refund-1")])
        return ModelResponse(parts=[TextPart(f"answers={done}")])

    agent = Agent(FunctionModel(model, model_name="old"))
    agent.tool_plain(ph.effect)
    agent.tool_plain(requires_approval=True)(ph.refund)
    durable = DurableAgent(agent, compensations={"effect": h.undo})
    run_id = new_run(community.id)
    assert run_claim(claim_one(community), lambda ctx: durable(WithoutScopes(ctx))) == "parked"
    assert {e.scope for e in JournalEntry.objects.filter(run_id=run_id)} == {""}
    decide_approval(community.id, AgentRun.objects.get(id=run_id).approval_id, "approved", "alice")
    outcome = run_claim(claim_one(community, "w2"), durable)
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert lines(ledger, "call") == [f"call {run_id}:2"]  # the effect made once
    assert lines(ledger, "refund") == [f"refund {run_id}:5"]


@pytest.mark.django_db
def test_a_tool_result_with_a_float_jsonb_reads_back_as_an_int_resumes_after_an_approval(community, ledger):
    """review10: the first run showed the model ``1e+20``, the resumed run the journal's
    ``100000000000000000000``: the next request's digest differed (``replay_mismatch``)."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import FunctionModel

    from buzz_delivery.agents.integrations.pydantic_ai import DurableAgent

    def model(messages, info):
        done = ph._returns(messages)
        if not done:
            return ModelResponse(parts=[ToolCallPart("measure", {}, tool_call_id="call-1")])
        if len(done) == 1:
            return ModelResponse(parts=[ToolCallPart("refund", {"n": 7}, tool_call_id="refund-1")])
        return ModelResponse(parts=[TextPart(f"answers={done}")])

    agent = Agent(FunctionModel(model, model_name="measure"))

    @agent.tool_plain
    def measure() -> dict:
        return {"big": 1e20, "zero": -0.0}

    agent.tool_plain(requires_approval=True)(ph.refund)
    durable = DurableAgent(agent)
    run_id = new_run(community.id)
    assert run_claim(claim_one(community), durable) == "parked"
    decide_approval(community.id, AgentRun.objects.get(id=run_id).approval_id, "approved", "alice")
    outcome = run_claim(claim_one(community, "w2"), durable)
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert run.output == "answers=[{'big': 100000000000000000000, 'zero': 0.0}, {'n': 7}]"
