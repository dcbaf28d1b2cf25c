"""OpenAI Agents SDK agents run durably on the journal (issue 35), on a fake ``Model`` subclass
(no network, no API key): every model request and function tool call is a journal entry; a worker
killed (SIGKILL) mid-run is resumed by another ``run_agent_worker`` process that replays the
recorded response and result and makes nothing twice; a tool-call budget stops the agent with
``budget_exceeded``; a tool that needs approval parks the run."""

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
from tests import openai_agents_handlers as oh
from tests.agents_support import AGENT, counts, new_run


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
    outcome = run_claim(claim_one(community), oh.three_effects)
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", run.failure_message
    assert (run.state, run.output) == ("completed", "sum=6 keys=3")
    assert entries(run_id) == THREE_EFFECTS
    assert lines(ledger, "call") == [f"call {run_id}:{seq}" for seq in (2, 4, 6)]  # the journal's keys
    assert lines(ledger, "model") == [f"model {run_id}:{seq}" for seq in (1, 3, 5, 7)]
    first = JournalEntry.objects.get(run_id=run_id, seq=1)
    assert first.output["output"][0]["name"] == "effect" and first.output["usage"]["input_tokens"] == 100
    assert JournalEntry.objects.get(run_id=run_id, seq=2).args == {"n": 1}
    # Each response's usage (100 tokens) is charged with the call after it.
    assert list(JournalEntry.objects.filter(run_id=run_id).order_by("seq").values_list("cost", flat=True)) == [
        0, 100, 0, 100, 0, 100, 0,
    ]  # fmt: skip


@pytest.mark.django_db
def test_an_agent_handed_off_to_has_its_model_requests_and_tool_calls_journaled_too(community, ledger):
    run_id = new_run(community.id)
    assert run_claim(claim_one(community), oh.handing_off) == "completed"
    assert AgentRun.objects.get(id=run_id).output == "sum=6 keys=3"
    # The billing agent's own model (a Model instance) is wrapped on its clone, found as a handoff.
    assert [e[2] for e in entries(run_id)] == ["model:triage", *["model:billing", "effect"] * 3, "model:billing"]
    assert lines(ledger, "call") == [f"call {run_id}:{seq}" for seq in (3, 5, 7)]


@pytest.mark.django_db
def test_a_tool_s_timeout_is_applied_inside_its_journaled_call_and_its_message_is_the_recorded_result(
    community, ledger
):
    run_id = new_run(community.id)
    assert run_claim(claim_one(community), oh.timing_out) == "completed"
    answer = "Tool 'slow' timed out after 0.05 seconds."
    assert AgentRun.objects.get(id=run_id).output == answer
    slow = JournalEntry.objects.get(run_id=run_id, seq=2)
    assert (slow.tool_name, slow.status, slow.output) == ("slow", "succeeded", {"return": answer})


@pytest.mark.django_db
def test_what_cannot_be_journaled_is_refused_when_the_handler_is_built_and_nothing_is_written(community):
    from agents import Agent, LocalShellTool

    from buzz_delivery.agents.integrations.openai_agents import DurableAgent
    from tests.agent_handlers import not_a_compensation

    before = counts()
    with pytest.raises(ValueError, match="not a registered compensation"):
        DurableAgent(oh.three_effects_agent, compensations={"effect": not_a_compensation})
    shell = Agent(name="shell", tools=[LocalShellTool(executor=lambda request: "")])
    with pytest.raises(ValueError, match=r"^tools: LocalShellTool"):
        DurableAgent(Agent(name="front", handoffs=[shell]))  # found through a handoff too
    with pytest.raises(ValueError, match=r"^mcp_servers: "):
        DurableAgent(Agent(name="mcp", mcp_servers=[object()]))  # type: ignore[list-item]
    assert counts() == before


@pytest.mark.django_db
def test_a_budget_of_tool_calls_stops_the_agent_at_the_cap_with_budget_exceeded(community, ledger):
    run_id = new_run(community.id, max_tool_calls=3)  # model 1, effect 1, model 2; effect 2 is refused
    assert run_claim(claim_one(community), oh.three_effects) == "compensated"
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code, run.tool_calls_used) == ("failed", "budget_exceeded", 3)
    assert "tool_calls budget exhausted (3/3)" in run.failure_message
    assert lines(ledger, "call") == [f"call {run_id}:2"]
    assert lines(ledger, "undo") == [f"undo {run_id}:2:compensate"]  # the effect made is compensated
    assert [e[2] for e in entries(run_id)] == ["model:three-effects", "effect", "model:three-effects"]


@pytest.mark.django_db
def test_a_cost_budget_counts_model_usage_and_tool_costs_and_stops_the_agent_at_the_cap(community, ledger):
    # Each response's 100 tokens are charged with the next call, each effect costs 1: effect 1
    # (101), effect 2 (101), effect 3 would bring it to 303 > 250.
    run_id = new_run(community.id, max_cost=250)
    assert run_claim(claim_one(community), oh.budgeted) == "compensated"
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code, run.cost_used) == ("failed", "budget_exceeded", 202)
    assert lines(ledger, "call") == [f"call {run_id}:{seq}" for seq in (2, 4)]


@pytest.mark.django_db
@pytest.mark.parametrize("decision", ["approved", "rejected"])
def test_a_tool_that_needs_approval_parks_the_run_and_the_decision_resumes_it_once(community, ledger, decision):
    run_id = new_run(community.id)
    assert run_claim(claim_one(community), oh.approval) == "parked"
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.lease_until) == ("waiting_approval", None)
    assert lines(ledger, "refund") == []  # not made before the decision
    assert claim_agent_runs(community.id, [AGENT], worker_id="early") == []  # parked: nobody may claim it
    decide_approval(community.id, run.approval_id, decision, "alice")
    assert run_claim(claim_one(community, "w2"), oh.approval) == "completed"
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
    code, _, err = worker(community, "three_effects", ledger, kill=point, handler_module="tests.openai_agents_handlers")
    assert code == -9, err
    recorded = list(JournalEntry.objects.filter(run_id=run_id, status="succeeded").values_list("tool_name", flat=True))
    assert recorded[:2] == ["model:three-effects", "effect"]
    reclaim(run_id)
    calm = new_run(community.id)
    code, summary, err = worker(community, "three_effects", ledger, handler_module="tests.openai_agents_handlers")
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


@pytest.mark.django_db(transaction=True)
def test_under_the_event_loop_worker_handler_run_awaits_ctx_call_directly(community, ledger):
    from buzz_delivery.agents import loop_worker

    run_ids = [new_run(community.id) for _ in range(3)]
    config = loop_worker.AsyncWorkerConfig(
        handler=oh.three_effects.run,
        agents=[AGENT],
        communities=[community.id],
        exit_when_idle=True,
        poll_seconds=0.1,
        lease_seconds=15,
        worker_id="aio-openai-agents",
    )
    counted = loop_worker.AsyncAgentWorker(config).run()
    assert counted["completed"] == 3, counted
    for run_id in run_ids:
        assert AgentRun.objects.get(id=run_id).output == "sum=6 keys=3"
        assert entries(run_id) == THREE_EFFECTS
        assert [x for x in lines(ledger, "call") if str(run_id) in x] == [f"call {run_id}:{seq}" for seq in (2, 4, 6)]


@pytest.mark.django_db
def test_with_stream_text_each_model_response_s_text_is_a_chunk_of_the_run_s_output_stream(community, ledger):
    from buzz_delivery.agents.services.output import read_output

    run_id = new_run(community.id)
    assert run_claim(claim_one(community), oh.narrating) == "completed"
    page = read_output(community.id, run_id)
    assert [(c.seq, c.chunk) for c in page.chunks] == [(1, "Looking it up. "), (2, "Found 1.")]
    assert AgentRun.objects.get(id=run_id).output == "Found 1."


@pytest.mark.django_db
def test_with_stream_text_tokens_each_text_delta_is_a_chunk_written_while_the_request_runs(community, ledger):
    from buzz_delivery.agents.services.output import read_output

    run_id = new_run(community.id)
    assert run_claim(claim_one(community), oh.streaming) == "completed"
    assert [c.chunk for c in read_output(community.id, run_id).chunks] == ["Looking ", "it ", "up. ", "Found ", "1."]
    assert AgentRun.objects.get(id=run_id).output == "Found 1."
    answer = JournalEntry.objects.get(run_id=run_id, seq=3)
    assert answer.output["streamed_chunks"] == 2
    assert answer.output["response"]["output"][0]["content"][0]["text"] == "Found 1."
    assert lines(ledger, "model") == [f"model {run_id}:1", f"model {run_id}:3"]  # streamed, once each


@pytest.mark.django_db
def test_in_token_mode_a_resumed_run_replays_the_streamed_response_and_writes_none_of_its_chunks_twice(
    community, ledger
):
    from buzz_delivery.agents.services.output import read_output

    run_id = new_run(community.id)
    assert run_claim(claim_one(community), oh.streaming_approval) == "parked"
    assert [c.chunk for c in read_output(community.id, run_id).chunks] == ["Asking ", "first. "]
    decide_approval(community.id, AgentRun.objects.get(id=run_id).approval_id, "approved", "alice")
    assert run_claim(claim_one(community, "w2"), oh.streaming_approval) == "completed"
    stream = [(c.seq, c.chunk) for c in read_output(community.id, run_id).chunks]
    assert stream == [(1, "Asking "), (2, "first. "), (3, "Refunded "), (4, "7.")]
    assert lines(ledger, "model") == [f"model {run_id}:1", f"model {run_id}:4"]  # the first one replayed


DOC = Path(__file__).resolve().parent.parent / "docs" / "openai-agents.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


@pytest.mark.django_db
def test_the_docs_example_runs_as_written_and_completes_with_one_charge(ledger):
    (code,) = BLOCK.findall(DOC.read_text())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {"__name__": "openai_agents_doc"})
    assert out.getvalue().split() == ["completed", "1"]
    run = AgentRun.objects.get(output="charged: ch_1")
    assert [e[2] for e in entries(run.id)] == ["model:billing", "charge", "model:billing"]
