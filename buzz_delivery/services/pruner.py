"""The pruner (SPEC section 8): deletes terminal deliveries older than a retention age.

Only ``finished``, ``failed`` and ``expired`` rows are ever deleted, and only once their
``finished_at`` is older than the retention given for their status, judged by the database
clock. The walk reads a community's rows by ``created_at`` (``delivery_community_created_idx``),
which a terminal's ``finished_at`` never precedes: no index of the record names a column the
terminal writes, so that UPDATE is HOT (core migration 0039). The pruner also deletes the settle
tally's rows older than :data:`~buzz_delivery.models.SETTLE_TALLY_KEEP` (the longest window its
readers count), a community at a time. Each batch is one ``DELETE`` statement (its own short transaction in autocommit)
that re-checks its whole guard. Rows of a community that is not ``active`` are filtered out
inside the statement (the write fence would refuse them) and reported as skipped; rows of a
community whose write-fence lock a lifecycle move holds or waits for are left for the next
batch or run, never waited on (SPEC section 4.6), so one tenant's move never stalls the pruner.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from buzz_delivery.conf import get_settings
from buzz_delivery.models import SETTLE_TALLY_KEEP, TERMINAL_STATUSES, DeliveryRecord
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all
from buzz_delivery.services.reaper import community_batch, walk_communities
from buzz_delivery.services.sql import ACTIVE_COMMUNITY, COMMUNITY, MAINTENANCE_NOW, QUEUE, SETTLE_TALLY
from buzz_delivery.services.tenancy import fleet_scoped

logger = logging.getLogger("buzz_delivery.pruner")

# Terminal rows are the record's alone (stage 2: a live delivery has a queue row and a pending
# record), so the pruner reads and deletes the record only, through its (community, created_at) index.
RECORD = DeliveryRecord._meta.db_table
# Longest retention accepted (the prune command's limit too): beyond it PostgreSQL's interval
# and timestamp arithmetic wrap or overflow.
MAX_RETENTION = dt.timedelta(days=36_500)
PRUNABLE_STATUSES: tuple[str, ...] = tuple(s.value for s in TERMINAL_STATUSES)


# created_at bounds the walk (the index's order; a terminal's finished_at never precedes it),
# status and finished_at keep the guard exact.
def _old_enough(now: str) -> str:
    cutoff = f"{now} - make_interval(secs => %(age_seconds)s)"
    return f"d.created_at < {cutoff} AND d.status = %(status)s AND d.finished_at < {cutoff}"


_OLD_ENOUGH_AT = _old_enough("%(now)s::timestamptz")
_OLD_ENOUGH = _old_enough(MAINTENANCE_NOW)

# The walk: active communities holding old-enough rows of the status, in id order (one walk of
# delivery_community_created_idx, which leads with community_id, per community).
COMMUNITIES_TO_PRUNE = f"""
SELECT c.id FROM {COMMUNITY} AS c
WHERE c.deletion_state = 'active' AND c.id > %(after)s
  AND EXISTS (SELECT 1 FROM {RECORD} AS d WHERE d.community_id = c.id AND {_OLD_ENOUGH_AT})
ORDER BY c.id
LIMIT %(page)s
"""
# One community's batch, oldest first (by creation: the index's order).
DELETE_TERMINAL_OLDER_THAN = f"""
WITH batch AS MATERIALIZED (
    SELECT d.id FROM {RECORD} AS d
    WHERE d.community_id = %(community_id)s AND {_OLD_ENOUGH_AT} AND {ACTIVE_COMMUNITY}
      AND NOT EXISTS (SELECT 1 FROM {QUEUE} AS q WHERE q.community_id = %(community_id)s AND q.id = d.id)
    ORDER BY d.created_at
    LIMIT %(batch_size)s
    FOR UPDATE OF d SKIP LOCKED
)
DELETE FROM {RECORD} AS d
USING batch
WHERE d.community_id = %(community_id)s AND d.id = batch.id AND {_OLD_ENOUGH_AT}
RETURNING d.id
"""

# The settle tally's rows past what its readers count: the active communities holding some, then
# one community's batch, oldest first (its primary key, community_id and at first).
_TALLY_OLD = "d.at < %(now)s::timestamptz - make_interval(secs => %(keep_seconds)s)"
COMMUNITIES_WITH_OLD_TALLY = f"""
SELECT c.id FROM {COMMUNITY} AS c
WHERE c.deletion_state = 'active' AND c.id > %(after)s
  AND EXISTS (SELECT 1 FROM {SETTLE_TALLY} AS d WHERE d.community_id = c.id AND {_TALLY_OLD})
ORDER BY c.id
LIMIT %(page)s
"""
DELETE_OLD_TALLY = f"""
WITH batch AS MATERIALIZED (
    SELECT d.at, d.id FROM {SETTLE_TALLY} AS d
    WHERE d.community_id = %(community_id)s AND {_TALLY_OLD} AND {ACTIVE_COMMUNITY}
    ORDER BY d.at
    LIMIT %(batch_size)s
)
DELETE FROM {SETTLE_TALLY} AS d
USING batch
WHERE d.community_id = %(community_id)s AND d.at = batch.at AND d.id = batch.id
RETURNING d.id
"""

COUNT_PRUNABLE = f"SELECT count(*) FROM {RECORD} AS d WHERE {_OLD_ENOUGH} AND {ACTIVE_COMMUNITY}"

# Starts from the (few) communities that are not active, so it never walks the whole table.
COUNT_FENCED_OLD_ENOUGH = f"""
SELECT count(*) FROM {COMMUNITY} AS c
JOIN {RECORD} AS d ON d.community_id = c.id
WHERE c.deletion_state <> 'active' AND {_OLD_ENOUGH}
"""


@dataclass(frozen=True, slots=True)
class PruneResult:
    """What one prune did (or, with ``dry_run``, would do). Counts of deliveries.

    - ``deleted``: per terminal status pruned, rows deleted (would be deleted);
    - ``skipped_fenced``: old-enough terminal rows left alone because their community is not
      ``active`` (the write fence; a fenced community is emptied by ``purge_community``);
    - ``batches``: DELETE statements of deliveries run (0 with ``dry_run``);
    - ``tally``: settle tally rows deleted, past :data:`SETTLE_TALLY_KEEP` (0 with ``dry_run``).
    """

    deleted: dict[str, int] = field(default_factory=dict)
    skipped_fenced: int = 0
    batches: int = 0
    dry_run: bool = False
    tally: int = 0

    @property
    def total(self) -> int:
        return sum(self.deleted.values())


def _retention(retention: Mapping[str, dt.timedelta]) -> dict[str, float]:
    if not isinstance(retention, Mapping) or not retention:
        raise v.invalid("retention", "must map at least one terminal status to a timedelta")
    ages: dict[str, float] = {}
    for status, age in retention.items():
        if status not in PRUNABLE_STATUSES:
            raise v.invalid("retention", f"{status!r} is not a terminal status ({', '.join(PRUNABLE_STATUSES)})")
        ages[status] = v.positive_timedelta_seconds(age, "retention", MAX_RETENTION)
    return ages


@fleet_scoped
def prune_deliveries(
    retention: Mapping[str, dt.timedelta],
    *,
    batch_size: int | None = None,
    max_batches: int | None = None,
    dry_run: bool = False,
) -> PruneResult:
    """Delete terminal deliveries whose ``finished_at`` is older than their status's retention.

    ``retention``: terminal status (``finished``, ``failed``, ``expired``) -> minimum age
    (a positive :class:`datetime.timedelta`); statuses not named are never pruned.
    ``batch_size``: rows per DELETE (1..100,000; default ``BATCH_SIZE``), each its own short
    transaction (a savepoint inside a caller's), one community at a time: the prune walks the
    active communities that hold old-enough rows (SPEC section 15), and leaves one whose
    write-fence lock a lifecycle move holds for a later run. ``max_batches``: stop after that many statements
    (None = until done). ``dry_run``: count what would be deleted, delete nothing.

    Non-terminal rows are never deleted. Returns a :class:`PruneResult`; raises
    ``ValidationError`` (``retention``, ``batch_size``, ``max_batches``) before any SQL.
    """
    ages = _retention(retention)
    size = v.int_in_range(batch_size if batch_size is not None else get_settings().batch_size, "batch_size", 1, 100_000)
    limit = v.int_in_range(max_batches, "max_batches", 1, 10**9) if max_batches is not None else None

    deleted: dict[str, int] = {}
    skipped = 0
    batches = 0
    for status, age_seconds in ages.items():
        params: dict[str, object] = {"status": status, "age_seconds": age_seconds, "batch_size": size}
        skipped += fetch_all(COUNT_FENCED_OLD_ENOUGH, params)[0][0]
        if dry_run:
            deleted[status] = fetch_all(COUNT_PRUNABLE, params)[0][0]
            continue
        deleted[status] = 0
        now = fetch_all("SELECT now()", {})[0][0]
        for community in walk_communities(COMMUNITIES_TO_PRUNE, {**params, "now": now}):
            while limit is None or batches < limit:
                rows = community_batch(DELETE_TERMINAL_OLDER_THAN, {**params, "community_id": community})
                batches += 1
                if rows is None:  # its fence lock is busy (a lifecycle move): the next run
                    break
                deleted[status] += len(rows)
                if len(rows) < size:
                    break
            if limit is not None and batches >= limit:
                break
    tally = 0 if dry_run else _prune_tally(size)
    result = PruneResult(deleted=deleted, skipped_fenced=skipped, batches=batches, dry_run=dry_run, tally=tally)
    if not dry_run and (result.total or skipped):
        # DEBUG, as the reaper's line: prune_deliveries prints these counts in its summary line.
        logger.debug(
            "pruned %d terminal deliveries (%s); %d skipped (community not active)",
            result.total,
            ", ".join(f"{s} {n}" for s, n in deleted.items()),
            skipped,
        )
    return result


def _prune_tally(size: int) -> int:
    """Delete the settle tally's rows older than :data:`SETTLE_TALLY_KEEP`, a community and a batch
    at a time (a community whose fence lock is busy is left for the next run); returns how many."""
    params: dict[str, object] = {"keep_seconds": SETTLE_TALLY_KEEP.total_seconds(), "batch_size": size}
    now = fetch_all("SELECT now()", {})[0][0]
    deleted = 0
    for community in walk_communities(COMMUNITIES_WITH_OLD_TALLY, {**params, "now": now}):
        while True:
            rows = community_batch(DELETE_OLD_TALLY, {**params, "community_id": community})
            if rows is None:
                break
            deleted += len(rows)
            if len(rows) < size:
                break
    return deleted
