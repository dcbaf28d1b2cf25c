"""The NIP-98 replay store (SPEC section 14): each signed event id is usable once.

Not community-scoped (see :class:`buzz_delivery.gateway.models.SeenEvent`): it is keyed by the
event id alone and is written before the gateway knows which community a request concerns, so
the community rules of SPEC 15 (which the static scanner applies to ``*.services`` modules) do
not apply to it; on Citus it is a table of its own (reference or local), not colocated with the
communities. The time window is judged by the database clock (``buzz_delivery_now()``).
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from typing import Any

from django.db import connection

from buzz_delivery.services import validation as v
from buzz_delivery.services.tenancy import fleet_scoped

# Event timestamps beyond this are refused before SQL (year 5138; to_timestamp stays in range).
MAX_EVENT_TIMESTAMP = 10**11

# One statement: judge freshness by the database clock, then whether the key holds a live
# enrollment in an active community that it had when it signed (an event signed before the key
# was enrolled, which no one ever recorded, cannot be replayed after it), and record the id only
# then: a key enrolled nowhere writes nothing (issue 27: any signed request used to add a row).
# The conflict on the primary key (a replay) shows as no row returned. The same read also returns
# the active communities the key is enrolled in now (``enrolled_communities``'s answer): the views
# take it from here instead of a read of their own (issue 29: a transaction less per request),
# only those where the enrollment predates the signature, as ``enrolled`` judges it: an event
# signed before the key was enrolled in a community does not act there (held back, it did).
ADMIT_IF_FRESH_ENROLLED_AND_UNSEEN = """
WITH clock AS (SELECT buzz_delivery_now() AS t),
fresh AS (
    SELECT t FROM clock WHERE abs(extract(epoch FROM t) - %(created_at)s) <= %(window)s
),
live AS (
    SELECT e.community_id, e.enrolled_at
    FROM buzz_gateway_enrollment AS e JOIN buzz_delivery_community AS c ON c.id = e.community_id
    WHERE e.agent_pubkey = %(pubkey)s AND e.revoked_at IS NULL AND c.deletion_state = 'active'
),
enrolled AS (
    SELECT t FROM fresh WHERE EXISTS (
        SELECT 1 FROM live WHERE date_trunc('second', live.enrolled_at) <= to_timestamp(%(created_at)s)
    )
),
admitted AS (
    INSERT INTO buzz_gateway_seen_event (event_id, pubkey, created_at, seen_at)
    SELECT %(event_id)s, %(pubkey)s, to_timestamp(%(created_at)s), t FROM enrolled
    ON CONFLICT (event_id) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM fresh), (SELECT count(*) FROM enrolled), (SELECT count(*) FROM admitted),
       ARRAY(SELECT community_id FROM live
             WHERE date_trunc('second', live.enrolled_at) <= to_timestamp(%(created_at)s) ORDER BY community_id)
"""
# Rows whose event is older than the window can never be admitted again: delete them in batches.
DELETE_SEEN_BEFORE_WINDOW = """
DELETE FROM buzz_gateway_seen_event WHERE event_id IN (
    SELECT event_id FROM buzz_gateway_seen_event
    WHERE created_at < buzz_delivery_plus_seconds(buzz_delivery_now(), -%(keep_seconds)s)
    LIMIT %(batch_size)s
)
"""


class Admission(enum.Enum):
    """Outcome of :func:`record_event_id`."""

    ADMITTED = "admitted"  # fresh, from an enrolled key, never seen: recorded now
    STALE = "stale"  # created_at outside the window of the database clock: nothing recorded
    NOT_ENROLLED = "not_enrolled"  # fresh, but the key held no live enrollment when it signed: nothing recorded
    REPLAYED = "replayed"  # fresh, but that event id was already recorded


@fleet_scoped
def record_event_id(event_id: bytes, pubkey: bytes, created_at: int, *, window_seconds: float) -> Admission:
    """Record a NIP-98 event id once, if its ``created_at`` (Unix seconds) lies within
    ``window_seconds`` of the database clock and ``pubkey`` then held a live enrollment in an
    active community (else nothing is written: ``NOT_ENROLLED``). ``INSERT ... ON CONFLICT DO
    NOTHING``, judged by the rows it returns: one statement, one round trip, safe under
    concurrency (two requests with the same id: exactly one is ADMITTED). A fleet read, like
    :func:`~buzz_delivery.gateway.services.enrolled_communities`.

    Raises ``ValidationError`` keyed by argument before SQL (32-byte ids, an int timestamp in
    0..10**11, a window > 0)."""
    return admit_event(event_id, pubkey, created_at, window_seconds=window_seconds).admission


@dataclass(frozen=True, slots=True)
class Admitted:
    """Outcome of :func:`admit_event`: the admission, and the ``active`` communities where the
    key holds a live enrollment made no later than the event was signed, ordered by id, read by
    the same statement (what :func:`~buzz_delivery.gateway.services.enrolled_communities`
    answers, less the enrollments newer than the signature)."""

    admission: Admission
    communities: list[uuid.UUID]


@fleet_scoped
def admit_event(event_id: bytes, pubkey: bytes, created_at: int, *, window_seconds: float) -> Admitted:
    """:func:`record_event_id`, and in the same statement the key's enrolled communities: the
    gateway's request then needs no read of its own for them (issue 29)."""
    eid = v.bytes32(event_id, "event_id")
    key = v.bytes32(pubkey, "pubkey")
    ts = v.int_in_range(created_at, "created_at", 0, MAX_EVENT_TIMESTAMP)
    if isinstance(window_seconds, bool) or not isinstance(window_seconds, int | float) or not window_seconds > 0:
        raise v.invalid("window_seconds", f"must be a number of seconds > 0, got {window_seconds!r}")
    params: dict[str, Any] = {"event_id": eid, "pubkey": key, "created_at": ts, "window": float(window_seconds)}
    with connection.cursor() as cursor:
        cursor.execute(ADMIT_IF_FRESH_ENROLLED_AND_UNSEEN, params)
        fresh, enrolled, admitted, communities = cursor.fetchone()
    if not fresh:
        return Admitted(Admission.STALE, [])
    if not enrolled:
        return Admitted(Admission.NOT_ENROLLED, [])
    return Admitted(Admission.ADMITTED if admitted else Admission.REPLAYED, list(communities))


@fleet_scoped
def prune_seen_events(*, keep_seconds: float, batch_size: int = 1000, max_batches: int | None = None) -> int:
    """Delete recorded event ids whose event is older than ``keep_seconds`` (database clock), in
    batches of ``batch_size`` (1..100,000); returns how many were deleted. ``keep_seconds`` must
    be at least the auth window, or a replay of a still-acceptable event would be admitted: the
    caller (``prune_gateway_replays``) enforces that."""
    if isinstance(keep_seconds, bool) or not isinstance(keep_seconds, int | float) or not keep_seconds > 0:
        raise v.invalid("keep_seconds", f"must be a number of seconds > 0, got {keep_seconds!r}")
    size = v.int_in_range(batch_size, "batch_size", 1, 100_000)
    limit = None if max_batches is None else v.int_in_range(max_batches, "max_batches", 1, 2**31 - 1)
    total = batches = 0
    while limit is None or batches < limit:
        with connection.cursor() as cursor:
            cursor.execute(DELETE_SEEN_BEFORE_WINDOW, {"keep_seconds": float(keep_seconds), "batch_size": size})
            deleted = cursor.rowcount
        total += deleted
        batches += 1
        if deleted < size:
            break
    return total
