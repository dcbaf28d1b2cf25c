"""The handler contract of the worker (SPEC section 7): loading a handler by dotted path and
turning what it did into a settle outcome.

A handler is ``handler(delivery: WorkflowAgentDelivery) -> object``:

- it returns (any value, ignored)            -> the delivery settles ``finished``;
- it raises :class:`PermanentFailure`, or an exception whose class has ``permanent = True``
                                             -> ``failed``, ``failure_code`` = the exception's
                                                class name (<= 64 chars), ``failure_message`` =
                                                ``str(exc)`` (<= 10,000 chars);
- it raises any other ``Exception``          -> ``retry`` (back to ``pending`` after the backoff,
                                                or ``failed``/``attempts_exhausted`` on the last
                                                allowed attempt; SPEC section 6); an exception
                                                that carries ``retry_after`` (seconds, e.g.
                                                :class:`buzz_delivery.backoff.RetryAfter`) is
                                                not retried before then;
- it raises a ``BaseException`` that is not an ``Exception`` (``SystemExit``,
  ``KeyboardInterrupt``, ``asyncio.CancelledError``)
                                             -> ``failed``, ``failure_code`` = its class name;
                                                the worker goes on;
- it leaves a transaction open on its connection
                                             -> ``failed``, ``transaction_left_open`` (what it
                                                wrote there is rolled back; see
                                                :mod:`buzz_delivery.usercode`).

A handler with the attribute ``guards_user_code = True`` (the task runner,
:class:`buzz_delivery.tasks.runner.TaskRunner`) runs the user code it calls in a
:class:`~buzz_delivery.usercode.UserCode` of its own, and judges what that code left open
itself: the worker does not wrap it in a second guard.
"""

from __future__ import annotations

import contextlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from buzz_delivery import backoff

if TYPE_CHECKING:
    from buzz_delivery.models import WorkflowAgentDelivery

Handler = Callable[["WorkflowAgentDelivery"], object]
# What the worker enters around a handler that guards its own user code (reusable, no state).
NO_GUARD = contextlib.nullcontext()


def guards_user_code(handler: object) -> bool:
    """True for a handler that runs its user code in a guard of its own (see the module doc)."""
    return getattr(handler, "guards_user_code", False) is True


FAILURE_CODE_MAX_CHARS = 64
FAILURE_MESSAGE_MAX_CHARS = 10_000


class PermanentFailure(Exception):
    """Raise from a handler to settle the delivery ``failed`` instead of retrying it.

    The exception's class name becomes ``failure_code`` and ``str(exc)`` its
    ``failure_message``; subclass it to get a meaningful code (``class BadPayload(PermanentFailure)``).
    Any exception class with a class attribute ``permanent = True`` counts the same.
    """

    permanent = True


@dataclass(frozen=True, slots=True)
class SettleArgs:
    """What to pass to ``services.finish_delivery``: ``outcome`` and the failure fields."""

    outcome: str
    failure_code: str | None = None
    failure_message: str | None = None
    retry_after: float | None = None


FINISHED = SettleArgs("finished")


def is_permanent(exc: BaseException) -> bool:
    """True for a :class:`PermanentFailure` or an exception whose class says ``permanent = True``."""
    return isinstance(exc, PermanentFailure) or getattr(type(exc), "permanent", False) is True


def storable_text(text: str, max_chars: int) -> str:
    """``text`` made storable in a PostgreSQL ``text`` column and bounded: NUL becomes the
    visible escape ``\\x00``, a lone surrogate its ``\\udXXX`` escape, then the result is cut
    to ``max_chars`` characters. Handler text is data, never a reason to stop a worker."""
    text = text.replace("\x00", "\\x00")
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text[:max_chars]


def storable_tail(text: str, max_chars: int) -> str:
    """As :func:`storable_text`, for a traceback: a text longer than ``max_chars`` keeps its
    end (the final exception line, the innermost frames) after a first line saying how many
    characters of its beginning were cut, the whole within ``max_chars`` characters."""
    text = storable_text(text, len(text) * 10)  # escaped (an escape is at most 10 characters), not cut
    if len(text) <= max_chars:
        return text
    kept = max_chars - len(f"[cut: the first {len(text)} characters left out]\n")  # at least as long
    if kept <= 0:
        return text[len(text) - max_chars :]
    return f"[cut: the first {len(text) - kept} characters left out]\n" + text[len(text) - kept :]


def describe(exc: BaseException) -> str:
    """``str(exc)``, or a placeholder when the exception's own ``__str__`` raises."""
    try:
        return str(exc)
    except BaseException:
        return f"<unprintable {type(exc).__name__}>"


def settle_args_for(exc: BaseException) -> SettleArgs:
    """The settle outcome for a handler that raised ``exc`` (see the module docstring).

    The failure text is always storable and bounded (:func:`storable_text`), whatever the
    exception's message or class name holds."""
    message = storable_text(describe(exc), FAILURE_MESSAGE_MAX_CHARS) or None
    if is_permanent(exc):
        code = storable_text(type(exc).__name__, FAILURE_CODE_MAX_CHARS) or PermanentFailure.__name__
        return SettleArgs("failed", code, message)
    return SettleArgs("retry", None, message, backoff.of(exc))


def aborted_args(exc: BaseException) -> SettleArgs:
    """The settle outcome for a handler that raised a ``BaseException`` that is not an
    ``Exception`` (``SystemExit``, ``KeyboardInterrupt``, ``asyncio.CancelledError``...): the
    handler asked to stop, which ends that delivery ``failed`` (the class name as its code, not
    retried), never the worker."""
    name = type(exc).__name__
    code = storable_text(name, FAILURE_CODE_MAX_CHARS) or "BaseException"
    return SettleArgs("failed", code, storable_text(f"{name}: {describe(exc)}", FAILURE_MESSAGE_MAX_CHARS))


def load_handler(path: str) -> Handler:
    """Import the handler named by ``path`` (``package.module:function`` or
    ``package.module.function``). Raises ``ValueError`` if it cannot be imported or is not callable."""
    try:
        handler = pkgutil.resolve_name(path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"cannot import {path!r}: {exc}") from exc
    if not callable(handler):
        raise ValueError(f"{path!r} is not callable")
    return handler  # type: ignore[no-any-return]
