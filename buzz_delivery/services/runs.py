"""Run-level actions on deliveries (SPEC section 11 "Cancel"): expiring a canceled run's
pending deliveries. Used by ``buzz_delivery.workflows``; the core never imports it."""

from __future__ import annotations

import time
import uuid

from django.db import transaction

from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, translated_errors
from buzz_delivery.services.ending import end_on_record
from buzz_delivery.services.sql import ACTIVE_COMMUNITY, END_RUN_EXPIRED, QUEUE, READ_DB_NOW, RECORD, ended_columns
from buzz_delivery.services.tenancy import tenant_scoped

RUN_CANCELED = "run_canceled"

# Pending rows only: a claimed delivery stays with its holder (whose settle still counts, or
# is ignored by a run that has ended). SKIP LOCKED: a pending row locked right now is being
# claimed or expired by the reaper, i.e. leaving pending anyway; never wait on it (a canceller
# holds the run's rows, which the settling side locks after its delivery row).
# Stage 2: the run is the record's (the queue has no run_id), the live state the queue's; the
# pending queue rows of the run's records are deleted and returned for end_on_record (no history
# entry and no new generation, as before the queue).
EXPIRE_PENDING_OF_RUN = f"""
WITH candidate AS MATERIALIZED (
    SELECT d.id FROM {QUEUE} AS d
    JOIN {RECORD} AS r ON r.community_id = d.community_id AND r.id = d.id
    WHERE d.community_id = %(community_id)s AND r.community_id = %(community_id)s AND r.run_id = %(run_id)s
      AND d.status = 'pending' AND {ACTIVE_COMMUNITY}
    ORDER BY d.id
    LIMIT %(limit)s
    FOR UPDATE OF d SKIP LOCKED
)
DELETE FROM {QUEUE} AS d
USING candidate
WHERE d.community_id = %(community_id)s AND d.id = candidate.id AND d.status = 'pending'
RETURNING {ended_columns("'expired'", "%(failure_code)s", "%(failure_message)s", "d.lease_generation")}
"""

# What a short batch left: the run's pending queue rows, read without a lock.
PENDING_OF_RUN_LEFT = f"""
SELECT EXISTS (
    SELECT 1 FROM {QUEUE} AS d
    JOIN {RECORD} AS r ON r.community_id = d.community_id AND r.id = d.id
    WHERE d.community_id = %(community_id)s AND r.community_id = %(community_id)s AND r.run_id = %(run_id)s
      AND d.status = 'pending' AND {ACTIVE_COMMUNITY}
)
"""
# Those of the runs with a pending queue row left, read without a lock (run_deliveries_left).
PENDING_OF_RUNS_LEFT = f"""
SELECT DISTINCT r.run_id FROM {QUEUE} AS d
JOIN {RECORD} AS r ON r.community_id = d.community_id AND r.id = d.id
WHERE d.community_id = %(community_id)s AND r.community_id = %(community_id)s AND r.run_id = ANY (%(run_ids)s::uuid[])
  AND d.status = 'pending' AND {ACTIVE_COMMUNITY}
"""
# Reads of PENDING_OF_RUN_LEFT after short batches, and the pause between (about 2 s in all).
LOCKED_TRIES = 100
LOCKED_PAUSE = 0.02


@tenant_scoped
def expire_run_deliveries(
    community_id: uuid.UUID | str,
    run_id: uuid.UUID | str,
    *,
    failure_code: str = RUN_CANCELED,
    batch_size: int = 10_000,
) -> int:
    """Expire every ``pending`` delivery of one workflow run: status ``expired``,
    ``finished_at`` from the database clock, ``failure_code`` (default ``run_canceled``).

    One fenced statement per batch of at most ``batch_size`` (1..100,000) rows, in the caller's
    transaction when it has one; the community must be ``active`` (checked inside the
    statement: a fenced community's rows are left alone and 0 is returned). Claimed deliveries
    are not touched; rows locked by a concurrent claim or reap are skipped, then read again without
    a lock until none is left pending (a limited claim may lock rows it leaves pending), for about
    two seconds at most. Returns how many were expired.

    Raises ``ValidationError`` keyed ``community_id``, ``run_id``, ``failure_code`` or
    ``batch_size`` before any SQL. SPEC sections 4 and 11.
    """
    params = {
        "community_id": v.uuid_value(community_id, "community_id"),
        "run_id": v.uuid_value(run_id, "run_id"),
        "failure_code": v.optional_text(failure_code, "failure_code", 64),
        "failure_message": "the workflow run was canceled",
        "limit": v.int_in_range(batch_size, "batch_size", 1, 100_000),
    }
    limit = params["limit"]
    assert isinstance(limit, int)
    if not params["failure_code"]:
        raise v.invalid("failure_code", "must not be empty")
    total = 0
    tries = LOCKED_TRIES
    while True:
        # Two statements, one transaction: the queue rows deleted (the fence), then the records.
        with translated_errors(), transaction.atomic():
            params["now"] = fetch_all(READ_DB_NOW, {})[0][0]
            rows = end_on_record(
                END_RUN_EXPIRED, params["community_id"], params["now"], fetch_all(EXPIRE_PENDING_OF_RUN, params)
            )
        total += len(rows)
        if len(rows) < limit:
            # A short batch skipped the rows locked right now. Most leave pending (a claim that
            # takes them, the reaper), but a claim under a concurrency limit also locks the
            # candidates it finds no slot for and leaves them pending: read again (no lock, never
            # waiting on a row) until none is left, a few milliseconds apart, a bounded number of times.
            tries -= 1
            if tries <= 0 or not fetch_all(PENDING_OF_RUN_LEFT, params)[0][0]:
                return total
            time.sleep(LOCKED_PAUSE)


@tenant_scoped
def run_deliveries_left(community_id: uuid.UUID | str, run_ids: list[uuid.UUID]) -> set[uuid.UUID]:
    """Those of ``run_ids`` that still have a ``pending`` delivery, read without a lock (one
    statement, in the caller's transaction when it has one): after
    :func:`expire_run_deliveries`, the runs whose rows stayed locked past its tries. A caller
    that marks a run's deliveries as expired keeps the mark for these, to try again later.

    Raises ``ValidationError`` keyed ``community_id`` or ``run_ids`` before any SQL."""
    community = v.uuid_value(community_id, "community_id")
    runs = [v.uuid_value(r, f"run_ids[{i}]") for i, r in enumerate(run_ids)]
    if not runs:
        return set()
    with translated_errors():
        return {row[0] for row in fetch_all(PENDING_OF_RUNS_LEFT, {"community_id": community, "run_ids": runs})}
