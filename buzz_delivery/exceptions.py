"""Exceptions of buzz_delivery. Each class's docstring says when it is raised; :func:`in_chain`
finds one in an error's cause chain.

Bad input is reported with :class:`django.core.exceptions.ValidationError`
(keyed by the argument or field name), never with these.
"""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)


class BuzzDeliveryError(Exception):
    """Base class of every error raised by buzz_delivery."""


class CommunityNotWritable(BuzzDeliveryError):
    """The community is not ``active``: the database's write fence refused the write (SPEC section 5)."""


class LifecycleError(BuzzDeliveryError):
    """A community lifecycle move that is not the next forward step (SPEC section 5)."""


class CommunityNotFound(BuzzDeliveryError):
    """No community has that id."""


class NotInTransaction(BuzzDeliveryError):
    """The call needs the caller's open transaction (``transaction.atomic()``)."""


class DeliveryWriteRefused(BuzzDeliveryError):
    """A delivery was written outside :mod:`buzz_delivery.services` (``Model.save()``), or an
    UPDATE tried to change its binding or snapshots or move its generation back (SQLSTATE
    ``BD003``)."""


def in_chain(exc: BaseException, kind: type[E]) -> E | None:
    """``exc`` if it is a ``kind``, else the first ``kind`` it was raised while handling or from
    (its ``__cause__``/``__context__`` chain; a cycle is cut), else None. The runtimes ask it
    whether user code failed on its own or because they stopped it (a ``RunAborted`` under its
    error), and which of their own errors an SDK wrapped."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None
