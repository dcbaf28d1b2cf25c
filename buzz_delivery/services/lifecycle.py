"""Community lifecycle and purge (SPEC section 5)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import cast

from django.db import connection, transaction

from buzz_delivery.catalog import catalog_models
from buzz_delivery.conf import get_settings
from buzz_delivery.exceptions import CommunityNotFound, LifecycleError
from buzz_delivery.models import LIFECYCLE_ORDER, Community
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, translated_errors
from buzz_delivery.services.tenancy import fleet_scoped

MAX_PURGE_BATCH = 100_000


# The purge executor names itself to the write fence (migrations 0002, 0005) with two
# transaction-local settings, and clears them before its batch commits. ``SET LOCAL`` rather
# than ``set_config()``: Citus propagates it to the nodes the transaction writes on
# (``citus.propagate_set_commands = 'local'``), so the fence on a shard sees it (SPEC 15).
# The values are a UUID and an integer formatted by us, never caller text.
def _identify_purge_executor(community: Community) -> str:
    return (
        f"SET LOCAL buzz_delivery.purge_community = '{uuid.UUID(str(community.id))}'; "
        f"SET LOCAL buzz_delivery.purge_fence_generation = '{int(community.fence_generation)}'"
    )


FORGET_PURGE_EXECUTOR = (
    "SET LOCAL buzz_delivery.purge_community = ''; SET LOCAL buzz_delivery.purge_fence_generation = ''"
)
# One batch of one catalog table; both DELETE and its subquery name the community (SPEC 15).
PURGE_BATCH = (
    "DELETE FROM {table} WHERE community_id = %(community_id)s AND {pk} IN "
    "(SELECT {pk} FROM {table} WHERE community_id = %(community_id)s LIMIT %(batch_size)s)"
)


MOVE_IF_STATE = (
    "UPDATE buzz_delivery_community SET deletion_state = %(state)s "
    "WHERE id = %(id)s AND deletion_state = %(from)s RETURNING id"
)


def _count_rows(community: uuid.UUID) -> dict[str, int]:
    return {m._meta.label: m._base_manager.filter(community_id=community).count() for m in catalog_models()}


@fleet_scoped
def advance_community(community_id: uuid.UUID | str, state: str) -> Community:
    """Move a community one step forward: active -> quiescing -> fenced -> tombstone.

    Waits for writers already inside a transaction on that community, and lets no new writer
    slip past: the community row's lifecycle trigger takes the community's fence lock
    exclusively, which writers hold in shared mode (the write-fence trigger) until they commit;
    writers arriving later queue behind the move, then see the new state and are refused.
    Both triggers run where the community's rows live, so the two sides meet on Citus too
    (SPEC section 15). The database bumps ``fence_generation`` on each
    move and refuses backward or skipping moves even from raw SQL. Moving to ``tombstone``
    requires the community to hold no rows (use :func:`purge_community`).

    Returns the updated :class:`Community`. Raises ``ValidationError`` keyed ``community_id`` or
    ``state`` on bad input, :class:`CommunityNotFound`, or :class:`LifecycleError` for a move
    that is not the next step.
    """
    community_uuid = v.uuid_value(community_id, "community_id")
    if state not in LIFECYCLE_ORDER:
        raise v.invalid("state", f"must be one of {', '.join(LIFECYCLE_ORDER)}, got {state!r}")
    with transaction.atomic():
        community = Community.objects.filter(id=community_uuid).first()
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
                raise LifecycleError(
                    f"community {community_uuid} still holds rows {left}; purge it first "
                    f"(manage.py purge_community {community_uuid}, or services.purge_community)"
                )
        # One statement, guarded by the state it moves from. Its trigger takes the community's
        # fence lock exclusively (on the node that owns the community row, under Citus).
        with translated_errors():
            moved = fetch_all(MOVE_IF_STATE, {"id": community_uuid, "state": state, "from": community.deletion_state})
        if not moved:
            now_in = Community.objects.get(id=community_uuid).deletion_state
            raise LifecycleError(
                f"community {community_uuid} cannot move from {now_in} to {state} "
                "(states move forward one step at a time; another move came first)"
            )
        community.refresh_from_db()
    return community


@dataclass
class PurgeResult:
    """What :func:`purge_community` did.

    - ``deleted``: rows deleted (with ``dry_run``: rows present) per catalog model label
      (``"buzz_delivery.Workflow"``), in catalog order, every catalog model present.
    - ``tombstoned``: the community is ``tombstone`` at the end (False for a dry run).
    - ``batches``: DELETE statements run, each in its own transaction (0 for a dry run).
    """

    deleted: dict[str, int] = field(default_factory=dict)
    tombstoned: bool = False
    dry_run: bool = False
    batches: int = 0

    @property
    def total(self) -> int:
        """Rows over every table."""
        return sum(self.deleted.values())


def _delete_batch(statement: str, community: Community, size: int) -> int:
    with transaction.atomic(), translated_errors():
        with connection.cursor() as cursor:
            cursor.execute(_identify_purge_executor(community))
        with connection.cursor() as cursor:
            cursor.execute(statement, {"community_id": community.id, "batch_size": size})
            count = cursor.rowcount
        # Commit and rollback end the settings anyway; clearing them also keeps them from
        # outliving this batch when the caller wrapped the purge in its own transaction.
        with connection.cursor() as cursor:
            cursor.execute(FORGET_PURGE_EXECUTOR)
    return count


@fleet_scoped
def purge_community(
    community_id: uuid.UUID | str, *, batch_size: int | None = None, dry_run: bool = False
) -> PurgeResult:
    """Delete a fenced community's rows in catalog order, then mark it ``tombstone``.

    Requires ``fenced``; a ``tombstone`` community is a no-op (zero counts). Each table is
    emptied by DELETE statements of at most ``batch_size`` rows (1..100,000; default
    ``BATCH_SIZE``), each in its own transaction (a savepoint when the caller holds one), in
    which the purge executor identifies itself to the write fence for this community and its
    current fence generation only (``SET LOCAL``: transaction-local, and cleared
    again before the batch ends). Other communities are never touched. The community row is
    kept. ``dry_run`` counts the rows and writes nothing.

    Returns a :class:`PurgeResult`. Raises ``ValidationError`` keyed ``community_id`` or
    ``batch_size``, :class:`CommunityNotFound`, or :class:`LifecycleError` when the community
    is ``active`` or ``quiescing``.
    """
    community_uuid = v.uuid_value(community_id, "community_id")
    size = v.int_in_range(
        batch_size if batch_size is not None else get_settings().batch_size, "batch_size", 1, MAX_PURGE_BATCH
    )
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
        pk = connection.ops.quote_name(cast(str, model._meta.pk.column))
        statement = PURGE_BATCH.format(table=table, pk=pk)
        deleted = 0
        while True:
            count = _delete_batch(statement, community, size)
            result.batches += 1
            deleted += count
            # A short batch usually means the table is done, but a batch that waited on a
            # concurrent purge's row locks can also come back short: check before moving on.
            if count < size and not model._base_manager.filter(community_id=community_uuid).exists():
                break
        result.deleted[model._meta.label] = deleted
    try:
        advance_community(community_uuid, "tombstone")
    except LifecycleError:
        # A concurrent purge of the same community finished first: the outcome is the same.
        if Community.objects.get(id=community_uuid).deletion_state != "tombstone":
            raise
    result.tombstoned = True
    return result
