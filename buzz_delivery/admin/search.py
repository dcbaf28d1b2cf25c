"""What the delivery changelist's search box understands (SPEC section 8).

One term (surrounding whitespace ignored), read as:

- a UUID (with or without dashes): the delivery id, or the run id (exact);
- 1..64 hex characters: a prefix of the target public key, as a ``bytea`` range
  (``target_pubkey >= low AND target_pubkey < high``); 32 hex characters are also tried as a UUID;
- ``step:<text>``, ``target:<hex>``, ``id:<uuid>``: force one reading;
- anything else: a ``step_id``, exact or prefix.
"""

from __future__ import annotations

import re
import uuid

from django.db.models import Q

from buzz_delivery.models import WorkflowRun

HEX_PREFIX = re.compile(r"^[0-9a-fA-F]{1,64}$")
HELP_TEXT = (
    "Delivery id or run id (UUID), a target public key hex prefix (1-64 hex characters), or a step id "
    "(exact or prefix). Prefix with step:, target: or id: to force one reading."
)


def hex_prefix_range(prefix: str) -> tuple[bytes, bytes | None]:
    """The ``bytea`` range ``[low, high)`` of every value whose hex form starts with ``prefix``.

    ``high`` is None when no upper bound is needed (a prefix of all ``f``)."""
    prefix = prefix.lower()
    low = bytes.fromhex(prefix + "0" * (len(prefix) % 2))
    top = bytearray.fromhex(prefix + "f" * (len(prefix) % 2))
    # The smallest byte string greater than every extension of ``top``: increment with carry.
    while top and top[-1] == 0xFF:
        top.pop()
    if not top:
        return low, None
    top[-1] += 1
    return low, bytes(top)


def target_prefix_q(prefix: str) -> Q:
    low, high = hex_prefix_range(prefix)
    q = Q(target_pubkey__gte=low)
    return q & Q(target_pubkey__lt=high) if high is not None else q


def uuid_q(value: uuid.UUID) -> Q:
    """The delivery with that id, or the deliveries of the run with that id.

    The run's community is looked up first (primary key), so the delivery lookup is served by
    the identity index (community, run, step, target) instead of a table scan."""
    q = Q(pk=value)
    community_id = WorkflowRun.objects.filter(pk=value).values_list("community_id", flat=True).first()
    if community_id is not None:
        q |= Q(community_id=community_id, run_id=value)
    return q


def step_q(text: str) -> Q:
    return Q(step_id=text) | Q(step_id__startswith=text)


def parse_uuid(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text)
    except ValueError:
        return None


def delivery_search_q(term: str) -> Q | None:
    """The filter for one search term, or None for an empty term."""
    term = term.strip()
    if not term:
        return None
    kind, sep, rest = term.partition(":")
    if sep and kind.lower() in ("step", "target", "id"):
        rest = rest.strip()
        if kind.lower() == "step":
            return step_q(rest) if rest else None
        if kind.lower() == "target":
            return target_prefix_q(rest) if HEX_PREFIX.match(rest) else Q(pk__in=[])
        value = parse_uuid(rest)
        return uuid_q(value) if value is not None else Q(pk__in=[])
    value = parse_uuid(term)
    if HEX_PREFIX.match(term):
        q = target_prefix_q(term)
        return q | uuid_q(value) if value is not None else q
    if value is not None:
        return uuid_q(value)
    return step_q(term)
