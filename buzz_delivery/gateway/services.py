"""Enrollment services of the gateway (SPEC sections 14 and 15): the only writes to enrollments.

An agent key acts in a community only while it holds a live (unrevoked) enrollment there and the
community is ``active``. Every argument is validated before any SQL; a bad one raises
:class:`django.core.exceptions.ValidationError` keyed by its name and nothing is written. Every
UPDATE names ``community_id`` in its own WHERE (SPEC 15). The NIP-98 replay store, which is not
community-scoped, lives in :mod:`buzz_delivery.gateway.replay` (``record_event_id`` is re-exported
here).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from django.db import connection, transaction

from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.gateway.replay import Admission, prune_seen_events, record_event_id
from buzz_delivery.models import new_uuid7
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import translated_errors
from buzz_delivery.services.tenancy import fleet_scoped, tenant_scoped

ENROLLED_BY_MAX_CHARS = 200

COMMUNITY_STATE = "SELECT deletion_state FROM buzz_delivery_community WHERE id = %(community_id)s"
# The partial unique index ``enrollment_one_live_per_key`` is the conflict target.
ENROLL_UNLESS_LIVE = """
INSERT INTO buzz_gateway_enrollment (id, community_id, agent_pubkey, enrolled_at, enrolled_by)
VALUES (%(id)s, %(community_id)s, %(agent_pubkey)s, buzz_delivery_now(), %(enrolled_by)s)
ON CONFLICT (community_id, agent_pubkey) WHERE revoked_at IS NULL DO NOTHING
RETURNING id
"""
LIVE_ENROLLMENT = """
SELECT e.id FROM buzz_gateway_enrollment e
WHERE e.community_id = %(community_id)s AND e.agent_pubkey = %(agent_pubkey)s AND e.revoked_at IS NULL
"""
REVOKE_IF_LIVE = """
UPDATE buzz_gateway_enrollment SET revoked_at = buzz_delivery_now()
WHERE community_id = %(community_id)s AND agent_pubkey = %(agent_pubkey)s AND revoked_at IS NULL
RETURNING id
"""
LIVE_IN_ACTIVE_COMMUNITY = """
SELECT 1 FROM buzz_gateway_enrollment e JOIN buzz_delivery_community c ON c.id = e.community_id
WHERE e.community_id = %(community_id)s AND e.agent_pubkey = %(agent_pubkey)s AND e.revoked_at IS NULL
  AND c.deletion_state = 'active'
"""
# The enrollment check and the scope check of a run batch in one read (issue 29: one round trip
# less per request). Both sides name the community (SPEC 15: one shard group on Citus).
ENROLLED_AND_OWN_RUNS = """
SELECT EXISTS (
    SELECT 1 FROM buzz_gateway_enrollment e JOIN buzz_delivery_community c ON c.id = e.community_id
    WHERE e.community_id = %(community_id)s AND e.agent_pubkey = %(agent_pubkey)s AND e.revoked_at IS NULL
      AND c.deletion_state = 'active'
), ARRAY(
    SELECT r.id FROM buzz_agents_run r
    WHERE r.community_id = %(community_id)s AND r.agent_pubkey = %(agent_pubkey)s AND r.id = ANY(%(run_ids)s::uuid[])
)
"""
ACTIVE_COMMUNITIES_OF_KEY = """
SELECT e.community_id FROM buzz_gateway_enrollment e JOIN buzz_delivery_community c ON c.id = e.community_id
WHERE e.agent_pubkey = %(agent_pubkey)s AND e.revoked_at IS NULL AND c.deletion_state = 'active'
ORDER BY e.community_id
"""

__all__ = [
    "Admission",
    "Enrolled",
    "Revoked",
    "enroll",
    "enrolled_communities",
    "is_enrolled",
    "own_runs_if_enrolled",
    "prune_seen_events",
    "record_event_id",
    "revoke",
]


@dataclass(frozen=True, slots=True)
class Enrolled:
    """``enroll`` outcome: ``enrollment_id`` is the live enrollment; ``created`` is False when
    the key was already enrolled there (an idempotent repeat: nothing was written)."""

    enrollment_id: uuid.UUID
    created: bool


@dataclass(frozen=True, slots=True)
class Revoked:
    """``revoke`` outcome: ``revoked`` is 1 when a live enrollment was revoked, 0 when there was
    none (already revoked, or never enrolled)."""

    revoked: int


def _one(statement: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchone()


def _require_active(community: uuid.UUID) -> None:
    row = _one(COMMUNITY_STATE, {"community_id": community})
    if row is None:
        raise v.invalid("community_id", "no such community")
    if row[0] != "active":
        raise CommunityNotWritable(f"community {community} is {row[0]}: enrollments are fenced (write fence)")


@tenant_scoped
def enroll(community_id: uuid.UUID | str, agent_pubkey: bytes, *, enrolled_by: str = "") -> Enrolled:
    """Enroll an agent key in a community (SPEC section 14), idempotently.

    ``community_id``: a UUID of an existing community; ``agent_pubkey``: exactly 32 bytes;
    ``enrolled_by``: up to 200 characters naming the operator. Returns :class:`Enrolled`.
    Raises ``ValidationError`` keyed by argument (also for an unknown community), and
    :class:`~buzz_delivery.exceptions.CommunityNotWritable` when the community is not ``active``
    (the write fence would refuse it too). One transaction; nothing is written on refusal.
    """
    community = v.uuid_value(community_id, "community_id")
    key = v.bytes32(agent_pubkey, "agent_pubkey")
    if not isinstance(enrolled_by, str):
        raise v.invalid("enrolled_by", f"must be a string, not {type(enrolled_by).__name__}")
    operator = v.storable_text(enrolled_by, "enrolled_by")
    if len(operator) > ENROLLED_BY_MAX_CHARS:
        raise v.invalid("enrolled_by", f"must be at most {ENROLLED_BY_MAX_CHARS} characters, got {len(operator)}")
    params = {"id": new_uuid7(), "community_id": community, "agent_pubkey": key, "enrolled_by": operator}
    with translated_errors(), transaction.atomic():
        _require_active(community)
        row = _one(ENROLL_UNLESS_LIVE, params)
        if row is not None:
            return Enrolled(enrollment_id=row[0], created=True)
        live = _one(LIVE_ENROLLMENT, params)
        assert live is not None, "the conflicting live enrollment vanished inside our transaction"
        return Enrolled(enrollment_id=live[0], created=False)


@tenant_scoped
def revoke(community_id: uuid.UUID | str, agent_pubkey: bytes) -> Revoked:
    """Revoke the key's live enrollment in the community (``revoked_at = now()``, database clock).

    The row stays as history. Requests the key signs afterwards are refused with 403 there; a
    lease it already holds can no longer be renewed or settled through the gateway. Raises
    ``ValidationError`` keyed by argument, ``CommunityNotWritable`` when the community is not
    ``active``. Returns :class:`Revoked`.
    """
    community = v.uuid_value(community_id, "community_id")
    key = v.bytes32(agent_pubkey, "agent_pubkey")
    with translated_errors(), transaction.atomic(), connection.cursor() as cursor:
        _require_active(community)
        cursor.execute(REVOKE_IF_LIVE, {"community_id": community, "agent_pubkey": key})
        return Revoked(revoked=len(cursor.fetchall()))


@tenant_scoped
def is_enrolled(community_id: uuid.UUID | str, agent_pubkey: bytes) -> bool:
    """True when the key holds a live enrollment in the community and the community is ``active``.

    Raises ``ValidationError`` keyed by argument on bad input (before SQL)."""
    community = v.uuid_value(community_id, "community_id")
    key = v.bytes32(agent_pubkey, "agent_pubkey")
    return _one(LIVE_IN_ACTIVE_COMMUNITY, {"community_id": community, "agent_pubkey": key}) is not None


@tenant_scoped
def own_runs_if_enrolled(
    community_id: uuid.UUID | str, agent_pubkey: bytes, run_ids: list[uuid.UUID]
) -> set[uuid.UUID] | None:
    """None when the key holds no live enrollment in the community (or it is not ``active``);
    else which of ``run_ids`` are agent runs of that key there (a run's ``agent_pubkey`` never
    changes). One read: :func:`is_enrolled` and the scope check of a run batch together.

    Raises ``ValidationError`` keyed by argument on bad input (before SQL)."""
    community = v.uuid_value(community_id, "community_id")
    key = v.bytes32(agent_pubkey, "agent_pubkey")
    ids = [v.uuid_value(run_id, "run_ids") for run_id in run_ids]
    row = _one(ENROLLED_AND_OWN_RUNS, {"community_id": community, "agent_pubkey": key, "run_ids": ids})
    assert row is not None
    return set(row[1]) if row[0] else None


@fleet_scoped
def enrolled_communities(agent_pubkey: bytes) -> list[uuid.UUID]:
    """The ``active`` communities where the key holds a live enrollment, ordered by id (one query).

    Raises ``ValidationError`` keyed ``agent_pubkey`` on bad input (before SQL)."""
    key = v.bytes32(agent_pubkey, "agent_pubkey")
    with connection.cursor() as cursor:
        cursor.execute(ACTIVE_COMMUNITIES_OF_KEY, {"agent_pubkey": key})
        return [row[0] for row in cursor.fetchall()]
