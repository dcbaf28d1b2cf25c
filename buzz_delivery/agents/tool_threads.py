"""The default executor of an agent worker's event loop that notes the threads a tool starts
(:func:`noting_threads`), for the integrations' tool timeouts (``integrations.journal``,
``integrations.openai_agents``). A module of its own, with no optional dependency: the
event-loop worker makes its scoped loop threads one too (``loop_worker``), so that an
integration keeps them in place rather than putting an unscoped one there."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


# The threads the tool being made started on its loop's default executor (asyncio.to_thread,
# run_in_executor(None, ...)): set around a tool by :func:`noting_threads`.
_tool_threads: contextvars.ContextVar[list[Future[Any]] | None] = contextvars.ContextVar(
    "buzz_integration_tool_threads", default=None
)


class ToolThreads(ThreadPoolExecutor):
    """An agent loop's default executor (a ``ThreadPoolExecutor`` as asyncio's own): a thread
    submitted by code run inside :func:`noting_threads` is noted there, so a tool's timeout can
    tell that a thread it started (which no cancel can stop) may still make its effect."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future = super().submit(fn, *args, **kwargs)
        threads = _tool_threads.get()
        if threads is not None:
            threads.append(future)
        return future


@contextlib.contextmanager
def noting_threads(loop: asyncio.AbstractEventLoop) -> Iterator[list[Future[Any]]]:
    """Make ``loop``'s default executor a :class:`ToolThreads` (once per loop: threads already
    running on the one it replaces run on, and its idle ones end with it) and note, in the list
    yielded, the threads that the tasks created in the block start on it."""
    if not isinstance(getattr(loop, "_default_executor", None), ToolThreads):
        loop.set_default_executor(ToolThreads(thread_name_prefix="asyncio"))
    threads: list[Future[Any]] = []
    token = _tool_threads.set(threads)
    try:
        yield threads
    finally:
        _tool_threads.reset(token)
