"""The reaper (SPEC sections 4.6 and 6): returns lapsed leases to ``pending`` and ends
deliveries whose attempts or deadline ran out. Fleet-wide, in bounded batches."""

from __future__ import annotations

import logging

from buzz_delivery.conf import get_settings
from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.services import sql
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, translated_errors
from buzz_delivery.services.types import ReapResult

logger = logging.getLogger("buzz_delivery.reaper")


def _run_batch(statement: str, batch_size: int) -> list[str]:
    # A community fenced between the statement's snapshot and its trigger makes the
    # fence refuse the whole batch; the next statement's snapshot sees the new state.
    for attempt in (1, 2):
        try:
            with translated_errors():
                return [row[0] for row in fetch_all(statement, {"batch_size": batch_size})]
        except CommunityNotWritable:
            if attempt == 2:
                raise
            logger.info("a community was fenced during a reap batch; retrying the batch")
    return []


def reap(*, batch_size: int | None = None, max_batches: int | None = None, dry_run: bool = False) -> ReapResult:
    """Reap every community at once and return a :class:`ReapResult`.

    Lapsed leases (``claimed`` with ``lease_until < now()``) of active communities go back to
    ``pending`` with generation + 1, or end ``failed``/``attempts_exhausted`` on their last
    allowed attempt, or ``expired``/``delivery_expired`` past ``expires_at``. Pending
    deliveries past ``expires_at`` end ``expired``. Every move bumps the generation, so the
    prior holder is fenced. Communities that are not active are filtered out inside each
    statement, so one fenced tenant never aborts the reap of healthy ones; a community whose
    write-fence lock is held or awaited by a lifecycle move is skipped for that batch and
    counted in ``skipped_busy``, never waited on, so one tenant's move never stalls the others
    (a move that queues during a batch can make that batch come back short, which ends the
    run early; the next run picks the rest up).

    ``batch_size``: rows per statement (1..100,000; default ``BATCH_SIZE``), each statement
    its own short transaction. ``max_batches``: stop after that many statements (None = until
    done). ``dry_run``: count what would be done, write nothing.
    """
    size = v.int_in_range(batch_size if batch_size is not None else get_settings().batch_size, "batch_size", 1, 100_000)
    limit = v.int_in_range(max_batches, "max_batches", 1, 10**9) if max_batches is not None else None
    if dry_run:
        row = fetch_all(sql.COUNT_REAPABLE, {})[0]
        return ReapResult(reclaimed=row[0], exhausted=row[1], expired=row[2], skipped_fenced=row[3], dry_run=True)

    counts = {"pending": 0, "failed": 0, "expired": 0}
    batches = 0
    for statement in (sql.REAP_LAPSED_LEASES, sql.EXPIRE_OVERDUE_PENDING):
        while limit is None or batches < limit:
            statuses = _run_batch(statement, size)
            batches += 1
            for status in statuses:
                counts[status] += 1
            if len(statuses) < size:
                break
    skipped = fetch_all(sql.COUNT_FENCED_LAPSED, {})[0][0]
    busy = fetch_all(sql.COUNT_BUSY_LAPSED, {})[0][0]
    result = ReapResult(
        reclaimed=counts["pending"],
        exhausted=counts["failed"],
        expired=counts["expired"],
        skipped_fenced=skipped,
        skipped_busy=busy,
        batches=batches,
    )
    if result.total or skipped or busy:
        logger.info(
            "reaped %d deliveries: %d reclaimed, %d attempts exhausted, %d expired; %d skipped (community fenced); "
            "%d communities skipped (lifecycle move in progress)",
            result.total,
            result.reclaimed,
            result.exhausted,
            result.expired,
            skipped,
            busy,
        )
    return result


def reap_expired_deliveries(*, batch_size: int = 1000, max_batches: int | None = None) -> int:
    """Run :func:`reap` and return how many deliveries it moved (SPEC sections 4.6, 9)."""
    return reap(batch_size=batch_size, max_batches=max_batches).total
