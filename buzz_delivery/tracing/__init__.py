"""OpenTelemetry traces of the inbox, at no cost without them.

With ``opentelemetry-api`` installed (the ``tracing`` extra) and a tracer provider configured
(the SDK's, by the host project, or :func:`use_tracer_provider`), the services and the worker
open spans: ``buzz.commit``, ``buzz.claim``, ``buzz.settle``, ``buzz.reap`` and, around each
handler call, ``buzz.handler``. The trace context of a commit travels with the work: it is
stored in each delivery's ``trigger_context`` under ``"trace"`` (W3C ``traceparent``) and the
worker restores it as the handler span's parent, so one trace runs from the producer to the
handler (and from a task's ``enqueue`` to the task).

Not installed: :func:`traced` returns the function itself and :func:`span` a shared no-op
context manager. Installed but not configured (no SDK provider): one attribute test per call.
Call sites stay one line; the logic is here.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

try:
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
    from opentelemetry.trace import ProxyTracerProvider as _Proxy
except ImportError:  # the extra is not installed
    _trace = None  # type: ignore[assignment]

F = TypeVar("F", bound=Callable[..., Any])
INSTALLED = _trace is not None
_NULL = contextlib.nullcontext()
TRACE_KEY = "trace"  # where a delivery's trigger_context keeps its trace context
MAX_HEADER_CHARS = 4096  # a stored traceparent/tracestate longer than this is ignored

_explicit: Any = None  # a provider given by use_tracer_provider()
_cached: tuple[Any, Any] = (None, None)  # (provider, its tracer)


def use_tracer_provider(provider: Any) -> None:
    """Trace with ``provider`` instead of the global one (None: back to the global one)."""
    global _explicit
    _explicit = provider


# The API's global provider is read from its module attribute (None until set_tracer_provider):
# get_tracer_provider() looks the OTEL_PYTHON_TRACER_PROVIDER variable up in os.environ on every
# call while none is set (several microseconds per hook). It is called instead when that
# variable names a provider, or should a later API lose the attribute.
_FAST_GLOBAL = (
    _trace is not None and hasattr(_trace, "_TRACER_PROVIDER") and "OTEL_PYTHON_TRACER_PROVIDER" not in os.environ
)


def tracer() -> Any:
    """This package's tracer, or None when tracing is not installed or not configured."""
    global _cached
    if _trace is None:
        return None
    provider = _explicit
    if provider is None:
        provider = _trace._TRACER_PROVIDER if _FAST_GLOBAL else _trace.get_tracer_provider()
        if provider is None:  # no provider set: nothing would be recorded
            return None
    if isinstance(provider, _Proxy):  # no SDK provider set: nothing would be recorded
        return None
    if _cached[0] is not provider:
        _cached = (provider, provider.get_tracer("buzz_delivery"))
    return _cached[1]


def carrier(stored: Any) -> dict[str, str] | None:
    """The W3C headers (``traceparent``, ``tracestate``) of a stored or received trace context,
    or None. A stored value is data: anything but short strings under those keys is ignored."""
    if not isinstance(stored, Mapping):
        return None
    found = {
        key: value
        for key in ("traceparent", "tracestate")
        if isinstance(value := stored.get(key), str) and len(value) <= MAX_HEADER_CHARS
    }
    return found if "traceparent" in found else None


def context_of(stored: Any) -> Any:
    """The OpenTelemetry context a stored trace context names (None: none usable, or no
    tracing). Never raises: a malformed value is a span without that parent."""
    found = carrier(stored)
    if found is None or _trace is None:
        return None
    try:
        context = _propagate.extract(found)
    except Exception:  # a propagator's own error on odd input: no parent, never a failure
        return None
    return context if _trace.get_current_span(context).get_span_context().is_valid else None


def span(
    name: str, attributes: Mapping[str, Any] | None = None, *, parent: Mapping[str, str] | None = None, kind: Any = None
) -> Any:
    """A context manager: a span ``name`` (child of ``parent``, a stored trace context, when
    given and usable; else of the current span), or a no-op one without tracing."""
    found = tracer()
    if found is None:
        return _NULL
    context = context_of(parent) if parent else None
    options = {} if kind is None else {"kind": kind}
    return found.start_as_current_span(name, context=context, attributes=dict(attributes or {}), **options)


def traced(name: str) -> Callable[[F], F]:
    """Decorate a service with a span ``name`` (the function itself when not installed)."""

    def decorate(func: F) -> F:
        if not INSTALLED:
            return func

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            found = tracer()
            if found is None:
                return func(*args, **kwargs)
            with found.start_as_current_span(name):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def inject() -> dict[str, str] | None:
    """The current trace context (W3C headers) to store with work, or None without tracing
    (or without a current span)."""
    if tracer() is None:
        return None
    headers: dict[str, str] = {}
    _propagate.inject(headers)
    return headers or None


def json_or_none(value: Any) -> str | None:
    """``value`` as JSON text for a jsonb parameter, None for None."""
    return None if value is None else json.dumps(value)


def current_or(stored: Any) -> dict[str, str] | None:
    """The trace context to store with new work: the current one while tracing records, else
    ``stored`` (the context of the work it comes from, carried on as it is) when usable."""
    found = inject()
    if found is not None:
        return found
    return carrier(stored) if stored is not None else None


def with_trace(trigger_context: Any) -> Any:
    """``trigger_context`` with the current trace context under :data:`TRACE_KEY` (a copy;
    a value that is not a dict, or already has the key, is returned as it is)."""
    if tracer() is None or not (trigger_context is None or isinstance(trigger_context, dict)):
        return trigger_context
    if trigger_context and TRACE_KEY in trigger_context:
        return trigger_context
    carrier = inject()
    if carrier is None:
        return trigger_context
    return {**(trigger_context or {}), TRACE_KEY: carrier}


@contextlib.contextmanager
def _handler_span(delivery: Any) -> Iterator[None]:
    stored = delivery.trigger_context  # a deferred field: read only when tracing
    parent = stored.get(TRACE_KEY) if isinstance(stored, dict) else None
    attributes = {"buzz.delivery_id": str(delivery.id), "buzz.community_id": str(delivery.community_id)}
    with span("buzz.handler", attributes, parent=parent):
        yield


def handler_span(delivery: Any) -> Any:
    """The span around one handler call, child of the trace stored with the delivery."""
    if tracer() is None:
        return _NULL
    return _handler_span(delivery)
