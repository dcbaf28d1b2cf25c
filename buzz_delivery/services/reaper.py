"""The reaper (SPEC sections 4.6 and 6): returns lapsed leases to ``pending`` and ends
deliveries whose attempts or deadline ran out. Fleet-wide, by walking communities in bounded
batches (SPEC section 15)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

from django.db import OperationalError, connection, transaction

from buzz_delivery import tracing
from buzz_delivery.conf import get_settings
from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.services import sql
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import LOCK_NOT_AVAILABLE, fetch_all, translated_errors
from buzz_delivery.services.ending import RecordOutOfStep, end_on_record
from buzz_delivery.services.tenancy import fleet_scoped
from buzz_delivery.services.types import ReapResult

logger = logging.getLogger("buzz_delivery.reaper")

# How long one community's batch may wait for its write-fence lock before the walk moves on:
# a lifecycle move holds it exclusively (or queues for it) while writers finish, and one
# tenant's move must never stall the maintenance of the others (SPEC section 4.6).
FENCE_WAIT_MS = 200
# Communities read per page of the walk.
WALK_PAGE = 500
_NIL = uuid.UUID(int=0)


def walk_communities(statement: str, params: dict[str, object]) -> Iterator[uuid.UUID]:
    """Yield the community ids ``statement`` selects, a page at a time in id order.

    ``statement`` takes ``%(after)s`` (the last id seen) and ``%(page)s`` plus ``params``."""
    after = _NIL
    while True:
        page = [row[0] for row in fetch_all(statement, {**params, "after": after, "page": WALK_PAGE})]
        yield from page
        if len(page) < WALK_PAGE:
            return
        after = page[-1]


def community_batch(
    statement: str,
    params: dict[str, object],
    then: Callable[[list[tuple[object, ...]], object], list[tuple[object, ...]]] | None = None,
) -> list[tuple[object, ...]] | None:
    """Run one community's maintenance batch in its own transaction (a savepoint inside a
    caller's) and return its rows; ``None`` when the community's fence lock was not free within
    :data:`FENCE_WAIT_MS` or the community stopped being writable meanwhile. ``then``, when
    given, takes the statement's rows and the batch's ``now`` and returns the batch's rows, in
    the same transaction and under the same lock bound (a terminal move's second statement, on
    the record: services/ending.py).

    The transaction reads ``now()`` once and hands it to the statement as ``%(now)s``, and
    bounds lock waits with ``SET LOCAL lock_timeout`` (which Citus propagates to the node that
    owns the community with ``citus.propagate_set_commands = 'local'``), in one round trip;
    inside a caller's transaction, the caller's own ``lock_timeout`` is put back before the
    batch ends. In autocommit a batch costs four round trips: BEGIN, the bound and the clock,
    the statement, COMMIT."""
    nested = connection.in_atomic_block
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                if nested:
                    cursor.execute("SELECT current_setting('lock_timeout')")
                    previous = cursor.fetchone()[0]
                # One round trip: the bound and the clock of this batch's transaction.
                cursor.execute(f"SET LOCAL lock_timeout = {int(FENCE_WAIT_MS)}; SELECT now()")
                cursor.nextset()
                now = cursor.fetchone()[0]
            with translated_errors():
                rows = fetch_all(statement, {**params, "now": now})
                if then is not None:
                    rows = then(rows, now)
            if nested:  # the caller's transaction goes on: give it its own bound back
                fetch_all("SELECT set_config('lock_timeout', %(previous)s, true)", {"previous": previous})
            return rows
    except OperationalError as exc:
        if getattr(exc.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE:
            return None
        raise
    except CommunityNotWritable:
        return None


@dataclass
class _Tally:
    counts: dict[str, int] = field(default_factory=lambda: {"pending": 0, "failed": 0, "expired": 0})
    batches: int = 0
    busy: set[uuid.UUID] = field(default_factory=set)


def _end_batch(community: uuid.UUID, end: str, rows: list[tuple[object, ...]], now: object) -> list[tuple[object, ...]]:
    """A batch's rows as ``(id, status)``: the ones moved back to pending as the queue statement
    returned them, the ended ones as their records took them (``end``: an ``sql.END_*``)."""
    moved = [(row[0], "pending") for row in rows if row[1] == "pending"]
    ended = [row for row in rows if row[1] != "pending"]
    return [*moved, *end_on_record(end, community, now, ended)]


def _reap_community(community: uuid.UUID, size: int, limit: int | None, tally: _Tally) -> bool:
    """Reap one community until it is done or the batch budget ends; False when the budget ended."""
    for statement, end in ((sql.REAP_LAPSED_LEASES, sql.END_REAPED), (sql.EXPIRE_OVERDUE_PENDING, sql.END_EXPIRED)):
        while True:
            if limit is not None and tally.batches >= limit:
                return False
            try:
                rows = community_batch(
                    statement, {"community_id": community, "batch_size": size}, partial(_end_batch, community, end)
                )
            except RecordOutOfStep as exc:
                # An invariant broken in this community's rows (its batch rolled back whole): an
                # operator's case, not a reason to stop reaping every community after it.
                logger.error("reap of community %s left: record out of step with its queue row: %s", community, exc)
                rows = None
            tally.batches += 1
            if rows is None:
                tally.busy.add(community)
                return True
            for _, status in rows:
                tally.counts[str(status)] += 1
            if len(rows) < size:
                break
    return True


def planned_batches(plan: list[tuple[int, int]], size: int, limit: int | None) -> int:
    """The statements :func:`reap` runs for communities with ``(lapsed, overdue)`` rows: per
    community and statement, full batches until one comes back short (so ``n // size + 1``),
    at most ``limit`` in all. What a dry run reports as ``batches``."""
    total = sum(lapsed // size + 1 + overdue // size + 1 for lapsed, overdue in plan)
    return total if limit is None else min(total, limit)


@tracing.traced("buzz.reap")
@fleet_scoped
def reap(*, batch_size: int | None = None, max_batches: int | None = None, dry_run: bool = False) -> ReapResult:
    """Reap every community and return a :class:`ReapResult`.

    Lapsed leases (``claimed`` with ``lease_until < now()``) of active communities go back to
    ``pending`` with generation + 1, or end ``failed``/``attempts_exhausted`` on their last
    allowed attempt, or ``expired``/``delivery_expired`` past ``expires_at``. Pending
    deliveries past ``expires_at`` end ``expired``. Every move bumps the generation, so the
    prior holder is fenced.

    The reap walks the active communities that have work (:data:`sql.COMMUNITIES_TO_REAP`),
    and for each runs batches of at most ``batch_size`` rows, each one statement naming that
    community, in its own short transaction. Communities that are not active are filtered out
    inside each statement, so one fenced tenant never aborts the reap of healthy ones; a
    community whose write-fence lock a lifecycle move holds or awaits is left after
    :data:`FENCE_WAIT_MS` and counted in ``skipped_busy``, so one tenant's move never stalls
    the others (the next run picks it up).

    ``batch_size``: rows per statement (1..100,000; default ``BATCH_SIZE``). ``max_batches``:
    stop after that many statements (None = until done). ``dry_run``: count what would be
    done, and the batches it would take (:func:`planned_batches`), write nothing. Raises
    ``ValidationError`` naming the argument.
    """
    size = v.int_in_range(batch_size if batch_size is not None else get_settings().batch_size, "batch_size", 1, 100_000)
    limit = v.int_in_range(max_batches, "max_batches", 1, 10**9) if max_batches is not None else None
    if dry_run:
        row = fetch_all(sql.COUNT_REAPABLE, {})[0]
        plan = [(lapsed, overdue) for _, lapsed, overdue in fetch_all(sql.REAP_PLAN, {})]
        return ReapResult(
            reclaimed=row[0],
            exhausted=row[1],
            expired=row[2],
            skipped_fenced=row[3],
            batches=planned_batches(plan, size, limit),
            dry_run=True,
        )

    tally = _Tally()
    now = fetch_all("SELECT now()", {})[0][0]
    for community in walk_communities(sql.COMMUNITIES_TO_REAP, {"now": now}):
        if not _reap_community(community, size, limit, tally):
            break
    skipped = fetch_all(sql.COUNT_FENCED_LAPSED, {})[0][0]
    counts = tally.counts
    result = ReapResult(
        reclaimed=counts["pending"],
        exhausted=counts["failed"],
        expired=counts["expired"],
        skipped_fenced=skipped,
        skipped_busy=len(tally.busy),
        batches=tally.batches,
    )
    if result.total or skipped or tally.busy:
        # DEBUG: the caller reports these counts (the commands' summary line on stdout, the
        # admin's message); at INFO every cron pass that did work wrote to stderr and cron mailed it.
        logger.debug(
            "reaped %d deliveries: %d reclaimed, %d attempts exhausted, %d expired; %d skipped (community fenced); "
            "%d communities skipped (lifecycle move in progress)",
            result.total,
            result.reclaimed,
            result.exhausted,
            result.expired,
            skipped,
            len(tally.busy),
        )
    return result


def reap_expired_deliveries(*, batch_size: int = 1000, max_batches: int | None = None) -> int:
    """Run :func:`reap` and return how many deliveries it moved (SPEC sections 4.6, 9)."""
    return reap(batch_size=batch_size, max_batches=max_batches).total
