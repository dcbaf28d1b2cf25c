"""Spans of the workflow engine and the agent runtime, and the trace context they carry.

The context of a run is stored with it (``trace_context``, W3C headers) when it is created
(:func:`workflow_run_span` around ``create_run``; a child run started by a ``sub_workflow``
step inside that step's span) and restored as the parent of each of its steps
(:func:`step_span`); a ``send_message`` step commits its deliveries inside its span, so they
store it (``trigger_context["trace"]``). ``accept_delivery`` opens ``buzz.agent.accept`` as a
child of the delivery's stored context (:func:`accept_span`) and stores it with the agent run,
whose claim restores it (:func:`agent_run_span`) around the handler and its tool calls
(:func:`tool_call_span`) and compensations (:func:`compensation_span`).

Every helper starts with one check (:func:`buzz_delivery.tracing.tracer`): without tracing it
returns a shared no-op context manager (or calls the function), having read nothing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from buzz_delivery import tracing

F = TypeVar("F", bound=Callable[..., Any])


def carried(stored: Any) -> dict[str, Any] | None:
    """A delivery's ``trigger_context`` carrying ``stored`` (a run's context) on when this
    process does not trace (the commit's own span is stored when it does); None otherwise."""
    if tracing.tracer() is not None or stored is None:
        return None
    found = tracing.carrier(stored)
    return {tracing.TRACE_KEY: found} if found is not None else None


def workflow_run_span(community_id: Any, workflow_id: Any, run_id: Any, parent_run_id: Any) -> Any:
    """``buzz.workflow.run`` around the creation of one run (its context is what the run stores)."""
    if tracing.tracer() is None:
        return tracing._NULL
    attributes = {
        "buzz.community_id": str(community_id),
        "buzz.workflow_id": str(workflow_id),
        "buzz.run_id": str(run_id),
    }
    if parent_run_id is not None:
        attributes["buzz.parent_run_id"] = str(parent_run_id)
    return tracing.span("buzz.workflow.run", attributes)


def _run_trace(step: Any) -> Any:
    """The stored trace context of the step's run: from the run already loaded, else one read."""
    from buzz_delivery.workflows.models import Run, Step

    if Step.run.is_cached(step):
        return step.run.trace_context
    rows = Run.objects.filter(community_id=step.community_id, run_id=step.run_id).values_list("trace_context")
    found = rows.first()
    return found[0] if found else None


@contextlib.contextmanager
def _step_span(claim: Any, parent: Any = None, loaded: bool = False) -> Iterator[None]:
    step = claim.step
    attributes = {
        "buzz.community_id": str(step.community_id),
        "buzz.run_id": str(step.run_id),
        "buzz.step_key": step.key,
        "buzz.step_kind": step.kind,
        "buzz.attempt": int(claim.lease.attempts),
    }
    with tracing.span("buzz.workflow.step", attributes, parent=parent if loaded else _run_trace(step)):
        yield


def step_span(claim: Any) -> Any:
    """``buzz.workflow.step`` around one step's execution, child of its run's stored context."""
    if tracing.tracer() is None:
        return tracing._NULL
    return _step_span(claim)


def step_trace_parent(claim: Any) -> Any:
    """The stored trace context a step's span is a child of (one read, when tracing is on; else
    None): read off the event loop, for :func:`loop_step_span`."""
    return None if tracing.tracer() is None else _run_trace(claim.step)


def loop_step_span(claim: Any, parent: Any) -> Any:
    """:func:`step_span` with its parent read beforehand (:func:`step_trace_parent`): no
    database on the event loop that awaits an ``async def`` step."""
    if tracing.tracer() is None:
        return tracing._NULL
    return _step_span(claim, parent, loaded=True)


def _delivery_trace(lease: Any) -> Any:
    from buzz_delivery.models import WorkflowAgentDelivery

    rows = WorkflowAgentDelivery.objects.filter(community_id=lease.community_id, id=lease.delivery_id)
    stored = rows.values_list("trigger_context", flat=True).first()
    return stored.get(tracing.TRACE_KEY) if isinstance(stored, dict) else None


def accept_span(func: F) -> F:
    """Decorate ``accept_delivery(lease, ...)``: ``buzz.agent.accept``, child of the current
    span when it is in the delivery's trace (a handler's), else of the delivery's stored
    context (a gateway request, or no span at all: linked to the current span)."""
    if not tracing.INSTALLED:
        return func

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        found = tracing.tracer()
        lease: Any = args[0] if args else kwargs.get("lease")
        if found is None or not hasattr(lease, "delivery_id"):
            return func(*args, **kwargs)
        attributes = {"buzz.community_id": str(lease.community_id), "buzz.delivery_id": str(lease.delivery_id)}
        parent = tracing.context_of(_delivery_trace(lease))
        current = tracing._trace.get_current_span().get_span_context()
        links = []
        if parent is not None:
            stored = tracing._trace.get_current_span(parent).get_span_context()
            if current.is_valid and current.trace_id == stored.trace_id:
                parent = None  # already inside the delivery's trace (its handler span)
            elif current.is_valid:
                links.append(tracing._trace.Link(current))
        with found.start_as_current_span("buzz.agent.accept", context=parent, attributes=attributes, links=links):
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def agent_run_span(func: F) -> F:
    """Decorate ``run_claim(claim, ...)``: ``buzz.agent.run``, child of the run's stored context."""
    if not tracing.INSTALLED:
        return func

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        found = tracing.tracer()
        claim = args[0] if args else kwargs.get("claim")
        if found is None or claim is None:
            return func(*args, **kwargs)
        run = claim.run
        attributes = {
            "buzz.community_id": str(claim.lease.community_id),
            "buzz.agent_run_id": str(claim.lease.run_id),
            "buzz.agent_pubkey": bytes(run.agent_pubkey).hex(),
            "buzz.lease_generation": int(claim.lease.lease_generation),
        }
        with tracing.span("buzz.agent.run", attributes, parent=run.trace_context):
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def tool_call_span(method: F) -> F:
    """Decorate ``Context.call(self, tool_name, ...)``: ``buzz.agent.call`` (one per call,
    replayed ones included: ``buzz.replayed`` says so)."""
    if not tracing.INSTALLED:
        return method

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        found = tracing.tracer()
        if found is None:
            return method(self, *args, **kwargs)
        tool_name = args[0] if args else kwargs.get("tool_name")
        attributes = {"buzz.agent_run_id": str(self.lease.run_id), "buzz.tool": str(tool_name)[:200]}
        with found.start_as_current_span("buzz.agent.call", attributes=attributes) as current:
            replayed = self.replayed
            try:
                return method(self, *args, **kwargs)
            finally:
                current.set_attribute("buzz.replayed", self.replayed > replayed)

    return wrapper  # type: ignore[return-value]


def compensation_span(lease: Any, seq: int) -> Any:
    """``buzz.agent.compensation`` around one compensation's call."""
    if tracing.tracer() is None:
        return tracing._NULL
    return tracing.span("buzz.agent.compensation", {"buzz.agent_run_id": str(lease.run_id), "buzz.seq": int(seq)})
