"""OpenAI Agents SDK agents run durably on the journal (issue 35), on a fake ``Model`` subclass
(no network, no API key): every model request and function tool call is a journal entry; a worker
killed (SIGKILL) mid-run is resumed by another ``run_agent_worker`` process that replays the
recorded response and result and makes nothing twice; a tool-call budget stops the agent with
``budget_exceeded``; a tool that needs approval parks the run."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import re
import threading
from pathlib import Path

import pytest
from agents import Agent, ToolGuardrailFunctionOutput, function_tool, tool_input_guardrail
from agents.testing import assistant_message, function_call

from buzz_delivery.agents.exceptions import RunAborted
from buzz_delivery.agents.integrations.openai_agents import DurableAgent, idempotency_key
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import NOT_MADE, run_claim
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


# -- one response's function calls run at once, each journaled in the scope of its call_id -----
#
# Each test failed on main's code, where every tool ran one at a time in the root scope
# (``max_function_tool_concurrency=1``): the guardrail of a call whose turn comes after a later
# call's (or a body waiting for the other bodies to enter) waited for its bound; the scopes
# asserted were "".

WAIT = 30  # bound of every wait for another call (never reached when the calls run at once)


class Lookups:
    """Tool ``lookup(city)`` for the calls ``call-a``, ``call-b``, ``call-c`` of one response (then
    ``ship``, which needs approval, when ``with_approval``; then the answer: the results as JSON).
    The calls reach the journal in ``order``: a tool input guardrail (the agent's own code, run on
    a replay too) waits for its call's turn, given once the call before it was handed to the
    journal (:meth:`handler` wraps ``ctx.call``). Each body waits until all three bodies entered,
    so they run at once or not at all; ``lose`` names a city whose body waits for the other two
    to be recorded, then marks the run lost (its call stays pending, the run is reclaimed)."""

    def __init__(self, order, with_approval=False, lose=None, entered=()):
        self.order, self.with_approval, self.lose = order, with_approval, lose
        self.preset = set(entered)  # bodies taken as entered (replayed calls, on a resume)
        self.made: list[str] = []
        self.journaled: list[str] = []  # the order the lookups were handed to the journal
        self.events: dict[str, asyncio.Event] = {}  # made on the agent's loop, when first asked
        self.loop = None

    def event(self, name):
        if name not in self.events:
            self.events[name] = asyncio.Event()
            if name in (f"turn:{self.order[0]}", *(f"entered:{c}" for c in self.preset)):
                self.events[name].set()
        return self.events[name]

    async def wait(self, name):
        await asyncio.wait_for(self.event(name).wait(), WAIT)

    def durable(self):
        test = self

        def answer(input):
            done = oh.returns(input)
            if not done:
                return oh.response(*(function_call("lookup", {"city": c}, call_id=f"call-{c}") for c in "abc"))
            if len(done) == 3 and test.with_approval:
                return oh.response(function_call("ship", {}, call_id="call-ship"))
            text = json.dumps(sorted(done, key=lambda r: json.dumps(r, sort_keys=True)), sort_keys=True)
            return oh.response(assistant_message(text))

        @tool_input_guardrail
        async def in_turn(data):
            test.loop = asyncio.get_running_loop()
            if data.context.tool_name == "lookup":
                await test.wait(f"turn:{json.loads(data.context.tool_arguments)['city']}")
            return ToolGuardrailFunctionOutput.allow()

        @function_tool(tool_input_guardrails=[in_turn], failure_error_function=None)
        async def lookup(city: str) -> dict:
            test.made.append(city)
            test.event(f"entered:{city}").set()
            for other in "abc":
                await test.wait(f"entered:{other}")
            if city == test.lose:
                for other in set("abc") - {city}:
                    await test.wait(f"recorded:{other}")
                test.lose = None
                test.ctx.mark_lost("test")  # the worker lost the run mid-call
                raise RunAborted("lost in the tool")
            return {"city": city, "key": idempotency_key()}

        @function_tool(needs_approval=True)
        def ship() -> str:
            test.made.append("ship")
            return "shipped"

        agent = Agent(name="cities", model=oh.FakeModel("cities", answer), tools=[lookup, ship])
        return DurableAgent(agent, run_config=oh.NO_TRACING, reconcile={"lookup": lambda args, key: NOT_MADE})

    def handler(self):
        durable, test = self.durable(), self

        class Ctx:
            """The run's context, telling the test when each lookup is handed to the journal
            (the next one's turn) and recorded."""

            def __init__(self, ctx):
                self._ctx = ctx

            def __getattr__(self, name):
                return getattr(self._ctx, name)

            def call(self, tool_name, fn, args, **options):
                if tool_name != "lookup":
                    return self._ctx.call(tool_name, fn, args, **options)
                city = args["city"]
                test.journaled.append(city)
                following = test.order.index(city) + 1
                if following < len(test.order):
                    test.loop.call_soon_threadsafe(test.event(f"turn:{test.order[following]}").set)
                output = self._ctx.call(tool_name, fn, args, **options)
                test.loop.call_soon_threadsafe(test.event(f"recorded:{city}").set)
                return output

        def handler(ctx):
            test.ctx = ctx
            return durable(Ctx(ctx))

        return handler


def scoped_lookups(run_id):
    return sorted(
        (e.scope, e.replay_key[1], e.status) for e in JournalEntry.objects.filter(run_id=run_id, tool_name="lookup")
    )


def lookup_keys(run_id):
    return {e.scope: e.idempotency_key for e in JournalEntry.objects.filter(run_id=run_id, tool_name="lookup")}


@pytest.mark.django_db(transaction=True)
def test_one_response_s_function_calls_run_at_once_and_replay_by_call_id_after_an_approval(community):
    from tests.test_agents_journal_scopes import _approve, _claim

    run_id = new_run(community.id)
    first = Lookups(order=["c", "b", "a"], with_approval=True)
    assert run_claim(_claim(community), first.handler()) == "parked", AgentRun.objects.get(id=run_id).failure_message
    assert first.journaled == ["c", "b", "a"] and sorted(first.made) == ["a", "b", "c"]
    assert scoped_lookups(run_id) == [(f"tool:call-{c}", 1, "succeeded") for c in "abc"]
    _approve(community, run_id)

    again = Lookups(order=["a", "b", "c"], with_approval=True)  # the calls reach the journal in another order
    outcome = run_claim(_claim(community, "w2"), again.handler())
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert again.journaled == ["a", "b", "c"]
    assert again.made == ["ship"]  # no lookup made twice: each replayed from its call's scope
    keys = lookup_keys(run_id)
    assert json.loads(run.output) == ["shipped"] + [{"city": c, "key": keys[f"tool:call-{c}"]} for c in "abc"]
    ship = JournalEntry.objects.get(run_id=run_id, tool_name="ship")
    assert (ship.scope, ship.status) == ("tool:call-ship", "succeeded")


@pytest.mark.django_db(transaction=True)
def test_one_response_s_function_calls_resume_after_a_reclaim_mid_call_making_only_the_lost_one(community):
    from tests.test_agents_journal_scopes import _claim, _reclaim

    run_id = new_run(community.id)
    first = Lookups(order=["c", "b", "a"], lose="c")  # c is lost once a and b are recorded
    assert run_claim(_claim(community), first.handler()) == "lost"
    assert sorted(first.made) == ["a", "b", "c"]
    statuses = {scope: status for scope, _, status in scoped_lookups(run_id)}
    assert statuses == {"tool:call-a": "succeeded", "tool:call-b": "succeeded", "tool:call-c": "pending"}
    _reclaim(run_id)

    again = Lookups(order=["a", "b", "c"], entered="ab")  # a and b replayed: c need not wait for them
    outcome = run_claim(_claim(community, "w2"), again.handler())
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert again.made == ["c"]  # only the call left pending is made (reconciled NOT_MADE), once
    keys = lookup_keys(run_id)
    assert json.loads(run.output) == [{"city": c, "key": keys[f"tool:call-{c}"]} for c in "abc"]
    assert run.tool_calls_used == 5  # model, three lookups, model: nothing journaled twice


class Raising:
    """Tools ``slow`` and ``boom`` of one response: ``boom`` raises once ``slow`` entered; ``slow``
    ends only once the agent's run is over (the SDK cancelled the task awaiting it), so its body
    still runs on the agent's loop when the agent ends."""

    def __init__(self):
        self.made: list[str] = []
        self.events: dict[str, asyncio.Event] = {}

    def event(self, name):
        return self.events.setdefault(name, asyncio.Event())

    def durable(self):
        test = self

        def answer(input):
            if not oh.returns(input):
                return oh.response(function_call("slow", {}, call_id="s"), function_call("boom", {}, call_id="b"))
            return oh.response(assistant_message("never"))

        @function_tool(failure_error_function=None)
        async def slow() -> str:
            test.event("slow").set()
            await asyncio.wait_for(test.event("over").wait(), WAIT)
            test.made.append("slow")
            return "slow"

        @function_tool(failure_error_function=None)
        async def boom() -> str:
            await asyncio.wait_for(test.event("slow").wait(), WAIT)
            test.made.append("boom")
            raise RuntimeError("boom")

        class Over(DurableAgent):
            async def run(self, ctx, journal=None):
                try:
                    return await super().run(ctx, journal)
                finally:
                    test.event("over").set()

        return Over(
            Agent(name="raising", model=oh.FakeModel("raising", answer), tools=[slow, boom]), run_config=oh.NO_TRACING
        )


@pytest.mark.django_db(transaction=True)
def test_a_function_tool_raising_while_another_runs_fails_the_run_with_both_calls_recorded(community):
    from django.db import connections

    from tests.test_agents_journal_scopes import _claim

    run_id = new_run(community.id)
    raising = Raising()
    box: dict = {}

    def handler_thread():
        try:
            box["outcome"] = run_claim(_claim(community), raising.durable())
        finally:
            connections.close_all()

    thread = threading.Thread(target=handler_thread, daemon=True)
    thread.start()
    thread.join(WAIT * 2)
    assert not thread.is_alive(), "the handler's thread still waits for a call's body"
    run = AgentRun.objects.get(id=run_id)
    assert (box["outcome"], run.state, run.failure_code) == ("failed", "failed", "tool_call_failed"), (
        run.failure_message
    )
    assert sorted(raising.made) == ["boom", "slow"]
    statuses = {e.scope: e.status for e in JournalEntry.objects.filter(run_id=run_id) if e.scope}
    assert statuses == {"tool:s": "succeeded", "tool:b": "failed"}  # nothing left pending


@pytest.mark.django_db
def test_a_call_id_holding_the_separator_or_longer_than_64_characters_is_scoped_by_its_sha256(community, ledger):
    ids = ["call/1", "c" * 100, "call_2"]

    def answer(input):
        if not oh.returns(input):
            return oh.response(*(function_call("effect", {"n": n}, call_id=i) for n, i in enumerate(ids, 1)))
        return oh.response(assistant_message("done"))

    durable = DurableAgent(
        Agent(name="ids", model=oh.FakeModel("ids", answer), tools=[oh.effect]),
        run_config=oh.NO_TRACING,
        compensations={"effect": oh.h.undo},
    )
    run_id = new_run(community.id)
    assert run_claim(claim_one(community), durable) == "completed"
    scopes = {e.args["n"]: e.scope for e in JournalEntry.objects.filter(run_id=run_id, tool_name="effect")}
    assert scopes == {
        1: "tool:sha256:" + hashlib.sha256(b"call/1").hexdigest(),
        2: "tool:sha256:" + hashlib.sha256(b"c" * 100).hexdigest(),
        3: "tool:call_2",
    }


@pytest.mark.django_db
def test_a_response_s_usage_is_charged_once_when_its_function_calls_run_at_once(community, ledger):
    """Failed with the calls made at once before the usage was taken when a call starts: each
    call of the response charged the response's 100 tokens (300), the run's cost cap reached 3x
    as fast."""

    def answer(input):
        if not oh.returns(input):
            return oh.response(*(function_call("effect", {"n": n}, call_id=f"c{n}") for n in (1, 2, 3)), tokens=100)
        return oh.response(assistant_message("done"), tokens=100)  # the final usage: charged to no call

    durable = DurableAgent(
        Agent(name="usage", model=oh.FakeModel("usage", answer), tools=[oh.effect]),
        run_config=oh.NO_TRACING,
        compensations={"effect": oh.h.undo},
    )
    run_id = new_run(community.id)
    assert run_claim(claim_one(community), durable) == "completed"
    assert AgentRun.objects.get(id=run_id).cost_used == 100


def test_a_user_s_own_tool_concurrency_is_kept_and_one_at_a_time_only_without_replay_scopes():
    from agents import RunConfig, ToolExecutionConfig

    config = RunConfig(tracing_disabled=True, tool_execution=ToolExecutionConfig(max_function_tool_concurrency=2))
    durable = DurableAgent(oh.three_effects_agent, run_config=config)
    assert durable.run_config.tool_execution.max_function_tool_concurrency == 2  # a runtime with replay scopes
    assert durable.sequential_run_config.tool_execution.max_function_tool_concurrency == 1  # one without
    assert DurableAgent(oh.three_effects_agent).run_config.tool_execution is None  # the SDK's default: all at once


# -- review10: old journals, jsonb's numbers, the usage charge on a replay in another order -----


def effect_then_refund_answer(input):
    """Effect n=1, then a refund (which needs approval), then the answer."""
    done = oh.returns(input)
    if not done:
        return oh.response(function_call("effect", {"n": 1}, call_id="call-1"))
    if len(done) == 1:
        return oh.response(function_call("refund", {"n": 7}, call_id="refund-1"))
    return oh.response(assistant_message(f"answers={done}"))


effect_then_refund = DurableAgent(
    Agent(name="old", model=oh.FakeModel("old", effect_then_refund_answer), tools=[oh.effect, oh.refund]),
    run_config=oh.NO_TRACING,
    compensations={"effect": oh.h.undo},
)


class WithoutScopes:
    """The run's context as the integration saw it before its function calls had scopes of their
    own: it journaled them one at a time in the root scope (as on a runtime without them)."""

    journal_scopes = False

    def __init__(self, ctx):
        self._ctx = ctx

    def __getattr__(self, name):
        return getattr(self._ctx, name)


@pytest.mark.django_db
@pytest.mark.parametrize("index", ["root", "null"])
def test_a_run_journaled_before_function_calls_had_scopes_resumes_making_nothing_twice(community, ledger, index):
    """Failed before: a run parked (or lost) with its function calls journaled in the root scope,
    as the integration did before this change (a deploy while a run waits for its approval),
    was resumed with each call looked up in ``tool:<call_id>``: not found, the effect was made
    again, then the next model request met the effect's root entry (``replay_mismatch``)."""
    run_id = new_run(community.id)
    assert run_claim(claim_one(community), lambda ctx: effect_then_refund(WithoutScopes(ctx))) == "parked"
    assert [(e.scope, e.tool_name) for e in JournalEntry.objects.filter(run_id=run_id).order_by("seq")] == [
        ("", "model:old"), ("", "effect"), ("", "model:old"), ("", "approval"),
    ]  # fmt: skip
    if index == "null":  # written before replay keys: each entry replayed at its seq
        JournalEntry.objects.filter(community_id=community.id, run_id=run_id).update(scope_index=None)
    decide_approval(community.id, AgentRun.objects.get(id=run_id).approval_id, "approved", "alice")
    outcome = run_claim(claim_one(community, "w2"), effect_then_refund)
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert lines(ledger, "call") == [f"call {run_id}:2"]  # the effect made once
    assert lines(ledger, "refund") == [f"refund {run_id}:5"]
    assert run.output == "answers=[{'n': 1}, {'n': 7}]"


@pytest.mark.django_db
def test_a_handler_s_own_call_in_the_agent_s_scope_does_not_make_a_resumed_run_one_at_a_time(community, ledger):
    """The run's function calls in scopes of their own (``tool:<call_id>``) say it was journaled
    by this release, whatever other call the handler made in the agent's scope."""

    def handler(ctx):
        ctx.call("load", lambda args, key: {"loaded": True}, {})
        return effect_then_refund(ctx)

    run_id = new_run(community.id)
    assert run_claim(claim_one(community), handler) == "parked"
    decide_approval(community.id, AgentRun.objects.get(id=run_id).approval_id, "approved", "alice")
    outcome = run_claim(claim_one(community, "w2"), handler)
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert lines(ledger, "call") == [f"call {run_id}:3"]
    assert {e.tool_name: e.scope for e in JournalEntry.objects.filter(run_id=run_id)}["effect"] == "tool:call-1"


@function_tool
def measure(n: int) -> dict:
    """A result with numbers ``jsonb`` reads back in another form (no exponent: an int)."""
    return {"tiny": 1e-7, "big": 1e20, "n": n, "zero": -0.0}


def measure_then_refund_answer(input):
    done = oh.returns(input)
    if not done:
        return oh.response(function_call("measure", {"n": 1}, call_id="call-1"))
    if len(done) == 1:
        return oh.response(function_call("refund", {"n": 7}, call_id="refund-1"))
    return oh.response(assistant_message(f"answers={done}"))


@pytest.mark.django_db
def test_a_tool_result_with_a_float_jsonb_reads_back_as_an_int_resumes_after_an_approval(community, ledger):
    """Failed before: the first run showed the model ``1e+20`` (and ``-0.0``), the resumed run the
    same result as the journal reads it back (``100000000000000000000``, ``0.0``): the next model
    request's digest differed, ``replay_mismatch``."""
    durable = DurableAgent(
        Agent(name="measure", model=oh.FakeModel("measure", measure_then_refund_answer), tools=[measure, oh.refund]),
        run_config=oh.NO_TRACING,
    )
    run_id = new_run(community.id)
    assert run_claim(claim_one(community), durable) == "parked"
    decide_approval(community.id, AgentRun.objects.get(id=run_id).approval_id, "approved", "alice")
    outcome = run_claim(claim_one(community, "w2"), durable)
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert run.output == "answers=[{'n': 1, 'big': 100000000000000000000, 'tiny': 1e-07, 'zero': 0.0}, {'n': 7}]"


class Bearing:
    """One response (100 tokens) with calls ``a`` and ``b`` of tool ``step``; a tool input
    guardrail (the agent's own code, run again on a replay) lets the calls reach the journal in
    ``order``: the second waits until the first's body entered (``lose``: the first's body marks
    the run lost, so the second never reaches the journal)."""

    def __init__(self, order, lose=False):
        self.order, self.lose = order, lose
        self.events: dict[str, asyncio.Event] = {}
        self.made: list[str] = []

    def event(self, name):
        return self.events.setdefault(name, asyncio.Event())

    def durable(self):
        test = self

        def answer(input):
            if not oh.returns(input):
                return oh.response(*(function_call("step", {"name": c}, call_id=f"call-{c}") for c in "ab"), tokens=100)
            return oh.response(assistant_message("done"))

        @tool_input_guardrail
        async def in_turn(data):
            name = json.loads(data.context.tool_arguments)["name"]
            if name != test.order[0]:
                await asyncio.wait_for(test.event(f"entered:{test.order[0]}").wait(), WAIT)
            return ToolGuardrailFunctionOutput.allow()

        @function_tool(tool_input_guardrails=[in_turn], failure_error_function=None)
        async def step(name: str) -> str:
            test.made.append(name)
            test.event(f"entered:{name}").set()
            if test.lose:
                test.ctx.mark_lost("test")
                raise RunAborted("lost in the tool")
            return name

        agent = Agent(name="bearing", model=oh.FakeModel("bearing", answer), tools=[step])
        durable = DurableAgent(agent, run_config=oh.NO_TRACING, reconcile={"step": lambda args, key: NOT_MADE})

        def handler(ctx):
            test.ctx = ctx
            return durable(ctx)

        return handler


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("first", ["a", "b"])
def test_a_response_s_usage_is_charged_once_when_its_calls_reach_the_journal_in_another_order_on_resume(
    community, first
):
    """Failed before: the response's usage went with whichever call reached the journal first.
    The first run's first call took it (journaled, then lost); on the resume the other call came
    first, was made now and charged it again (200). Now it goes with the response's first
    function call (``call-a``), whatever their order."""
    from tests.test_agents_journal_scopes import _claim, _reclaim

    run_id = new_run(community.id)
    second = "b" if first == "a" else "a"
    lost = Bearing(order=[first, second], lose=True)
    assert run_claim(_claim(community), lost.durable()) == "lost"
    assert lost.made == [first]  # the other call never reached the journal
    _reclaim(run_id)
    again = Bearing(order=[second, first])
    outcome = run_claim(_claim(community, "w2"), again.durable())
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert sorted(again.made) == ["a", "b"]
    assert run.cost_used == 100


@pytest.mark.django_db
def test_a_run_journaled_one_call_at_a_time_charges_a_response_s_usage_as_it_did_when_resumed(community, ledger):
    """A response asking for a refund (which needs approval) and an effect, journaled one call at
    a time as an earlier release did: the effect, made first, charged the response's usage; the
    approved refund, made on the resume, does not charge it again (it did with the usage going
    to the response's first function call whatever the run's form: 200)."""

    def answer(input):
        done = oh.returns(input)
        if not done:
            calls = (
                function_call("refund", {"n": 7}, call_id="refund-1"),
                function_call("effect", {"n": 1}, call_id="c1"),
            )
            return oh.response(*calls, tokens=100)
        return oh.response(assistant_message(f"answers={done}"))

    durable = DurableAgent(
        Agent(name="old-usage", model=oh.FakeModel("old-usage", answer), tools=[oh.refund, oh.effect]),
        run_config=oh.NO_TRACING,
        compensations={"effect": oh.h.undo},
    )
    run_id = new_run(community.id)
    assert run_claim(claim_one(community), lambda ctx: durable(WithoutScopes(ctx))) == "parked"
    assert AgentRun.objects.get(id=run_id).cost_used == 100
    decide_approval(community.id, AgentRun.objects.get(id=run_id).approval_id, "approved", "alice")
    outcome = run_claim(claim_one(community, "w2"), durable)
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert (lines(ledger, "call"), run.cost_used) == ([f"call {run_id}:2"], 100)


UNDO_BOUND = 3


@pytest.mark.django_db(transaction=True)
def test_under_the_event_loop_worker_a_sibling_failing_never_undoes_a_call_whose_tool_still_runs(community, ledger):
    """Calls ``slow`` (a sync tool: the SDK runs it on a thread) and ``other`` of one response;
    ``other``'s input guardrail raises once ``slow``'s tool runs, and the SDK cancels ``slow``'s
    task. Failed before: its call was left pending (its thread ran on), the run failed and
    compensated it, then the tool made its effect (``undo`` before ``call`` in the ledger)."""
    from buzz_delivery.agents import loop_worker

    entered, release = threading.Event(), threading.Event()

    def answer(input):
        if not oh.returns(input):
            return oh.response(function_call("slow", {"n": 1}, call_id="s"), function_call("other", {}, call_id="o"))
        return oh.response(assistant_message("never"))

    @function_tool(failure_error_function=None)
    def slow(n: int) -> dict:
        entered.set()
        release.wait(WAIT)
        return oh.h.effect({"n": n}, idempotency_key())

    @tool_input_guardrail
    async def broken(data):
        await asyncio.to_thread(entered.wait, WAIT)
        raise RuntimeError("the guardrail's service is down")

    @function_tool(tool_input_guardrails=[broken], failure_error_function=None)
    def other() -> str:
        return "other"

    durable = DurableAgent(
        Agent(name="cancelled", model=oh.FakeModel("cancelled", answer), tools=[slow, other]),
        run_config=oh.NO_TRACING,
        compensations={"slow": oh.h.undo},
    )
    run_id = new_run(community.id)

    def releaser():
        from django.db import connections

        # The tool's effect waits for its call to be undone (the bug: at once), for at most
        # UNDO_BOUND seconds (fixed, the run waits for the tool: never undone before it ends).
        try:
            for _ in range(UNDO_BOUND * 20):
                if lines(ledger, "undo"):
                    break
                threading.Event().wait(0.05)
        finally:
            release.set()
            connections.close_all()

    watcher = threading.Thread(target=releaser, daemon=True)
    config = loop_worker.AsyncWorkerConfig(
        handler=durable.run,
        agents=[AGENT],
        communities=[community.id],
        exit_when_idle=True,
        poll_seconds=0.1,
        lease_seconds=15,
        worker_id="aio-cancelled",
    )
    entered_watch = threading.Thread(target=lambda: (entered.wait(WAIT), watcher.start()), daemon=True)
    entered_watch.start()
    loop_worker.AsyncAgentWorker(config).run()
    release.set()
    watcher.join(WAIT)
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == ("failed", "handler_error"), run.failure_message
    # The call recorded once its tool ended, then compensated (before: undo, then the effect).
    assert [x.split()[0] for x in ledger.read_text().splitlines()] == ["call", "undo"]
    assert entries(run_id) == [(1, "tool", "model:cancelled", "succeeded"), (2, "tool", "slow", "succeeded")]
