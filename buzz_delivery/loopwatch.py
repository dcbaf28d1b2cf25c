"""A watchdog for the event loops that run users' ``async def`` code (issue 29).

One loop thread runs hundreds of handlers, steps or agent runs at once. A coroutine that calls
blocking code without ``await`` (``time.sleep``, ``requests.get``, the sync ORM through a
library that hides it) holds that thread, and every other task on the loop waits with it: their
calls, their lease renewals where the loop renews them, their settles. Nothing fails; the
worker only goes slow, or leases lapse and their runs are taken over elsewhere.

:class:`LoopWatch` makes that visible. A daemon thread pings the loop every ``interval``
seconds (``call_soon_threadsafe``). When a ping waits ``threshold`` seconds it logs a warning,
once per stall, with the loop thread's stack at that moment (the code that blocks is on it),
and when the loop answers again it logs how long the stall lasted and counts it (``stalls``,
``stalled_seconds``, and ``on_stall(seconds)`` for the owner's summary). The watchdog never
touches the loop's tasks and costs one callback per ``interval``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

STALL_SECONDS = 1.0  # a ping unanswered this long is a stall
PING_SECONDS = 0.25
STACK_FRAMES = 12  # the innermost frames of the loop thread's stack in the warning

_default_logger = logging.getLogger("buzz_delivery.loop")


def blocking_stack(thread_id: int, frames: int = STACK_FRAMES) -> str:
    """The innermost ``frames`` of ``thread_id``'s stack, formatted (empty if it has ended)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    return "".join(traceback.format_stack(frame)[-frames:])


class LoopWatch:
    """Watch ``loop`` (running on the thread ``loop_thread_id``) from a daemon thread.

    Start it from the loop's thread with :meth:`start_here` (or :meth:`start` with the thread's
    id) and :meth:`stop` it before the loop closes."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        name: str,
        threshold: float = STALL_SECONDS,
        interval: float = PING_SECONDS,
        logger: logging.Logger | None = None,
        on_stall: Callable[[float], None] | None = None,
    ) -> None:
        if threshold <= 0 or interval <= 0:
            raise ValueError("threshold and interval must be positive")
        self.loop = loop
        self.name = name
        self.threshold = threshold
        self.interval = interval
        self.logger = logger or _default_logger
        self.on_stall = on_stall
        self.stalls = 0
        self.stalled_seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_thread_id = 0

    def start_here(self) -> LoopWatch:
        """Start watching the loop that runs on the calling thread."""
        return self.start(threading.get_ident())

    def start(self, loop_thread_id: int) -> LoopWatch:
        self._loop_thread_id = loop_thread_id
        self._thread = threading.Thread(target=self._watch, name=f"{self.name}-loopwatch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching. It does not wait for the thread (called on the loop, a join would
        stall the loop it watches); the thread sees the flag within ``interval``."""
        self._stop.set()

    def _ping(self) -> threading.Event | None:
        answered = threading.Event()
        try:
            self.loop.call_soon_threadsafe(answered.set)
        except RuntimeError:  # the loop closed
            return None
        return answered

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            sent = time.monotonic()
            answered = self._ping()
            if answered is None:
                return
            if answered.wait(self.threshold):
                continue
            if self._stop.is_set():
                return
            stack = blocking_stack(self._loop_thread_id)
            self.logger.warning(
                "event_loop_blocked loop=%s seconds=%.1f: a coroutine on it runs blocking code without "
                "await, and every other task on the loop waits (run blocking code with "
                "asyncio.to_thread or in a plain def); the loop thread is at:\n%s",
                self.name,
                time.monotonic() - sent,
                stack.rstrip() or "(no stack)",
            )
            while not answered.wait(self.interval):
                if self._stop.is_set() or self.loop.is_closed():
                    return
            seconds = time.monotonic() - sent
            self.stalls += 1
            self.stalled_seconds += seconds
            self.logger.warning("event_loop_unblocked loop=%s seconds=%.1f", self.name, seconds)
            if self.on_stall is not None:
                try:
                    self.on_stall(seconds)
                except Exception:  # the owner's counter must never end the watch
                    self.logger.exception("loopwatch on_stall raised")
