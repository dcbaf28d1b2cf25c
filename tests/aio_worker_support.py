"""Scaffolding of the event-loop worker's tests: the in-process worker
(:func:`tests.test_agents_aio.in_process`) on a thread of its own, joined with a bound, so that
a run that never ends fails its test ("stuck") instead of hanging the suite."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from django.db import connections

from tests.test_agents_aio import in_process

# How long a test waits for the worker to exit once its runs are started (never reached by a
# run that ends: each test's own waits are bounded well below it).
WORKER_BOUND = 60.0


def run_in_thread(
    community: Any,
    handler: Callable[..., Any],
    *,
    meanwhile: Callable[[], None] | None = None,
    bound: float = WORKER_BOUND,
    stuck: str = "the run is stuck",
    **options: Any,
) -> dict[str, int]:
    """Run ``in_process(community, handler, in_flight=4, connections=2, **options)`` on a thread
    until it exits when idle and return its counts. ``meanwhile()``, if given, runs on the
    calling thread while the worker runs (it waits for what the handler shows, then cancels the
    run, say); the worker is joined even when it raises. Asserts (``stuck``) the worker ended
    within ``bound`` seconds."""
    options = {"in_flight": 4, "connections": 2, **options}
    out: list[dict[str, int]] = []

    def work() -> None:
        try:
            out.append(in_process(community, handler, **options)[1])
        finally:
            connections.close_all()

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    try:
        if meanwhile is not None:
            meanwhile()
    finally:
        worker.join(bound)
    assert not worker.is_alive(), stuck
    assert out, "the worker raised (see its thread's traceback)"
    return out[0]


EVENT_BOUND = 20.0


async def waited(event: threading.Event, bound: float = EVENT_BOUND) -> bool:
    """Whether ``event`` was set within ``bound`` seconds, waited for off the event loop (a
    handler's step waiting for the test's side: a row held, a statement sent)."""
    return await asyncio.to_thread(event.wait, bound)
