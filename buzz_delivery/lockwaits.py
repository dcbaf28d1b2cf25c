"""Communities left alone for a while after a statement of theirs waited past the lock bound.

A worker serving several communities bounds its statements' lock waits
(:func:`~buzz_delivery.services.db.lock_waits_bounded`): a community whose rows are locked (a
lifecycle move of it waiting behind a long transaction of its own code, say) costs one bounded
wait, then that community is skipped for ``seconds`` and the others go on. :class:`Skipped`
keeps those communities, shared by the worker's threads; a worker serving one community keeps
an empty one (nothing is bounded, nothing skipped). :func:`tried_last` is the renewers' order
after such a wait.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, TypeVar

K = TypeVar("K")
_MISSING: Any = object()


def tried_last(held: dict[K, Any], key: K) -> None:
    """Move ``key``'s entry (if still held) to the end of ``held``, whose order is the renewal
    order: a renewal that waited past the lock bound is tried after the others from then on, so
    one row held by a long transaction does not keep its community's other leases from ever
    being renewed (tried first every round, it found the community locked each time). The
    caller holds ``held``'s lock."""
    entry = held.pop(key, _MISSING)
    if entry is not _MISSING:
        held[key] = entry


class Skipped:
    """Communities (by id) skipped until a monotonic instant. Thread-safe."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._until: dict[uuid.UUID, float] = {}
        self._lock = threading.Lock()

    def skip(self, community: uuid.UUID) -> None:
        """A statement of ``community`` waited past the bound: leave it for :attr:`seconds`."""
        with self._lock:
            self._until[community] = time.monotonic() + self.seconds

    def waits(self, community: uuid.UUID) -> bool:
        """Whether ``community`` is skipped now (a cheap test while none is)."""
        if not self._until:
            return False
        with self._lock:
            until = self._until.get(community)
            if until is None:
                return False
            if until > time.monotonic():
                return True
            del self._until[community]
            return False

    def _prune(self) -> None:
        """Forget the communities whose time is over (call under ``_lock``)."""
        now = time.monotonic()
        for community in [c for c, until in self._until.items() if until <= now]:
            del self._until[community]

    def __bool__(self) -> bool:
        """Whether a community is skipped now: a worker idle otherwise is not idle while one is."""
        if not self._until:
            return False
        with self._lock:
            self._prune()
            return bool(self._until)

    def next_try(self) -> float | None:
        """Seconds until the first skipped community is tried again (None: none is skipped now)."""
        if not self._until:
            return None
        with self._lock:
            self._prune()
            return max(0.0, min(self._until.values()) - time.monotonic()) if self._until else None
