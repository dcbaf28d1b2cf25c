"""Run a ``pydantic_ai.Agent`` as an agent run's handler, durably, on the run's journal (issue 35).

    from pydantic_ai import Agent
    from buzz_delivery.agents.integrations.pydantic_ai import DurableAgent

    agent = Agent("openai:gpt-5", instructions="...")
    handler = DurableAgent(agent, compensations={"charge": refund})   # run_agent_worker --handler mod:handler

Every model request and every tool call of the agent is one journaled call made through the
runtime's ``ctx.call`` (fenced by the run's lease, journaled before it is made, its result
recorded): when the run is resumed (after a crash, a reclaim or an approval) the agent is run
again from the start and each recorded model response and tool result is replayed from the
journal instead of being made again. Built on Pydantic AI's public extension points only: a
capability (``get_wrapper_model``, ``get_wrapper_toolset``) passed to ``Agent.run``.

- Model requests: journaled as ``model:<model name>`` with the SHA-256 of the request's messages
  (timestamps and run ids left out) as arguments; the response is recorded as JSON
  (``ModelMessagesTypeAdapter``) and rebuilt from it, on the first run as on a replay. A request
  left pending by a crashed holder is simply made again (a model request has no side effect the
  journal could compensate).
- Tool calls: journaled under the tool's name with the validated arguments; the result is
  recorded as JSON and the model sees that JSON (on the first run as on a replay). The tool
  calls of one model response run at once, as Pydantic AI runs them (a tool declared
  ``sequential`` keeps its own setting): each is journaled in a replay scope of its own, named by
  its ``tool_call_id`` (part of the recorded response), so a resumed run replays each call by its
  scope whatever order the calls reach the journal in (``docs/agents.md`` "Resume"). Under the
  threaded runtime each such call is journaled on a thread of its own; under the event-loop
  runtime the calls are in flight at once too (only their journal writes are one at a time); under
  the remote worker (its context has replay scopes too) as under the threaded runtime. On a runtime
  context without replay scopes (a custom one) every tool is made ``sequential``, as before.
  Inside a tool, :func:`idempotency_key` is the journal's key for that call. A ``ModelRetry`` the
  tool raises is recorded too (the model is asked again, on a replay as well). ``compensations``
  (registered with :func:`~buzz_delivery.agents.compensations.compensation`), ``reconcile``
  hooks, ``destructive`` tools and ``tool_costs`` are declared per tool name.
- Approvals: a tool declared ``requires_approval=True`` (or raising ``ApprovalRequired``) parks
  the run on ``ctx.request_approval`` (the engine's approvals queue, no lease held); the
  operator's decision resumes it, and the tool is then made (approved) or the model told it was
  denied (rejected). Deferred external calls (``CallDeferred``) are not supported: the run fails.
- Budgets: every model request and tool call spends one of the run's tool-call slots; ``cost``:
  ``tool_costs[name]`` per tool call, ``request_cost`` per model request, and the usage of each
  model response (``usage_cost(usage)``, default its input + output tokens) charged with the next
  journaled call: its first function tool call validated (Pydantic AI validates a response's
  calls in its order before any runs), that call not made the next model request, so a resumed
  run whose calls reach the journal in another order charges it with the same call, once; a run
  past its cost cap stops before its next call with ``budget_exceeded`` on the run. (The final
  response's usage is in the journal but charged to no call: nothing follows it.)

Threads: under the threaded runtime the handler runs the agent on its own event loop in a
helper thread and makes every journal write itself, on the handler's thread and database
connection (:mod:`~buzz_delivery.agents.integrations.journal`: a queue carries each call across;
the call's body, e.g. the HTTP request to the model, runs back on the loop). Under the event-loop
runtime (``ctx.call`` a coroutine function), :meth:`DurableAgent.run` awaits ``ctx.call``
directly.

Streaming (``stream_text``): ``True`` writes each response's text to the run's output stream
(``ctx.emit``) as one chunk once it is recorded; ``"tokens"`` asks the model with
``request_stream`` and writes each text delta as a chunk while the request runs (the journal
records the whole response and how many chunks it wrote: a replay writes none again). A request
interrupted and made again leaves the chunks its first attempt wrote; the new attempt writes
:data:`~buzz_delivery.agents.integrations.journal.RESTARTED` after them, then its own. A streamed
request of an ``event_stream_handler`` is drained inside its journaled call and replayed as
events.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from contextlib import asynccontextmanager, nullcontext
from typing import Any, Literal

from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.exceptions import ModelRetry
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    TextPartDelta,
    ToolCallPart,
)
from pydantic_ai.models import CompletedStreamedResponse, Model, ModelRequestParameters, StreamedResponse
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import (
    DeferredToolRequests,
    DeferredToolResults,
    RunContext,
    ToolApproved,
    ToolDefinition,
    ToolDenied,
)
from pydantic_ai.toolsets import AbstractToolset, WrapperToolset
from pydantic_ai.usage import RequestUsage
from pydantic_core import to_jsonable_python

from buzz_delivery import journal_scope
from buzz_delivery.agents import compensations as registry
from buzz_delivery.agents.exceptions import AgentError
from buzz_delivery.agents.integrations.journal import (
    Durability,
    Journal,
    JournalOptions,
    as_stored,
    idempotency_key,
    journal_for,
    keyed,
    reconciler,
    remake,
    run_threaded,
    tool_call_scope,
)

__all__ = ["DurableAgent", "UnsupportedDeferral", "idempotency_key", "tokens"]

PROMPT_MAX_CHARS = 2000
_VOLATILE_KEYS = frozenset({"timestamp", "run_id", "conversation_id"})


class UnsupportedDeferral(AgentError):
    """The agent deferred a tool call to be made outside the run (``CallDeferred``): the journal
    has no way to receive its result."""

    failure_code = "unsupported_deferral"


def tokens(usage: RequestUsage) -> int:
    """Default ``usage_cost``: one cost unit per input or output token."""
    return int(usage.input_tokens or 0) + int(usage.output_tokens or 0)


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in _VOLATILE_KEYS}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def messages_digest(messages: list[ModelMessage]) -> str:
    """SHA-256 of ``messages`` as JSON without what changes from one run of the agent to the
    next (timestamps, run and conversation ids): a replay asks for the same request."""
    data = _stable(ModelMessagesTypeAdapter.dump_python(messages, mode="json"))
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def dump_response(response: ModelResponse) -> dict[str, Any]:
    return ModelMessagesTypeAdapter.dump_python([response], mode="json")[0]  # type: ignore[no-any-return]


def load_response(data: Any) -> ModelResponse:
    (message,) = ModelMessagesTypeAdapter.validate_python([data])
    if not isinstance(message, ModelResponse):
        raise ValueError("the journal holds a model request where a response was recorded")
    return message


class _Durability(AbstractCapability[Any], Durability):
    """The capability that routes one run's model requests and tool calls through the journal."""

    owner: DurableAgent

    def __init__(self, owner: DurableAgent, journal: Journal) -> None:
        Durability.__init__(self, owner, journal)
        self.chunks_mark = 0  # the stream's position when the current model request began
        self.choosing = False  # the last response's usage has no bearer yet (after_tool_validate)

    async def after_tool_validate(
        self, ctx: RunContext[Any], *, call: ToolCallPart, tool_def: ToolDefinition, args: Any
    ) -> Any:
        """Pydantic AI validates a response's tool calls one after another, in the response's
        order, before any runs: the first function tool call validated bears the response's
        usage (:meth:`Durability.call`), not the first to reach the journal, whose turn depends
        on the agent's own hooks (``before_tool_execute``, ...) and may differ on a resume
        (charged again with a call made now, or never)."""
        if self.choosing and tool_def.kind == "function":
            self.bearer, self.choosing = call.tool_call_id, False
        return args

    def get_wrapper_model(self, model: Model) -> Model | None:
        return _JournaledModel(model, self)

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        return _JournaledToolset(toolset, self)

    async def received(self, recorded: Any) -> ModelResponse:
        """A model response, made now or replayed from the journal: its usage is charged with the
        next call. With ``stream_text=True`` its text goes to the run's output stream (one chunk
        per response, so a resumed run, which replays the same responses, emits the same chunks
        and the runtime writes none twice); in token mode the chunks were written while it was
        made, and a replay counts as many (none is written again)."""
        if isinstance(recorded, dict) and "streamed_chunks" in recorded:
            await self.chunks.count(int(recorded["streamed_chunks"]) - (self.chunks.position - self.chunks_mark))
            recorded = recorded["response"]
        response = load_response(recorded)
        self.uncharged += max(0, int(self.owner.usage_cost(response.usage)))
        # Its usage goes with the first of its tool calls validated (after_tool_validate) or,
        # that call not made, the next model request. Calls made one at a time (a run an
        # earlier release journaled so): with the first made, as that release did. A call of it
        # journaled charged with more than its tool cost took it (the previous release charged
        # the first call to reach the journal, this one the bearer): it stays the bearer.
        self.bearer, self.choosing = None, self.parallel
        if self.parallel and (charged := self.charged_call(response)) is not None:
            self.bearer, self.choosing = charged, False
        if self.owner.stream_text is True:
            await self.chunks.emit("".join(part.content for part in response.parts if isinstance(part, TextPart)))
        return response

    def charged_call(self, response: ModelResponse) -> str | None:
        """The id of the tool call of ``response`` the run had journaled (when it was claimed)
        with a cost above its tool's, in the scope of that call: it was charged with the
        response's usage (by this release or the previous one), so none other of its calls is."""
        journaled_cost = getattr(self.journal.ctx, "journaled_cost", None)
        if journaled_cost is None:
            return None
        for part in response.parts:
            if isinstance(part, ToolCallPart) and part.tool_call_id:
                scope = journal_scope.key(journal_scope.tool_call(part.tool_call_id))
                cost = journaled_cost(scope)
                if cost is not None and cost > self.owner.tool_costs.get(part.tool_name, 0):
                    return part.tool_call_id
        return None

    async def request(self, name: str, args: Any, make: Callable[[], Any]) -> ModelResponse:
        """One journaled model request: ``make()`` opens the wrapped model's request (a response,
        or a stream to drain, writing each text delta to the output stream in token mode)."""
        tokens_mode = self.owner.stream_text == "tokens"

        async def body(call_args: Any, key: str) -> Any:
            with keyed(key):
                if not tokens_mode:
                    return dump_response(await make())
                await self.chunks.restart()
                async with make() as streamed:
                    async for event in streamed:
                        await self.chunks.emit(_text_delta(event))
                written = self.chunks.since(self.chunks_mark)
                return {"response": dump_response(streamed.get()), "streamed_chunks": written}

        self.chunks_mark = self.chunks.mark()
        recorded = await self.call(name, body, args, self.owner.request_cost, reconcile=remake)
        return await self.received(recorded)


def _text_delta(event: Any) -> str:
    """The text a stream event adds to a text part ('' for any other event)."""
    if isinstance(event, PartStartEvent) and isinstance(event.part, TextPart):
        return event.part.content
    if isinstance(event, PartDeltaEvent) and isinstance(event.delta, TextPartDelta):
        return event.delta.content_delta
    return ""


class _JournaledModel(WrapperModel):
    def __init__(self, wrapped: Model, durability: _Durability) -> None:
        super().__init__(wrapped)
        self.durability = durability

    def _entry(self, messages: list[ModelMessage]) -> tuple[str, dict[str, Any]]:
        args = {"messages": len(messages), "sha256": messages_digest(messages)}
        return f"model:{self.wrapped.model_name}"[:200], args

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        if self.durability.owner.stream_text == "tokens":
            make: Callable[[], Any] = lambda: self.wrapped.request_stream(  # noqa: E731
                messages, model_settings, model_request_parameters
            )
        else:
            make = lambda: self.wrapped.request(messages, model_settings, model_request_parameters)  # noqa: E731
        name, args = self._entry(messages)
        return await self.durability.request(name, args, make)

    @asynccontextmanager
    async def request_stream(  # type: ignore[override]
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> Any:
        """A streamed request (an ``event_stream_handler``): drained inside its journaled call and
        replayed to the caller as the events of the recorded response."""
        name, args = self._entry(messages)
        if self.durability.owner.stream_text == "tokens":
            make: Callable[[], Any] = lambda: self.wrapped.request_stream(  # noqa: E731
                messages, model_settings, model_request_parameters, run_context
            )
        else:

            async def make() -> ModelResponse:
                async with self.wrapped.request_stream(
                    messages, model_settings, model_request_parameters, run_context
                ) as streamed:
                    async for _ in streamed:
                        pass
                return streamed.get()

        response = await self.durability.request(name, args, make)
        stream: StreamedResponse = CompletedStreamedResponse(
            response, model_request_parameters=model_request_parameters, replay_events=True
        )
        yield stream


@dataclasses.dataclass
class _JournaledToolset(WrapperToolset[Any]):
    # A dataclass field: Pydantic AI rebuilds wrappers with dataclasses.replace.
    durability: _Durability

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, Any]:
        tools = await super().get_tools(ctx)
        if self.durability.parallel:  # each call replayed in its own scope (call_tool)
            return tools
        # A runtime without replay scopes (a custom one): one tool at a time, so a call's
        # journal position does not depend on which finished first.
        return {
            name: dataclasses.replace(tool, tool_def=dataclasses.replace(tool.tool_def, sequential=True))
            for name, tool in tools.items()
        }

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: Any) -> Any:
        # The model's tool calls run at once (Pydantic AI's tasks): each is journaled in the scope
        # of its tool_call_id (sequential, in the scope current, without replay scopes).
        with tool_call_scope(self.durability.parallel, ctx.tool_call_id):
            return await self._journaled(name, tool_args, ctx, tool)

    async def _journaled(self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: Any) -> Any:
        owner = self.durability.owner

        # The event-loop runtime's executor for the threads of plain tools: a call whose task
        # Pydantic AI cancels (a sibling tool raised) stays in flight until its thread ends, so
        # the run's failure does not undo it while it still runs (elsewhere: Pydantic AI's own).
        threads = getattr(getattr(self.durability.journal, "ctx", None), "tool_threads", None)

        async def body(args: Any, key: str) -> Any:
            with keyed(key), Agent.using_thread_executor(threads) if threads is not None else nullcontext():
                try:
                    result = await self.wrapped.call_tool(name, tool_args, ctx, tool)
                except ModelRetry as retry:
                    return {"retry": str(retry.message)}
            return {"return": to_jsonable_python(result)}

        recorded = await self.durability.call(
            name,
            body,
            tool_args,
            owner.tool_costs.get(name, 0),
            call_id=ctx.tool_call_id or "",
            compensate=owner.compensations.get(name),
            reconcile=reconciler(owner.reconcile.get(name)),
            destructive=name in owner.destructive,
        )
        if recorded is None:  # a shadow run's destructive call: blocked, not made
            return f"The call to {name} was not made (shadow run)."
        if "retry" in recorded:
            raise ModelRetry(recorded["retry"])
        # As a replay reads it back (a float jsonb prints without exponent is an int there): the
        # next request's digest covers it.
        return as_stored(recorded["return"])


def _default_prompt(run_input: Any) -> str:
    if isinstance(run_input, dict) and isinstance(run_input.get("prompt"), str):
        return run_input["prompt"]
    return json.dumps(run_input, sort_keys=True)


def _with_deferred(output_type: Any) -> Any:
    kinds = list(output_type) if isinstance(output_type, (list, tuple)) else [output_type]
    return kinds if DeferredToolRequests in kinds else [*kinds, DeferredToolRequests]


class DurableAgent(JournalOptions):
    """A handler ``handler(ctx) -> output`` that runs ``agent`` durably for each claimed run.

    ``prompt(run_input) -> str`` makes the user prompt from the run's input (default: its
    ``"prompt"``, else the input as JSON); ``deps(ctx)`` the run's dependencies. Per tool name:
    ``compensations`` (registered compensations; anything else raises ``ValueError`` here),
    ``reconcile`` hooks ``(args, key) -> output | NOT_MADE``, ``destructive`` names (blocked in
    shadow runs) and ``tool_costs``. ``request_cost`` is charged per model request,
    ``usage_cost(usage)`` per response (with the next call). ``approval_deadline_seconds``: the
    deadline of each approval a tool asks for. ``stream_text``: each model response's text is
    appended to the run's output stream (``ctx.emit``; read it with
    :func:`~buzz_delivery.agents.services.output.stream_output`, the gateway or the admin), one
    chunk per response; ``stream_text="tokens"``: each text delta is a chunk, written while the
    request runs (the model must stream: it is asked with ``request_stream``), and the journal
    records the whole response. The handler's output is the agent's output as JSON."""

    def __init__(
        self,
        agent: Agent[Any, Any],
        *,
        prompt: Callable[[Any], str] = _default_prompt,
        deps: Callable[[Any], Any] | None = None,
        compensations: Mapping[str, registry.Compensation] | None = None,
        reconcile: Mapping[str, Callable[[Any, str], Any]] | None = None,
        destructive: Iterable[str] = (),
        tool_costs: Mapping[str, int] | None = None,
        request_cost: int = 0,
        usage_cost: Callable[[RequestUsage], int] = tokens,
        approval_deadline_seconds: int = 86400,
        stream_text: bool | Literal["tokens"] = False,
    ) -> None:
        self.agent = agent
        self.prompt, self.deps = prompt, deps
        self.set_journal_options(
            compensations=compensations, reconcile=reconcile, destructive=destructive, tool_costs=tool_costs,
            request_cost=request_cost, usage_cost=usage_cost, approval_deadline_seconds=approval_deadline_seconds,
            stream_text=stream_text,
        )  # fmt: skip

    def __call__(self, ctx: Any) -> Any:
        """The synchronous runtime's handler: runs :meth:`run` on an event loop of its own, in a
        helper thread, and serves its journal calls from this (the handler's) thread."""
        return run_threaded(ctx, lambda journal: self.run(ctx, journal), "pydantic-ai")

    async def run(self, ctx: Any, journal: Journal | None = None) -> Any:
        """Run the agent for ``ctx``'s run to its output (JSON); approvals park it."""
        journal = journal or journal_for(ctx)
        durability = _Durability(self, journal)
        options: dict[str, Any] = {
            "output_type": _with_deferred(self.agent.output_type),
            "capabilities": [durability],
        }
        if self.deps is not None:
            options["deps"] = self.deps(ctx)
        result = await self.agent.run(self.prompt(ctx.input), **options)
        while isinstance(result.output, DeferredToolRequests):
            requests = result.output
            if requests.calls:
                names = ", ".join(sorted({c.tool_name for c in requests.calls}))
                raise UnsupportedDeferral(f"deferred tool calls ({names}) cannot be made outside a durable run")
            approvals: dict[str, bool | ToolApproved | ToolDenied] = {}
            for call in requests.approvals:
                prompt = f"{call.tool_name}({call.args_as_json_str()})"[:PROMPT_MAX_CHARS]
                decision = await journal.request_approval(prompt, self.approval_deadline_seconds)
                approved = decision.get("decision") == "approved"
                approvals[call.tool_call_id] = (
                    True if approved else ToolDenied(f"The operator ({decision.get('decided_by', '')}) rejected it.")
                )
            result = await self.agent.run(
                message_history=result.all_messages(),
                deferred_tool_results=DeferredToolResults(approvals=approvals),
                **options,
            )
        return to_jsonable_python(result.output)
