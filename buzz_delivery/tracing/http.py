"""Spans of the gateway's HTTP requests, and the W3C ``traceparent`` header both ways.

Server side (:func:`server_span`, around each endpoint of :mod:`buzz_delivery.gateway.views`):
one ``SERVER`` span per request, named ``"{method} {route}"``, child of the context of the
request's ``traceparent``/``tracestate`` headers when they are valid W3C headers (anything else
is ignored: a header is data). Client side (:func:`client_request`, in
:class:`buzz_delivery.gateway.client.GatewayClient`): one ``CLIENT`` span per request, whose
context the headers carry. Without tracing: the view itself, and the request sent as it is.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, TypeVar

from buzz_delivery import tracing

F = TypeVar("F", bound=Callable[..., Any])
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def _status(span: Any, code: int) -> None:
    span.set_attribute("http.response.status_code", code)
    if code >= 500:
        span.set_status(tracing._trace.Status(tracing._trace.StatusCode.ERROR))


def server_span(view: F) -> F:
    """Decorate a Django view ``view(request, **path)``: one server span per request."""
    if not tracing.INSTALLED:
        return view

    @functools.wraps(view)
    def wrapper(request: Any, *args: Any, **kwargs: Any) -> Any:
        found = tracing.tracer()
        if found is None:
            return view(request, *args, **kwargs)
        meta = request.META
        headers = {"traceparent": meta.get("HTTP_TRACEPARENT"), "tracestate": meta.get("HTTP_TRACESTATE")}
        parent = tracing.context_of(headers)
        match = getattr(request, "resolver_match", None)
        route = match.route if match is not None and match.route else _UUID.sub("{id}", request.path)
        attributes = {"http.request.method": str(request.method), "http.route": route}
        with found.start_as_current_span(
            f"{request.method} {route}", context=parent, kind=tracing._trace.SpanKind.SERVER, attributes=attributes
        ) as current:
            response = view(request, *args, **kwargs)
            _status(current, int(response.status_code))
            return response

    return wrapper  # type: ignore[return-value]


def client_request(method: str, path: str, headers: dict[str, str], send: Callable[[], Any]) -> Any:
    """``send()`` inside a client span whose context ``headers`` carry (W3C); without tracing,
    ``send()`` itself."""
    found = tracing.tracer()
    if found is None:
        return send()
    route = _UUID.sub("{id}", path.split("?", 1)[0])
    attributes = {"http.request.method": method, "url.path": route}
    with found.start_as_current_span(
        f"{method} {route}", kind=tracing._trace.SpanKind.CLIENT, attributes=attributes
    ) as current:
        tracing._propagate.inject(headers)
        response = send()
        _status(current, int(response.status_code))
        return response
