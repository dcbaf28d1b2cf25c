"""The tool calls of one agent handler in flight, counted for the runtimes (Django-free: the
in-process thread runtime, ``agents.runtime``, and the remote one, ``gateway.remote_runs``).

A run parks for an approval, completes or fails only once none of its handler's calls is in
flight: parking releases the lease, and a call left running could no longer record its result;
a completion or failure would leave that call pending (SPEC 12). A call counts from the moment
it holds its journal position (:meth:`InFlightCalls.enter`, called under the runtime's journal
lock: counted before it, a call waiting for the lock an approval held while it waited for the
calls in flight would wait for ever) until it is recorded (:meth:`InFlightCalls.leave`). Calls
nested in a call of the same thread are this thread's own: :meth:`InFlightCalls.wait_for_others`
does not wait for them (they cannot end while their thread waits). A failure and a park are
written under the journal lock once the other threads' calls ended (:func:`when_quiet`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

T = TypeVar("T")


class InFlightCalls:
    """How many calls of one handler are in flight, in all and on the calling thread."""

    def __init__(self) -> None:
        self._count = 0
        self._settled = threading.Condition()
        self._mine = threading.local()  # .positions: this thread's calls in flight, outermost first

    def enter(self, position: int) -> None:
        """Count the call at journal ``position`` once it holds it (see the module doc for when)."""
        with self._settled:
            self._count += 1
        self._mine.positions = (*self._positions(), position)

    def leave(self) -> None:
        """The call :meth:`enter` counted last on this thread is recorded (or gave up)."""
        self._mine.positions = self._positions()[:-1]
        with self._settled:
            self._count -= 1
            self._settled.notify_all()

    def _positions(self) -> tuple[int, ...]:
        return tuple(getattr(self._mine, "positions", ()))

    def own(self) -> int:
        """This thread's calls in flight (a call made from inside a call's tool function)."""
        return len(self._positions())

    def outer(self) -> int | None:
        """The journal position of the call this thread is inside (its tool or reconcile
        function runs), or None."""
        positions = self._positions()
        return positions[-1] if positions else None

    def others(self) -> bool:
        """Whether a call of another thread is in flight."""
        with self._settled:
            return self._count > self.own()

    def wait_for_others(self, check: Callable[[], None], every: float) -> None:
        """Wait until no call of another thread is in flight, calling ``check`` (which raises to
        stop the wait: a lease lost) at least every ``every`` seconds."""
        with self._settled:
            while self._count > self.own():
                check()
                self._settled.wait(every)

    def others_end_within(self, check: Callable[[], None], seconds: float, every: float) -> bool:
        """Whether no call of another thread is in flight within ``seconds`` (waited for as
        :meth:`wait_for_others`, ``check`` called at least every ``every`` seconds)."""
        deadline = time.monotonic() + seconds
        with self._settled:
            while self._count > self.own():
                check()
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._settled.wait(min(left, every))
        return True


def when_quiet(
    lock: AbstractContextManager[Any],
    calls: InFlightCalls,
    check: Callable[[], None],
    lost: threading.Event,
    then: Callable[[], T],
    at_once: Callable[[], bool] | None = None,
    *,
    hold: float,
    every: float,
) -> T:
    """``then()``'s result, ``then`` called under ``lock`` (a runtime's journal lock) once no call
    of another thread is in flight, or at once when ``at_once()`` (asked under the lock first each
    round) says so. Both runtimes' failure (``_fail_when_quiet``) and ``request_approval``.

    The calls are waited for under the lock, a while at a time: ``hold`` seconds at first, twice
    as long each round (``check``, which raises to stop the wait, called at least every
    ``every`` seconds: :meth:`InFlightCalls.others_end_within`). Waited for outside it, a call a
    thread journaled between the wait and ``then`` was closed uncertain by a failure (its undo
    before its effect), and a thread calling again and again took the lock in each gap (the
    failure or the approval waited as long as it called); held until they end, a call that a
    call in flight waits for (nested on its thread, or on a thread its tool starts) could never
    take the lock. Between two rounds the lock is let go for ``every`` seconds, so a call waiting
    for it (``threading.Lock`` is not fair) has the time to take it; ``lost`` set meanwhile stops
    the wait (``check`` raises)."""
    while True:
        with lock:
            if (at_once is not None and at_once()) or calls.others_end_within(check, hold, every):
                return then()
        hold *= 2
        if lost.wait(every):
            check()
