"""Community lifecycle and purge (SPEC section 5)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from django.db import connection, transaction

from buzz_delivery.catalog import catalog_models
from buzz_delivery.conf import get_settings
from buzz_delivery.exceptions import CommunityNotFound, LifecycleError
from buzz_delivery.models import LIFECYCLE_ORDER, Community
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, translated_errors
from buzz_delivery.triggers import FENCE_LOCK_NAMESPACE


def _lock_fence_exclusive(community: uuid.UUID) -> None:
    # Writers hold this lock in shared mode (the write fence trigger) until they commit: taking
    # it exclusively waits for them, and writers arriving later wait for this move to commit,
    # then see the new state and are refused.
    fetch_all(
        "SELECT pg_advisory_xact_lock(%(ns)s, hashtext(%(id)s::text))", {"ns": FENCE_LOCK_NAMESPACE, "id": community}
    )


def _count_rows(community: uuid.UUID) -> dict[str, int]:
    return {m._meta.label: m._base_manager.filter(community_id=community).count() for m in catalog_models()}


def advance_community(community_id: uuid.UUID | str, state: str) -> Community:
    """Move a community one step forward: active -> quiescing -> fenced -> tombstone.

    Waits for writers already inside a transaction on that community, and lets no new writer
    slip past (see the fence lock above). The database bumps ``fence_generation`` on each
    move and refuses backward or skipping moves even from raw SQL. Moving to ``tombstone``
    requires the community to hold no rows (use :func:`purge_community`).

    Returns the updated :class:`Community`. Raises ``ValidationError`` for an unknown state,
    :class:`CommunityNotFound`, or :class:`LifecycleError` for a move that is not the next step.
    """
    community_uuid = v.uuid_value(community_id, "community_id")
    if state not in LIFECYCLE_ORDER:
        raise v.invalid("state", f"must be one of {', '.join(LIFECYCLE_ORDER)}, got {state!r}")
    with transaction.atomic():
        _lock_fence_exclusive(community_uuid)
        community = Community.objects.select_for_update().filter(id=community_uuid).first()
        if community is None:
            raise CommunityNotFound(f"no community {community_uuid}")
        current = LIFECYCLE_ORDER.index(community.deletion_state)
        if LIFECYCLE_ORDER.index(state) != current + 1:
            raise LifecycleError(
                f"community {community_uuid} cannot move from {community.deletion_state} to {state} "
                "(states move forward one step at a time)"
            )
        if state == "tombstone":
            left = {k: n for k, n in _count_rows(community_uuid).items() if n}
            if left:
                raise LifecycleError(f"community {community_uuid} still holds rows {left}; purge it first")
        with translated_errors():
            Community.objects.filter(id=community_uuid).update(deletion_state=state)
        community.refresh_from_db()
    return community


@dataclass
class PurgeResult:
    """Rows deleted (or, with ``dry_run``, present) per catalog model label, in catalog order."""

    deleted: dict[str, int] = field(default_factory=dict)
    tombstoned: bool = False
    dry_run: bool = False

    @property
    def total(self) -> int:
        return sum(self.deleted.values())


def purge_community(
    community_id: uuid.UUID | str, *, batch_size: int | None = None, dry_run: bool = False
) -> PurgeResult:
    """Delete a fenced community's rows in catalog order, then mark it ``tombstone``.

    Requires ``fenced``; a ``tombstone`` community is a no-op (a second purge deletes nothing).
    Each batch of ``batch_size`` rows (default ``BATCH_SIZE``) is its own transaction in which
    the purge executor identifies itself to the write fence for this community and its current
    fence generation only (``set_config(..., true)``: transaction-local). Other communities are
    never touched. ``dry_run`` returns the row counts and writes nothing.

    Raises :class:`CommunityNotFound`, or :class:`LifecycleError` when the community is
    ``active`` or ``quiescing``.
    """
    community_uuid = v.uuid_value(community_id, "community_id")
    size = v.int_in_range(batch_size if batch_size is not None else get_settings().batch_size, "batch_size", 1, 100_000)
    community = Community.objects.filter(id=community_uuid).first()
    if community is None:
        raise CommunityNotFound(f"no community {community_uuid}")
    if community.deletion_state == "tombstone":
        return PurgeResult(deleted={m._meta.label: 0 for m in catalog_models()}, tombstoned=True, dry_run=dry_run)
    if community.deletion_state != "fenced":
        raise LifecycleError(
            f"community {community_uuid} is {community.deletion_state}; only a fenced community is purged"
        )
    if dry_run:
        return PurgeResult(deleted=_count_rows(community_uuid), dry_run=True)

    result = PurgeResult()
    for model in catalog_models():
        table = connection.ops.quote_name(model._meta.db_table)
        statement = (
            f"DELETE FROM {table} WHERE id IN "
            f"(SELECT id FROM {table} WHERE community_id = %(community_id)s LIMIT %(batch_size)s)"
        )
        deleted = 0
        while True:
            with transaction.atomic(), translated_errors():
                fetch_all(
                    "SELECT set_config('buzz_delivery.purge_community', %(c)s, true), "
                    "set_config('buzz_delivery.purge_fence_generation', %(g)s, true)",
                    {"c": str(community_uuid), "g": str(community.fence_generation)},
                )
                with connection.cursor() as cursor:
                    cursor.execute(statement, {"community_id": community_uuid, "batch_size": size})
                    count = cursor.rowcount
            deleted += count
            if count < size:
                break
        result.deleted[model._meta.label] = deleted
    advance_community(community_uuid, "tombstone")
    result.tombstoned = True
    return result
