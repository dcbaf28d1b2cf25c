"""Pydantic AI agents run by the integration's tests (in-process and by ``run_agent_worker``
subprocesses), on ``FunctionModel`` (no network). Model requests and tool effects go to the
ledger of :mod:`tests.agent_handlers` (``model <key>`` per model request actually made, ``call
<key>`` per effect, by journal key), so a test counts how often each really happened; ``AGENT_KILL`` points
``model:<k>`` (inside model request k, before it is made) and the tool's
``inside_before_effect:<n>``/``inside_after_effect:<n>`` kill the process once."""

from __future__ import annotations

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

from buzz_delivery.agents.integrations.pydantic_ai import DurableAgent, idempotency_key
from tests import agent_handlers as h


def _returns(messages: list[ModelMessage]) -> list[dict]:
    return [p.content for m in messages if m.kind == "request" for p in m.parts if p.part_kind == "tool-return"]


def _requests(messages: list[ModelMessage]) -> int:
    return sum(1 for m in messages if m.kind == "response") + 1


def three_effects_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Asks for effect n=1, 2, 3 one at a time, then answers with their sum."""
    k = _requests(messages)
    h._maybe_die("model", k)
    h._write(f"model {idempotency_key()}")
    done = _returns(messages)
    if len(done) < 3:
        n = len(done) + 1
        return ModelResponse(parts=[ToolCallPart("effect", {"n": n}, tool_call_id=f"call-{n}")])
    return ModelResponse(parts=[TextPart(f"sum={sum(r['n'] for r in done)} keys={len(done)}")])


three_effects_agent = Agent(FunctionModel(three_effects_model, model_name="three-effects"))


@three_effects_agent.tool_plain
def effect(n: int) -> dict:
    """The tool: a ledger line ``call <journal key>`` (idempotent by key)."""
    return h.effect({"n": n}, idempotency_key())


three_effects = DurableAgent(
    three_effects_agent,
    compensations={"effect": h.undo},
    reconcile={"effect": h.reconcile},
)


def approval_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Asks for one refund (a tool that requires approval), then says what came back."""
    k = _requests(messages)
    h._write(f"model {idempotency_key()}")
    done = _returns(messages)
    if k == 1:
        return ModelResponse(parts=[ToolCallPart("refund", {"n": 7}, tool_call_id="refund-1")])
    return ModelResponse(parts=[TextPart(f"answers={done}")])  # a denial comes back as the tool's answer


approval_agent = Agent(FunctionModel(approval_model, model_name="approval"))


@approval_agent.tool_plain(requires_approval=True)
def refund(n: int) -> dict:
    h._write(f"refund {idempotency_key()}")
    return {"n": n}


approval = DurableAgent(approval_agent)

budgeted = DurableAgent(
    three_effects_agent,
    compensations={"effect": h.undo},
    reconcile={"effect": h.reconcile},
    usage_cost=lambda usage: 100,
    tool_costs={"effect": 1},
)


def narrating_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Says what it is about to do and asks for effect n=1, then answers."""
    if not _returns(messages):
        return ModelResponse(
            parts=[TextPart("Looking it up. "), ToolCallPart("effect", {"n": 1}, tool_call_id="call-1")]
        )
    return ModelResponse(parts=[TextPart("Found 1.")])


narrating_agent = Agent(FunctionModel(narrating_model, model_name="narrating"))
narrating_agent.tool_plain(effect)

narrating = DurableAgent(narrating_agent, compensations={"effect": h.undo}, stream_text=True)


async def streaming_model(messages: list[ModelMessage], info: AgentInfo):
    """A streamed model (``FunctionModel(stream_function=...)``): says it is looking, asks for
    effect n=1, then answers in three deltas; ``AGENT_KILL=stream:2`` kills the process inside
    the answer, after its first two deltas."""
    h._write(f"model {idempotency_key()}")
    if not _returns(messages):
        yield "Looking "
        yield "it up. "
        yield {1: DeltaToolCall(name="effect", json_args='{"n": 1}', tool_call_id="call-1")}
        return
    yield "Found "
    yield "it: "
    h._maybe_die("stream", 2)
    yield "1."


streaming_agent = Agent(FunctionModel(stream_function=streaming_model, model_name="streaming"))
streaming_agent.tool_plain(effect)

streaming = DurableAgent(
    streaming_agent, compensations={"effect": h.undo}, reconcile={"effect": h.reconcile}, stream_text="tokens"
)
