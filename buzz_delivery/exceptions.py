"""Exceptions of buzz_delivery. Each class's docstring says when it is raised.

Bad input is reported with :class:`django.core.exceptions.ValidationError`
(keyed by the argument or field name), never with these.
"""

from __future__ import annotations


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
