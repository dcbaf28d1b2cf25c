"""OpenAI Agents SDK agents run by the integration's tests (in-process and by ``run_agent_worker``
subprocesses), on a fake ``Model`` subclass (no network, no API key) that answers from the input
items it is given, like Pydantic AI's ``FunctionModel``. Model requests and tool effects go to the
ledger of :mod:`tests.agent_handlers` (``model <key>`` per model request actually made, ``call
<key>`` per effect), so a test counts how often each really happened; ``AGENT_KILL`` points
``model:<k>`` (inside model request k, before it is made) and the tool's
``inside_before_effect:<n>``/``inside_after_effect:<n>`` kill the process once."""

from __future__ import annotations

import ast
import asyncio
import re
from collections.abc import Callable
from typing import Any

from agents import Agent, RunConfig, function_tool
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.testing import ScriptedModel, assistant_message, function_call
from agents.usage import Usage

from buzz_delivery.agents.integrations.openai_agents import DurableAgent, idempotency_key
from tests import agent_handlers as h

NO_TRACING = RunConfig(tracing_disabled=True)


def returns(input: Any) -> list[Any]:
    """The tool results the model was given (the tool's JSON as the SDK shows it: ``str()``)."""
    items = input if isinstance(input, list) else []
    outputs = [i["output"] for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"]
    return [ast.literal_eval(o) if o.startswith(("{", "[")) else o for o in outputs]


class FakeModel(Model):
    """``answer(input) -> ModelResponse`` as the model: the test's script, no network."""

    def __init__(self, name: str, answer: Callable[[Any], ModelResponse]) -> None:
        self.model, self.answer = name, answer

    async def get_response(
        self, system_instructions, input, model_settings, tools, output_schema, handoffs, tracing, **_
    ):  # type: ignore[no-untyped-def]
        return self.answer(input)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def response(*output: Any, tokens: int = 0) -> ModelResponse:
    usage = Usage(requests=1, input_tokens=tokens, output_tokens=0, total_tokens=tokens)
    return ModelResponse(output=list(output), usage=usage, response_id=None)


def three_effects_answer(input: Any) -> ModelResponse:
    """Asks for effect n=1, 2, 3 one at a time, then answers with their sum."""
    done = [r for r in returns(input) if isinstance(r, dict) and "n" in r]  # a handoff's output is not one
    h._maybe_die("model", len(done) + 1)
    h._write(f"model {idempotency_key()}")
    if len(done) < 3:
        n = len(done) + 1
        return response(function_call("effect", {"n": n}, call_id=f"call-{n}"), tokens=100)
    return response(assistant_message(f"sum={sum(r['n'] for r in done)} keys={len(done)}"), tokens=100)


@function_tool
def effect(n: int) -> dict:
    """The tool: a ledger line ``call <journal key>`` (idempotent by key)."""
    return h.effect({"n": n}, idempotency_key())


three_effects_agent = Agent(name="three", model=FakeModel("three-effects", three_effects_answer), tools=[effect])

three_effects = DurableAgent(
    three_effects_agent,
    run_config=NO_TRACING,
    compensations={"effect": h.undo},
    reconcile={"effect": h.reconcile},
)

budgeted = DurableAgent(
    three_effects_agent,
    run_config=NO_TRACING,
    compensations={"effect": h.undo},
    reconcile={"effect": h.reconcile},
    tool_costs={"effect": 1},
)


def approval_answer(input: Any) -> ModelResponse:
    """Asks for one refund (a tool that needs approval), then says what came back."""
    h._write(f"model {idempotency_key()}")
    done = returns(input)
    if not done:
        return response(function_call("refund", {"n": 7}, call_id="refund-1"))
    return response(assistant_message(f"answers={done}"))


@function_tool(needs_approval=True)
def refund(n: int) -> dict:
    h._write(f"refund {idempotency_key()}")
    return {"n": n}


approval = DurableAgent(
    Agent(name="approval", model=FakeModel("approval", approval_answer), tools=[refund]), run_config=NO_TRACING
)


def narrating_answer(input: Any) -> ModelResponse:
    """Says what it is about to do and asks for effect n=1, then answers."""
    if not returns(input):
        return response(assistant_message("Looking it up. "), function_call("effect", {"n": 1}, call_id="call-1"))
    return response(assistant_message("Found 1."))


narrating = DurableAgent(
    Agent(name="narrating", model=FakeModel("narrating", narrating_answer), tools=[effect]),
    run_config=NO_TRACING,
    compensations={"effect": h.undo},
    stream_text=True,
)


class StreamingModel(FakeModel):
    """A model that streams (``stream_response``): the events the SDK's ``ScriptedModel`` makes of
    the answer, with each text delta split at its spaces (one event per word)."""

    async def stream_response(self, system_instructions, input, *args, **kwargs):  # type: ignore[no-untyped-def]
        h._write(f"model {idempotency_key()}")
        scripted = ScriptedModel([self.answer(input)])
        async for event in scripted.stream_response(system_instructions, input, *args, **kwargs):
            if event.type != "response.output_text.delta":
                yield event
                continue
            for word in re.findall(r"\S+\s*", event.delta):
                yield event.model_copy(update={"delta": word})


streaming = DurableAgent(
    Agent(name="streaming", model=StreamingModel("streaming", narrating_answer), tools=[effect]),
    run_config=NO_TRACING,
    compensations={"effect": h.undo},
    stream_text="tokens",
)


def asking_answer(input: Any) -> ModelResponse:
    """Says it asks first and asks for a refund (which needs approval), then says what came back."""
    done = returns(input)
    if not done:
        return response(assistant_message("Asking first. "), function_call("refund", {"n": 7}, call_id="refund-1"))
    return response(assistant_message(f"Refunded {done[0]['n']}."))


streaming_approval = DurableAgent(
    Agent(name="asking", model=StreamingModel("asking", asking_answer), tools=[refund]),
    run_config=NO_TRACING,
    stream_text="tokens",
)


def triage_answer(input: Any) -> ModelResponse:
    """Hands the conversation to the ``billing`` agent (the SDK's handoff tool)."""
    h._write(f"model {idempotency_key()}")
    return response(function_call("transfer_to_billing", {}, call_id="handoff-1"))


billing_agent = Agent(name="billing", model=FakeModel("billing", three_effects_answer), tools=[effect])
handing_off = DurableAgent(
    Agent(name="triage", model=FakeModel("triage", triage_answer), handoffs=[billing_agent]),
    run_config=NO_TRACING,
    compensations={"effect": h.undo},
)


def slow_answer(input: Any) -> ModelResponse:
    """Asks for the slow tool once, then repeats what came back."""
    done = returns(input)
    if not done:
        return response(function_call("slow", {"n": 1}, call_id="slow-1"))
    return response(assistant_message(str(done[0])))


@function_tool(timeout=0.05)
async def slow(n: int) -> dict:
    await asyncio.sleep(30)
    return {"n": n}


timing_out = DurableAgent(Agent(name="slow", model=FakeModel("slow", slow_answer), tools=[slow]), run_config=NO_TRACING)
