"""Pydantic AI: which call a model response's usage is charged with (real PostgreSQL, a
``FunctionModel``). The tool calls of one response run at once; the usage goes with one of them.
It must be the same call on a resumed run as on the first, whatever order the calls reach the
journal in (the agent's own capabilities run again, and may take another time): else a resumed
run charges it twice (the call that took it was journaled, another is made now and takes it
again) or never."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from buzz_delivery.agents.exceptions import RunAborted
from buzz_delivery.agents.integrations.pydantic_ai import DurableAgent
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import NOT_MADE, run_claim
from tests.agents_support import new_run
from tests.test_agents_journal_scopes import _claim, _reclaim

WAIT = 30


@dataclasses.dataclass
class InTurn(AbstractCapability):
    """The agent's own capability: before a ``step`` call runs, the second call of ``order``
    waits until the first's body entered (a policy check taking its time, say)."""

    test: object = None

    async def before_tool_execute(self, ctx, *, call, tool_def, args):
        test = self.test
        if call.tool_name == "step" and args["name"] != test.order[0]:
            await asyncio.wait_for(test.event(f"entered:{test.order[0]}").wait(), WAIT)
        return args


class Bearing:
    """One response (usage cost 100) with calls ``a`` and ``b`` of tool ``step``, reaching the
    journal in ``order``; ``lose``: the first's body marks the run lost (the other call never
    reaches the journal)."""

    def __init__(self, order, lose=False):
        self.order, self.lose = order, lose
        self.events: dict[str, asyncio.Event] = {}
        self.made: list[str] = []

    def event(self, name):
        return self.events.setdefault(name, asyncio.Event())

    def handler(self):
        test = self

        def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            if not any(m.kind == "response" for m in messages):
                return ModelResponse(parts=[ToolCallPart("step", {"name": c}, tool_call_id=f"call-{c}") for c in "ab"])
            return ModelResponse(parts=[TextPart("done")])

        agent = Agent(FunctionModel(model, model_name="bearing"), capabilities=[InTurn(test=test)])

        @agent.tool_plain
        async def step(name: str) -> str:
            test.made.append(name)
            test.event(f"entered:{name}").set()
            if test.lose:
                test.ctx.mark_lost("test")
                raise RunAborted("lost in the tool")
            return name

        durable = DurableAgent(agent, reconcile={"step": lambda args, key: NOT_MADE}, usage_cost=lambda usage: 100)

        def handler(ctx):
            test.ctx = ctx
            return durable(ctx)

        return handler


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("first", ["a", "b"])
def test_a_response_s_usage_is_charged_once_when_its_calls_reach_the_journal_in_another_order_on_resume(
    community, first
):
    run_id = new_run(community.id)
    second = "b" if first == "a" else "a"
    lost = Bearing(order=[first, second], lose=True)
    assert run_claim(_claim(community), lost.handler()) == "lost"
    assert lost.made == [first]  # the other call never reached the journal
    _reclaim(run_id)
    again = Bearing(order=[second, first])
    outcome = run_claim(_claim(community, "w2"), again.handler())
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert sorted(again.made) == ["a", "b"]
    costs = {e.args["name"]: e.cost for e in JournalEntry.objects.filter(run_id=run_id, tool_name="step")}
    assert run.cost_used == 100, costs  # the tool calls' response, once (the final one is charged to none)


@pytest.mark.django_db(transaction=True)
def test_a_run_journaled_by_the_release_that_charged_the_first_call_to_reach_the_journal_is_not_charged_again(
    community, monkeypatch
):
    """Failed before: the previous release charged a response's usage with the first of its calls
    to reach the journal (``b``, ``a`` held back by the agent's own capability), then the run was
    lost; resumed by this one, the usage went with the first call validated (``a``, made now):
    charged again (200 for 100). A call of the response journaled with more than its tool cost
    took the usage: it stays the bearer."""
    from buzz_delivery.agents.integrations import pydantic_ai

    async def previous_release(self, ctx, *, call, tool_def, args):  # no bearer named: the first to reach
        return args

    run_id = new_run(community.id)
    with monkeypatch.context() as patch:
        patch.setattr(pydantic_ai._Durability, "after_tool_validate", previous_release)
        lost = Bearing(order=["b", "a"], lose=True)
        assert run_claim(_claim(community), lost.handler()) == "lost"
    assert lost.made == ["b"]
    costs = {e.args["name"]: e.cost for e in JournalEntry.objects.filter(run_id=run_id, tool_name="step")}
    assert costs == {"b": 100}  # the previous release's journal: b took the usage
    _reclaim(run_id)
    again = Bearing(order=["a", "b"])
    outcome = run_claim(_claim(community, "w2"), again.handler())
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    costs = {e.args["name"]: e.cost for e in JournalEntry.objects.filter(run_id=run_id, tool_name="step")}
    assert run.cost_used == 100, costs
