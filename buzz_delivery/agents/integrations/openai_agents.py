"""Run an OpenAI Agents SDK agent (``openai-agents``, package ``agents``) as an agent run's
handler, durably, on the run's journal (issue 35).

    from agents import Agent
    from buzz_delivery.agents.integrations.openai_agents import DurableAgent

    agent = Agent(name="billing", instructions="...", tools=[charge])
    handler = DurableAgent(agent, compensations={"charge": refund})   # run_agent_worker --handler mod:handler

Every model request and every function tool call of the agent is one journaled call made through
the runtime's ``ctx.call`` (fenced by the run's lease, journaled before it is made, its result
recorded): a resumed run runs the agent again from the start and each recorded response and tool
result is replayed instead of being made again. Built on the SDK's public interface only:

- Model requests: a :class:`~agents.models.interface.Model` wrapper whose ``get_response`` is the
  journaled call, put in place by a ``ModelProvider`` wrapper (``RunConfig(model_provider=...)``,
  for models named by a string) and on every agent whose ``model`` is a ``Model`` instance
  (clones, with their handoffs). Journaled as ``model:<name>`` with the SHA-256 of the request
  (instructions, input items, tool and handoff names, output schema) as arguments; the
  ``ModelResponse`` is recorded as JSON (pydantic's ``TypeAdapter``) and rebuilt from it, on the
  first run as on a replay. A request left pending by a crashed holder is made again.
- Function tools: each ``FunctionTool``'s ``on_invoke_tool`` is wrapped (``dataclasses.replace``):
  journaled under the tool's name with its arguments (the model's JSON, parsed); the result is
  recorded as JSON and the model sees that JSON (first run and replay alike, an object's keys in
  the order ``jsonb`` gives them back: ``as_stored``). The function calls of one response run at
  once, as the SDK runs them (a user's ``max_function_tool_concurrency`` is kept): each is
  journaled in a replay scope of its own named by its ``call_id`` (``tool:<call_id>``, a long id
  or one holding ``/`` by its SHA-256: ``journal_scope.tool_call``, shared with Pydantic AI), part
  of the recorded response, so a resumed run replays each call from its scope's entry whatever
  order the calls reach the journal in (``docs/agents.md`` "Resume"). Under the threaded runtime
  each call is journaled by the handler's thread while the bodies run together on the agent's
  loop; under the event-loop runtime they are in flight at once too (only their journal writes
  are one at a time); under the remote worker (its context has replay scopes too) as under the
  threaded runtime. On a runtime context without replay scopes (a custom one) the tools run one
  at a time, in the order of the response (``max_function_tool_concurrency=1``). A tool's
  ``timeout_seconds`` is applied inside its journaled call, to a tool with no thread it started
  still running then: one with (``asyncio.to_thread``) is cut only once its threads have ended
  and the timeout has passed again (no cancel stops a thread: its effect would come after the
  call was recorded as timed out). The SDK never runs two calls of one ``call_id`` (a reuse for
  other arguments fails the run, an identical one is made once). Inside a tool, :func:`idempotency_key` is the journal's
  key for the call. Whatever runs inside a journaled call (an agent used as a tool:
  ``Agent.as_tool``) is part of that call and is not journaled again; a durable agent a tool runs
  on a thread (``handler(ctx)`` in ``asyncio.to_thread``) is journaled, nested in the call's
  scope, and cannot ask for an approval (``ApprovalBlockedByCalls``, at once).
- Approvals: a tool with ``needs_approval`` interrupts the SDK's run; each interruption parks the
  run on ``ctx.request_approval`` and the operator's decision resumes it (``RunState.approve`` /
  ``reject`` on ``result.to_state()``, then ``Runner.run`` with that state).
- Budgets: every model request and tool call spends one of the run's tool-call slots; cost:
  ``tool_costs[name]`` per tool call, ``request_cost`` per request, and ``usage_cost(usage)`` of
  each response (default its input + output tokens) charged with the next journaled call.
- Not supported (``ValueError`` when the handler is built): local tools other than function
  tools (computer, shell, apply-patch, custom tools) and MCP servers (their tools are listed at
  run time and would not be journaled). Hosted tools (web search, file search, ...) run on the
  provider's side: they are part of the recorded response. Guardrails and lifecycle hooks are the
  agent's own code: they run again on a replay.
- Streaming: ``stream_text=True`` writes each response's text to the run's output stream as one
  chunk; ``stream_text="tokens"`` asks the wrapped model with ``stream_response`` inside the
  journaled call, writes each ``response.output_text.delta`` as a chunk while it runs and records
  the ``ModelResponse`` built from the ``response.completed`` event (a replay writes no chunk
  again; an interrupted request made again writes a marker after its partial chunks, as Pydantic
  AI's token mode). The SDK itself is always run with ``Runner.run``: ``Runner.run_streamed``
  (its own event stream to a caller) is not offered, the wrapper's ``stream_response`` raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import hashlib
import json
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any, Literal

from agents import Agent, Handoff, Model, ModelProvider, RunConfig, Runner, ToolExecutionConfig
from agents.items import ModelResponse
from agents.models.multi_provider import MultiProvider
from agents.tool import (
    CodeInterpreterTool,
    FileSearchTool,
    FunctionTool,
    HostedMCPTool,
    ImageGenerationTool,
    ToolSearchTool,
    WebSearchTool,
)
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall
from pydantic import TypeAdapter
from pydantic_core import to_jsonable_python

from buzz_delivery.agents import compensations as registry
from buzz_delivery.agents.exceptions import AgentError
from buzz_delivery.agents.integrations.journal import (
    Durability,
    Journal,
    JournalOptions,
    as_stored,
    idempotency_key,
    inside_call,
    journal_for,
    keyed,
    noting_threads,
    reconciler,
    remake,
    run_threaded,
    tool_call_scope,
)
from buzz_delivery.exceptions import in_chain

__all__ = ["DurableAgent", "idempotency_key", "tokens"]

PROMPT_MAX_CHARS = 2000
HOSTED_TOOLS = (FileSearchTool, WebSearchTool, HostedMCPTool, ImageGenerationTool, CodeInterpreterTool, ToolSearchTool)
_responses: TypeAdapter[ModelResponse] = TypeAdapter(ModelResponse)


def tokens(usage: Usage) -> int:
    """Default ``usage_cost``: one cost unit per input or output token."""
    return int(usage.input_tokens or 0) + int(usage.output_tokens or 0)


def dump_response(response: ModelResponse) -> dict[str, Any]:
    return _responses.dump_python(response, mode="json", by_alias=True)  # type: ignore[no-any-return]


def load_response(data: Any) -> ModelResponse:
    return _responses.validate_python(data)


def request_digest(
    system_instructions: str | None, input: Any, tools: list[Any], handoffs: list[Any], output_schema: Any
) -> str:
    """SHA-256 of what a model request asks: the same on a replay, which rebuilds the same input
    items from the recorded responses and tool results."""
    data = {
        "instructions": system_instructions,
        "input": to_jsonable_python(input, fallback=str),
        "tools": [getattr(t, "name", type(t).__name__) for t in tools],
        "handoffs": [getattr(h, "tool_name", "") for h in handoffs],
        "output": output_schema.json_schema()
        if output_schema is not None and not output_schema.is_plain_text()
        else None,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _response_text(response: ModelResponse) -> str:
    return "".join(
        part.text
        for item in response.output
        if getattr(item, "type", None) == "message"
        for part in getattr(item, "content", ())
        if getattr(part, "type", None) == "output_text"
    )


class _Durability(Durability):
    """One run's journal, as the model and tool wrappers see it (a context variable of the run's
    task: the SDK's tool tasks inherit it)."""

    owner: DurableAgent

    async def received(self, recorded: Any, mark: int) -> ModelResponse:
        """A response, made now or replayed: its usage is charged with the next call; its text
        goes to the output stream whole (``stream_text=True``), or was streamed while it was made
        (``"tokens"``: a replay counts the chunks it wrote, none is written again)."""
        if isinstance(recorded, dict) and "streamed_chunks" in recorded:
            await self.chunks.count(int(recorded["streamed_chunks"]) - self.chunks.since(mark))
            recorded = recorded["response"]
        response = load_response(recorded)
        self.uncharged += max(0, int(self.owner.usage_cost(response.usage)))
        # Its usage goes with its first function call (in the response's order) or, that call
        # not made (an approval's interruption, a rejection), the next model request. Calls made
        # one at a time (no scopes of their own: a run an earlier release journaled so) charge
        # it with the first made, as that release did.
        calls = (
            item.call_id
            for item in response.output
            if isinstance(item, ResponseFunctionToolCall) and item.name in self.owner.function_tools
        )
        self.bearer = next(calls, None) if self.parallel else None
        if self.owner.stream_text is True:
            await self.chunks.emit(_response_text(response))
        return response

    async def streamed(self, events: Any, mark: int) -> dict[str, Any]:
        """Token mode's body: drain the model's ``stream_response``, writing each text delta to the
        output stream; the recorded response is the one its ``response.completed`` event carries."""
        await self.chunks.restart()
        completed = None
        async for event in events:
            kind = getattr(event, "type", None)
            if kind == "response.output_text.delta":
                await self.chunks.emit(event.delta)
            elif kind == "response.completed":
                completed = event.response
            elif kind in ("response.failed", "response.incomplete", "error"):
                raise RuntimeError(f"the model's stream ended with {kind}")
        if completed is None:
            raise RuntimeError("the model's stream ended without a response.completed event")
        usage = Usage(requests=1)
        if completed.usage is not None:
            u = completed.usage
            usage = Usage(
                requests=1,
                input_tokens=u.input_tokens,
                input_tokens_details=u.input_tokens_details,
                output_tokens=u.output_tokens,
                output_tokens_details=u.output_tokens_details,
                total_tokens=u.total_tokens,
            )
        response = ModelResponse(output=list(completed.output), usage=usage, response_id=completed.id)
        return {"response": dump_response(response), "streamed_chunks": self.chunks.since(mark)}


_active: contextvars.ContextVar[_Durability | None] = contextvars.ContextVar("buzz_openai_agents_run", default=None)


class _JournaledModel(Model):
    """A model whose every ``get_response`` is a journaled call of the current run."""

    def __init__(self, wrapped: Model, name: str | None = None) -> None:
        self.wrapped = wrapped
        model = getattr(wrapped, "model", None)
        self.name = name or (model if isinstance(model, str) else type(wrapped).__name__)

    async def get_response(
        self,
        system_instructions: str | None,
        input: Any,
        model_settings: Any,
        tools: list[Any],
        output_schema: Any,
        handoffs: list[Any],
        tracing: Any,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: Any,
    ) -> ModelResponse:
        request = (system_instructions, input, model_settings, tools, output_schema, handoffs, tracing)
        named = {"previous_response_id": previous_response_id, "conversation_id": conversation_id, "prompt": prompt}
        durability: _Durability | None = _active.get()
        if durability is None or inside_call():
            return await self.wrapped.get_response(*request, **named)
        mark = durability.chunks.mark()

        async def body(args: Any, key: str) -> Any:
            with keyed(key):
                if durability.owner.stream_text == "tokens":
                    return await durability.streamed(self.wrapped.stream_response(*request, **named), mark)
                return dump_response(await self.wrapped.get_response(*request, **named))

        args = {
            "items": len(input) if isinstance(input, list) else 1,
            "sha256": request_digest(system_instructions, input, tools, handoffs, output_schema),
        }
        recorded = await durability.call(
            f"model:{self.name}"[:200], body, args, durability.owner.request_cost, reconcile=remake
        )
        return await durability.received(recorded, mark)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a durable run asks its model with get_response (Runner.run), not streamed")

    def get_retry_advice(self, request: Any) -> Any:
        return self.wrapped.get_retry_advice(request)

    async def close(self) -> None:
        await self.wrapped.close()


class _JournaledProvider(ModelProvider):
    """Wraps the models another provider resolves by name."""

    def __init__(self, wrapped: ModelProvider) -> None:
        self.wrapped = wrapped

    def get_model(self, model_name: str | None) -> Model:
        model = self.wrapped.get_model(model_name)
        return model if isinstance(model, _JournaledModel) else _JournaledModel(model, model_name or None)

    async def aclose(self) -> None:
        await self.wrapped.aclose()


def _tool_args(input_json: str) -> Any:
    try:
        return json.loads(input_json) if input_json else {}
    except ValueError:
        return {"arguments": input_json}  # the model's text as it came: the tool reports the error


def _journaled_tool(tool: FunctionTool, owner: DurableAgent) -> FunctionTool:
    original, name = tool.on_invoke_tool, tool.name
    timeout, behavior, on_timeout = tool.timeout_seconds, tool.timeout_behavior, tool.timeout_error_function

    async def invoke_now(tool_context: Any, input_json: str) -> Any:
        if timeout is None:
            return await original(tool_context, input_json)
        return await timed(tool_context, input_json, timeout)

    async def timed(tool_context: Any, input_json: str, seconds: float) -> Any:
        """The tool within ``seconds``: cut at the timeout (the timeout's outcome: its message,
        or ``TimeoutError``) unless a thread it started (``asyncio.to_thread``) still runs then
        (a cancel stops no thread, its effect could come after the call was recorded as timed
        out): then it is waited for until its threads have ended, and given ``seconds`` more
        (its true result, when it ends in them). A thread that has ended (a host name resolved
        by an HTTP client) keeps no tool from its timeout: it makes no effect after the call;
        nor does one still queued (every worker of the executor busy): it is cancelled."""
        with noting_threads(asyncio.get_running_loop()) as threads:  # the tool's task's own
            tool = asyncio.ensure_future(original(tool_context, input_json))
        try:
            while True:
                await asyncio.wait({tool}, timeout=seconds)
                if tool.done():
                    return await tool
                # A thread still queued (the executor's workers busy) is cancelled: it never runs.
                running = [asyncio.wrap_future(t) for t in threads if not t.cancel() and not t.done()]
                if not running:
                    break
                while not tool.done() and (running := [thread for thread in running if not thread.done()]):
                    await asyncio.wait({tool, *running}, return_when=asyncio.FIRST_COMPLETED)
                if tool.done():
                    return await tool
        except BaseException:
            tool.cancel()
            raise
        tool.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tool
        if tool.cancelled():
            exc = TimeoutError()
        elif tool.exception() is None:  # it ended as it was cut: its result stands
            return tool.result()
        else:
            raise tool.exception()  # type: ignore[misc]
        if behavior == "raise_exception":
            raise exc
        if on_timeout is not None:
            message = on_timeout(tool_context, exc)
            return await message if asyncio.iscoroutine(message) else message
        return f"Tool '{name}' timed out after {timeout} seconds."

    async def on_invoke_tool(tool_context: Any, input_json: str) -> Any:
        durability: _Durability | None = _active.get()
        if durability is None or inside_call():
            return await invoke_now(tool_context, input_json)

        async def body(args: Any, key: str) -> Any:
            with keyed(key):
                result = await invoke_now(tool_context, input_json)
            return {"return": to_jsonable_python(result, fallback=str)}

        # The response's function calls run at once (the SDK's tasks): each is journaled in the
        # scope of its call_id (part of the recorded response), replayed from that scope's entry
        # whatever order the calls reach the journal in.
        call_id = getattr(tool_context, "tool_call_id", None)
        with tool_call_scope(durability.parallel, call_id):
            recorded = await durability.call(
                name,
                body,
                _tool_args(input_json),
                owner.tool_costs.get(name, 0),
                call_id=call_id or "",
                compensate=owner.compensations.get(name),
                reconcile=reconciler(owner.reconcile.get(name)),
                destructive=name in owner.destructive,
            )
        if recorded is None:  # a shadow run's destructive call: blocked, not made
            return f"The call to {name} was not made (shadow run)."
        # As a replay reads it back: the SDK shows the model str() of it, which the next
        # request's digest covers, so its objects' key order must not change on a replay.
        return as_stored(recorded["return"])

    return dataclasses.replace(tool, on_invoke_tool=on_invoke_tool, timeout_seconds=None)


class _Wrapper:
    """Clones an agent graph (handoffs included, cycles too) with journaled models and tools."""

    def __init__(self, owner: DurableAgent) -> None:
        self.owner = owner
        self.clones: dict[int, Agent[Any]] = {}

    def agent(self, agent: Agent[Any]) -> Agent[Any]:
        if id(agent) in self.clones:
            return self.clones[id(agent)]
        if agent.mcp_servers:
            raise ValueError(
                f"mcp_servers: agent {agent.name!r} lists MCP servers, whose tool calls would not be journaled"
            )
        tools: list[Any] = []
        for tool in agent.tools:
            if isinstance(tool, FunctionTool):
                tools.append(_journaled_tool(tool, self.owner))
                self.owner.function_tools.add(tool.name)
            elif isinstance(tool, HOSTED_TOOLS):
                tools.append(tool)  # made by the provider: part of the recorded response
            else:
                raise ValueError(
                    f"tools: {type(tool).__name__} {getattr(tool, 'name', '')!r} of agent {agent.name!r} is a local "
                    "tool that is not a function tool: its calls would not be journaled"
                )
        model = _JournaledModel(agent.model) if isinstance(agent.model, Model) else agent.model
        clone = agent.clone(model=model, tools=tools)
        self.clones[id(agent)] = clone
        clone.handoffs = [self.handoff(h) for h in agent.handoffs]
        return clone

    def handoff(self, handoff: Agent[Any] | Handoff[Any, Any]) -> Agent[Any] | Handoff[Any, Any]:
        if isinstance(handoff, Agent):
            return self.agent(handoff)
        original = handoff.on_invoke_handoff

        async def on_invoke_handoff(*args: Any, **kwargs: Any) -> Any:
            return self.agent(await original(*args, **kwargs))

        return dataclasses.replace(handoff, on_invoke_handoff=on_invoke_handoff)


def _journal_error(exc: BaseException) -> AgentError | None:
    """The runtime's own error (a budget, a lost lease, a failed or uncertain call) that ``exc``
    was raised from, if any: the SDK wraps what a tool raises (``UserError``, ...)."""
    return in_chain(exc, AgentError)


async def _unwrapped(run: Coroutine[Any, Any, Any]) -> Any:
    """Await a ``Runner.run``; a failure caused by the runtime's own error raises that error, so
    the run records its failure code (``budget_exceeded``, ``lease_lost``, ...)."""
    try:
        return await run
    except Exception as exc:
        error = _journal_error(exc)
        if error is None or error is exc:
            raise
        raise error from exc


def _default_prompt(run_input: Any) -> str:
    if isinstance(run_input, dict) and isinstance(run_input.get("prompt"), str):
        return run_input["prompt"]
    return json.dumps(run_input, sort_keys=True)


class DurableAgent(JournalOptions):
    """A handler ``handler(ctx) -> output`` that runs ``agent`` (an ``agents.Agent``) durably for
    each claimed run with ``Runner.run``.

    ``prompt(run_input) -> str`` makes the input from the run's input (default its ``"prompt"``,
    else the input as JSON); ``context(ctx)`` the SDK's run context object; ``run_config`` and
    ``max_turns`` go to ``Runner.run`` (the model provider is wrapped, the rest is kept; the tool
    concurrency is set to 1 only on a runtime without replay scopes). Per tool name: ``compensations`` (registered with
    :func:`~buzz_delivery.agents.compensations.compensation`; anything else raises ``ValueError``
    here), ``reconcile`` hooks ``(args, key) -> output | NOT_MADE``, ``destructive`` names
    (blocked in shadow runs) and ``tool_costs``. ``request_cost`` is charged per model request,
    ``usage_cost(usage)`` per response (with the next call). ``approval_deadline_seconds``: the
    deadline of each approval. ``stream_text``: each response's text is appended to the run's
    output stream as a chunk (``True``), or each text delta while the request runs (``"tokens"``:
    the model is asked with ``stream_response``, the journal records the completed response).
    The handler's output is the agent's ``final_output`` as JSON."""

    def __init__(
        self,
        agent: Agent[Any],
        *,
        prompt: Callable[[Any], str] = _default_prompt,
        context: Callable[[Any], Any] | None = None,
        run_config: RunConfig | None = None,
        max_turns: int | None = None,
        compensations: Mapping[str, registry.Compensation] | None = None,
        reconcile: Mapping[str, Callable[[Any, str], Any]] | None = None,
        destructive: Iterable[str] = (),
        tool_costs: Mapping[str, int] | None = None,
        request_cost: int = 0,
        usage_cost: Callable[[Usage], int] = tokens,
        approval_deadline_seconds: int = 86400,
        stream_text: bool | Literal["tokens"] = False,
    ) -> None:
        self.prompt, self.context = prompt, context
        self.set_journal_options(
            compensations=compensations, reconcile=reconcile, destructive=destructive, tool_costs=tool_costs,
            request_cost=request_cost, usage_cost=usage_cost, approval_deadline_seconds=approval_deadline_seconds,
            stream_text=stream_text,
        )  # fmt: skip
        self.max_turns = max_turns
        self.function_tools: set[str] = set()  # the names of the function tools wrapped (their agents')
        self.agent = _Wrapper(self).agent(agent)
        config = run_config or RunConfig()
        self.run_config = dataclasses.replace(
            config,
            model=_JournaledModel(config.model) if isinstance(config.model, Model) else config.model,
            model_provider=_JournaledProvider(config.model_provider or MultiProvider()),
        )
        # A runtime without replay scopes (a custom one) replays by position: one tool at a
        # time, in the order of the response, so a call's position never depends on timing.
        one_at_a_time = dataclasses.replace(
            config.tool_execution or ToolExecutionConfig(), max_function_tool_concurrency=1
        )
        self.sequential_run_config = dataclasses.replace(self.run_config, tool_execution=one_at_a_time)

    def __call__(self, ctx: Any) -> Any:
        """The synchronous runtime's handler: runs :meth:`run` on an event loop of its own, in a
        helper thread, and serves its journal calls from this (the handler's) thread."""
        return run_threaded(ctx, lambda journal: self.run(ctx, journal), "openai-agents")

    async def run(self, ctx: Any, journal: Journal | None = None) -> Any:
        """Run the agent for ``ctx``'s run to its final output (JSON); approvals park it."""
        journal = journal or journal_for(ctx)
        durability = _Durability(self, journal)
        token = _active.set(durability)
        try:
            config = self.run_config if durability.parallel else self.sequential_run_config
            options: dict[str, Any] = {"run_config": config}
            if self.context is not None:
                options["context"] = self.context(ctx)
            if self.max_turns is not None:
                options["max_turns"] = self.max_turns
            result = await _unwrapped(Runner.run(self.agent, self.prompt(ctx.input), **options))
            while result.interruptions:
                state = result.to_state()
                for item in result.interruptions:
                    prompt = f"{item.name}({getattr(item.raw_item, 'arguments', '')})"[:PROMPT_MAX_CHARS]
                    decision = await journal.request_approval(prompt, self.approval_deadline_seconds)
                    if decision.get("decision") == "approved":
                        state.approve(item)
                    else:
                        by = decision.get("decided_by", "")
                        state.reject(item, rejection_message=f"The operator ({by}) rejected it.")
                result = await _unwrapped(Runner.run(self.agent, state, **options))
        finally:
            _active.reset(token)
        return to_jsonable_python(result.final_output, fallback=str)
