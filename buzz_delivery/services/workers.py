"""The live workers registry (issue 17): each worker process says who it is and that it is alive;
and the tally of the maintenance runs (:func:`record_maintenance_run`).

One row per process in ``buzz_delivery_worker`` (:class:`~buzz_delivery.models.WorkerRegistration`),
keyed by a token the process draws at start. :func:`heartbeat_worker` inserts the row or, when
it exists, moves ``last_heartbeat`` to the database clock (``buzz_delivery_now()``);
:func:`deregister_worker` deletes it on a clean exit; :func:`prune_stale_workers` deletes the rows of processes that
stopped beating (killed, or their host lost). The table is not community-scoped (SPEC section
15: a local table on a Citus coordinator, like the maintenance lease), so these statements name
no community. Every statement is one short autocommit transaction; nothing is held between them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from buzz_delivery.models import MaintenanceRun, WorkerKind, WorkerRegistration
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, uuid_array
from buzz_delivery.services.sql import COMMUNITY, DB_NOW
from buzz_delivery.services.tenancy import fleet_scoped, tenant

WORKER = WorkerRegistration._meta.db_table
MAINTENANCE_RUN = MaintenanceRun._meta.db_table

# Seconds between heartbeats of a worker process; a row whose heartbeat is older than
# STALE_AFTER_SECONDS is shown as stale, older than PRUNE_AFTER_SECONDS the reaper deletes it.
HEARTBEAT_SECONDS = 10.0
STALE_AFTER_SECONDS = 3 * HEARTBEAT_SECONDS
PRUNE_AFTER_SECONDS = 600.0

HEARTBEAT = f"""
INSERT INTO {WORKER} AS w (id, kind, host, pid, name, detail, started_at, last_heartbeat)
VALUES (%(id)s, %(kind)s, %(host)s, %(pid)s, %(name)s, %(detail)s, {DB_NOW}, {DB_NOW})
ON CONFLICT (id) DO UPDATE SET last_heartbeat = {DB_NOW}
RETURNING w.last_heartbeat
"""

DEREGISTER = f"DELETE FROM {WORKER} AS w WHERE w.id = %(id)s RETURNING 1"

PRUNE_STALE = f"""
DELETE FROM {WORKER} AS w WHERE w.last_heartbeat < {DB_NOW} - make_interval(secs => %(older_than)s) RETURNING 1
"""


# The communities of a list that exist (in any lifecycle state): one read of the community table.
EXISTING_COMMUNITIES = f"SELECT c.id FROM {COMMUNITY} AS c WHERE c.id = ANY(%(ids)s::uuid[])"
# One community, read in its own tenant scope (the tenant role reads its community's row).
EXISTING_COMMUNITY = f"SELECT c.id FROM {COMMUNITY} AS c WHERE c.id = %(community_id)s"


# One statement counts the pass, keeps its summary and adds its counts to the job's totals
# (each key of either object: the old total plus this pass's count, missing = 0).
RECORD_MAINTENANCE_RUN = f"""
INSERT INTO {MAINTENANCE_RUN} AS m (name, runs, last_outcome, last_summary, totals, last_finished_at)
VALUES (%(name)s, 1, %(outcome)s, %(summary)s::jsonb, %(counts)s::jsonb, {DB_NOW})
ON CONFLICT (name) DO UPDATE
    SET runs = m.runs + 1, last_outcome = EXCLUDED.last_outcome, last_summary = EXCLUDED.last_summary,
        last_finished_at = EXCLUDED.last_finished_at,
        totals = (
            SELECT coalesce(jsonb_object_agg(k, coalesce((m.totals ->> k)::bigint, 0)
                                                + coalesce((EXCLUDED.totals ->> k)::bigint, 0)), '{{}}'::jsonb)
            FROM jsonb_object_keys(m.totals || EXCLUDED.totals) AS k
        )
"""
# Summary values that are not counts of work done, left out of the totals.
NOT_COUNTS = frozenset({"duration_ms"})


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """Who a worker process is: its registry ``id`` (drawn at start), ``kind``
    (:class:`~buzz_delivery.models.WorkerKind`), ``host``, ``pid``, a short ``name`` (the
    command) and a ``detail`` line (what it works on)."""

    id: uuid.UUID
    kind: str
    host: str
    pid: int
    name: str
    detail: str = ""

    def __post_init__(self) -> None:
        if self.kind not in WorkerKind.values:
            raise v.invalid("kind", f"must be one of {', '.join(WorkerKind.values)}, not {self.kind!r}")
        v.uuid_value(self.id, "id")
        v.int_in_range(self.pid, "pid", 1, 2**31 - 1)
        for field, value, most in (("host", self.host, 255), ("name", self.name, 200), ("detail", self.detail, 10_000)):
            v.optional_text(value, field, most)


def missing_communities(community_ids: Sequence[uuid.UUID | str]) -> list[uuid.UUID]:
    """The communities of ``community_ids`` that do not exist (no row in any lifecycle state),
    in the order given: what a worker starting on communities that are not provisioned yet warns
    about (it still starts, and waits for them). One fleet-scoped read of them all, then each one
    it did not see read again in its own tenant scope: a login that is a plain member of the
    tenant role without role switching (SPEC 13, check W020's hint) sees no community row in a
    fleet scope, but its own community's row in that community's scope."""
    ids = list(dict.fromkeys(v.uuid_value(c, "community_id") for c in community_ids))
    if not ids:
        return []
    found = _existing(ids)
    missing = []
    for community in (c for c in ids if c not in found):
        with tenant(community):
            if not fetch_all(EXISTING_COMMUNITY, {"community_id": community}):
                missing.append(community)
    return missing


@fleet_scoped
def _existing(ids: list[uuid.UUID]) -> set[uuid.UUID]:
    return {row[0] for row in fetch_all(EXISTING_COMMUNITIES, {"ids": uuid_array(ids)})}


@fleet_scoped
def heartbeat_worker(worker: WorkerIdentity) -> None:
    """Register ``worker`` or, if registered, set its ``last_heartbeat`` to the database clock
    (``buzz_delivery_now()``). A row pruned while its process was merely slow comes back
    (``started_at`` then says when it came back)."""
    fetch_all(
        HEARTBEAT,
        {
            "id": worker.id,
            "kind": worker.kind,
            "host": worker.host,
            "pid": worker.pid,
            "name": worker.name,
            "detail": worker.detail,
        },
    )


@fleet_scoped
def deregister_worker(worker_id: uuid.UUID) -> bool:
    """Delete the row of a worker that exits cleanly; False when it was not there."""
    return bool(fetch_all(DEREGISTER, {"id": v.uuid_value(worker_id, "worker_id")}))


@fleet_scoped
def prune_stale_workers(older_than_seconds: float = PRUNE_AFTER_SECONDS) -> int:
    """Delete the rows whose last heartbeat is older than ``older_than_seconds`` (database
    clock): processes that died without deregistering. Returns how many were deleted."""
    seconds = v.seconds_in_range(older_than_seconds, "older_than_seconds", 1.0, 10.0**7)
    return len(fetch_all(PRUNE_STALE, {"older_than": seconds}))


@fleet_scoped
def record_maintenance_run(job: str, summary: dict[str, Any]) -> None:
    """Count one finished pass of maintenance ``job`` and keep its ``summary`` (the command's
    summary line; its ``outcome`` key: ``ok``, ``busy``, ``stopped``, ``error``...) as the last
    one, stamped with the database clock; add each count of the summary (a non-negative
    integer other than ``duration_ms``: ``reclaimed``, ``exhausted``, ``batches``...) to the
    job's ``totals``, in the same statement (``buzz_leases_reclaimed_total`` on ``/metrics``)."""
    name = v.optional_text(job, "job", 100)
    if not name:
        raise v.invalid("job", "must be a non-empty job name")
    outcome = str(summary.get("outcome", ""))[:32]
    counts = {
        key: value
        for key, value in summary.items()
        if type(value) is int and 0 <= value < 2**63 and key not in NOT_COUNTS
    }
    fetch_all(
        RECORD_MAINTENANCE_RUN,
        {
            "name": name,
            "outcome": outcome,
            "summary": json.dumps(summary, default=str),
            "counts": json.dumps(counts),
        },
    )
