"""Backoff that listens (issue 29): jitter for every layer's exponential backoff, and a
failure's ``retry_after`` (a provider's Retry-After) that the next attempt honours.

Jitter ("equal jitter"): a computed delay ``d`` (base * 2**n, capped) becomes a delay drawn
uniformly from ``[JITTER_LOW * d, d]``, so retries of many items that failed together spread
over the second half of their window instead of returning at once; never more than the
un-jittered delay, never less than half of it.

``retry_after``: seconds (a non-negative finite number, at most :data:`MAX_RETRY_AFTER_SECONDS`).
A failure may carry it as an attribute of the exception a handler or a function step raises
(``exc.retry_after``, e.g. :class:`RetryAfter`); the next attempt is then not before
``max(jittered backoff, retry_after)`` from the failure (database clock). A value a handler
sets is data: one that is not a usable number is ignored (the backoff alone applies), never a
reason to stop a worker. Services that take it as an argument refuse a bad one
(``ValidationError`` keyed ``retry_after``) before any SQL.

Where it applies: a delivery settled ``retry`` (``finish_delivery(..., retry_after=)``; the
delivery worker passes its handler's), a workflow function step's failed attempt
(``fail_step(..., retry_after=)``; the executor passes its function's), and a reclaimed agent
run's backoff (jitter only: an agent run is retried only when its lease lapses).
"""

from __future__ import annotations

import math
import random
from typing import Any

JITTER_LOW = 0.5  # a jittered delay lies within [JITTER_LOW * d, d]
MAX_RETRY_AFTER_SECONDS = 7 * 86400.0


class RetryAfter(Exception):
    """Raise from a delivery handler or a function step to be retried not before
    ``retry_after`` seconds (e.g. a provider's 429 with ``Retry-After: 30``)."""

    def __init__(self, retry_after: float, message: str = "") -> None:
        super().__init__(message or f"retry after {retry_after:g} s")
        self.retry_after = retry_after


def jitter() -> float:
    """A factor drawn uniformly from ``[JITTER_LOW, 1]``."""
    return random.uniform(JITTER_LOW, 1.0)


def jittered(seconds: float) -> float:
    """``seconds`` with equal jitter: within ``[JITTER_LOW * seconds, seconds]``."""
    return seconds * jitter()


def usable(value: Any) -> float | None:
    """``value`` as a retry_after in seconds, or None when it is not a usable one (not a real
    number, negative, not finite); a usable one above the cap is capped."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return min(seconds, MAX_RETRY_AFTER_SECONDS)


def of(exc: BaseException | None) -> float | None:
    """The usable ``retry_after`` an exception carries (None when it carries none)."""
    if exc is None:
        return None
    try:
        return usable(getattr(exc, "retry_after", None))
    except Exception:  # a property that raises: the backoff alone applies
        return None


def header_seconds(value: str | None) -> float | None:
    """An HTTP ``Retry-After`` header's delay-seconds form as a usable ``retry_after`` (None when
    absent or not a plain non-negative number: the HTTP-date form is not read, and a server's
    odd header never stops a client)."""
    if value is None:
        return None
    try:
        return usable(float(value.strip()))
    except ValueError:
        return None


def again_delay(base: float, attempt: int, retry_after: float | None = None, *, most: float) -> float:
    """The wait before attempt ``attempt + 1`` of a request refused for load or left without an
    answer: ``base * 2**attempt`` with jitter, or the server's ``retry_after`` when that is
    longer; never more than ``most`` (past it the lease the request serves would lapse)."""
    delay = jittered(base * 2**attempt)
    if retry_after is not None:
        delay = max(delay, retry_after)
    return min(delay, most)


class Retrying:
    """The waits of a loop that retries a refused request (a claim the gateway refused or
    never answered): capped exponential backoff with equal jitter, :meth:`reset` on success.

    :meth:`delay` is the wait before the next try: ``base * 2**n`` (``n`` the failures since the
    last reset, the first being 0) capped at ``most``, then jittered (within ``[d/2, d]``); a
    longer ``retry_after`` the refusal carried wins, capped at ``most`` too. ``most`` may be
    lowered for one call (``most=``: e.g. a worker's ``--idle-exit``, so the wait never carries
    it far past the moment it may stop). Not thread-safe: one per loop."""

    def __init__(self, base: float, most: float) -> None:
        if not (0 < base <= most < math.inf):
            raise ValueError(f"base and most must satisfy 0 < base <= most < inf, got {base!r}, {most!r}")
        self.base, self.most = base, most
        self.failures = 0

    def delay(self, retry_after: float | None = None, *, most: float | None = None) -> float:
        """The wait after one more failure (and count it)."""
        cap = self.most if most is None else max(0.0, min(self.most, most))
        computed = min(self.base * 2.0 ** min(self.failures, 60), cap)
        self.failures += 1
        wait = jittered(computed)
        after = usable(retry_after)
        if after is not None:
            wait = max(wait, min(after, cap))
        return wait

    def reset(self) -> None:
        """A try got through: the next failure waits ``base`` again."""
        self.failures = 0


def argument(value: Any, name: str = "retry_after") -> float | None:
    """A service's ``retry_after`` argument: None, or 0..MAX_RETRY_AFTER_SECONDS seconds;
    anything else raises ``ValidationError`` keyed ``name``. (This module needs no Django
    otherwise: the gateway's client uses :func:`of`.)"""
    from buzz_delivery.services import validation as v

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise v.invalid(name, f"must be a number of seconds or None, not {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_RETRY_AFTER_SECONDS:
        raise v.invalid(name, f"must be within 0..{MAX_RETRY_AFTER_SECONDS:g} seconds, got {value!r}")
    return seconds
