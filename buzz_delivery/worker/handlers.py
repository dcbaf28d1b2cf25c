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
                                                allowed attempt; SPEC section 6).
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from buzz_delivery.models import WorkflowAgentDelivery

Handler = Callable[["WorkflowAgentDelivery"], object]

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


FINISHED = SettleArgs("finished")


def is_permanent(exc: BaseException) -> bool:
    """True for a :class:`PermanentFailure` or an exception whose class says ``permanent = True``."""
    return isinstance(exc, PermanentFailure) or getattr(type(exc), "permanent", False) is True


def settle_args_for(exc: Exception) -> SettleArgs:
    """The settle outcome for a handler that raised ``exc`` (see the module docstring)."""
    message = str(exc)[:FAILURE_MESSAGE_MAX_CHARS] or None
    if is_permanent(exc):
        return SettleArgs("failed", type(exc).__name__[:FAILURE_CODE_MAX_CHARS], message)
    return SettleArgs("retry", None, message)


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
