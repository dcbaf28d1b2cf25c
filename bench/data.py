"""Benchmark data: tenants (community, workflow, run, message event) and set-based loaders.

Rows are loaded with ``INSERT ... SELECT generate_series`` in one transaction with
``session_replication_role = replica``, so loading skips the write-fence trigger and the foreign
key checks (the rows are consistent by construction). Every *measured* statement runs with
all triggers and keys on.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import psycopg

from bench.baseline import TABLE as RAW_TABLE

OURS = "buzz_delivery_delivery_record"
# The live state of our pending and claimed rows (issue 31, stage 2): one queue row each.
QUEUE = "buzz_delivery_delivery_queue"
BUZZ_TABLES = (
    "buzz_delivery_delivery_record",
    "buzz_delivery_event",
    "buzz_delivery_workflow_run",
    "buzz_delivery_workflow",
    "buzz_delivery_community",
)
DEFINITION_EVENT_ID = bytes(32)

# Per status: (status, lease_generation, attempt, lease_until, claimed_at, finished_at). Our
# record says 'pending' for a live row, claimed or not (its queue row holds the live state:
# :data:`LIVE_COLUMNS`); the baseline table has no queue and says 'claimed' itself.
STATUS_COLUMNS = {
    "pending": "'pending', 0, 0, NULL::timestamptz, NULL::timestamptz, NULL::timestamptz",
    "finished": "'finished', 1, 1, NULL::timestamptz, NULL::timestamptz, now()",
    "lapsed": "'claimed', 1, 1, now() - interval '1 minute', now() - interval '2 minutes', NULL::timestamptz",
}
RECORD_STATUS = {**STATUS_COLUMNS, "lapsed": STATUS_COLUMNS["pending"]}
# A live row's queue state: (status, lease_generation, attempt, lease_until, claimed_at).
LIVE_COLUMNS = {
    "pending": "'pending', 0, 0, NULL::timestamptz, NULL::timestamptz",
    "lapsed": "'claimed', 1, 1, now() - interval '1 minute', now() - interval '2 minutes'",
}

# The queue rows of the live records ``LOAD`` inserted (its RETURNING, as CTE ``loaded``): what
# a commit writes beside the record, the immutable columns copied.
QUEUE_LOADED = f"""
INSERT INTO {QUEUE} (
    id, community_id, target_pubkey, workflow_id, priority, created_at, max_attempts, next_attempt_at,
    expires_at, history, status, lease_generation, attempt, lease_until, claimed_at)
SELECT r.id, r.community_id, r.target_pubkey, r.workflow_id, r.priority, r.created_at, r.max_attempts,
    r.next_attempt_at, r.expires_at, r.history, {{live_columns}}
FROM loaded AS r
"""
# Queue rows for every pending record of a community that has none (rows a loader inserted into
# the record by other means): the commit's copy, never claimed.
QUEUE_PENDING = f"""
INSERT INTO {QUEUE} (
    id, community_id, target_pubkey, workflow_id, priority, created_at, max_attempts, next_attempt_at,
    expires_at, history, status, lease_generation, attempt)
SELECT r.id, r.community_id, r.target_pubkey, r.workflow_id, r.priority, r.created_at, r.max_attempts,
    r.next_attempt_at, r.expires_at, r.history, 'pending', r.lease_generation, r.attempt
FROM {OURS} AS r
WHERE r.community_id = %(community_id)s AND r.status = 'pending'
  AND NOT EXISTS (SELECT 1 FROM {QUEUE} AS q WHERE q.community_id = r.community_id AND q.id = r.id)
"""

LOAD = """
INSERT INTO {table} (
    id, community_id, workflow_id, run_id, step_id, target_pubkey, definition_event_id, message_event_id,
    cause_kind, cause_webhook_invocation_id, max_attempts,
    status, lease_generation, attempt, lease_until, claimed_at, finished_at, created_at{priority_column})
SELECT
    (lpad(to_hex(%(base)s::bigint + g.i), 16, '0') || substr(md5(%(tag)s || g.i::text), 1, 16))::uuid,
    %(community_id)s, %(workflow_id)s, %(run_id)s, %(tag)s || '-' || g.i,
    sha256(convert_to('bench-target-' || (%(first_target)s + mod(g.i, %(targets)s)), 'UTF8')),
    %(definition_event_id)s, %(message_event_id)s, 'webhook', md5(%(tag)s || g.i::text)::uuid, 3,
    {status_columns},
    now() - make_interval(secs => %(count)s - g.i) / 1000000{priority_value}
FROM generate_series(0, %(count)s - 1) AS g(i)
"""


def target(index: int) -> bytes:
    """The 32-byte public key of bench target ``index`` (same formula as the loader's SQL)."""
    import hashlib

    return hashlib.sha256(f"bench-target-{index}".encode()).digest()


@dataclass(frozen=True)
class Tenant:
    """One community with one workflow, run and message event to hang deliveries on."""

    community_id: uuid.UUID
    workflow_id: uuid.UUID
    run_id: uuid.UUID
    event_pk: int
    event_id: bytes


def reset(conn: psycopg.Connection) -> None:
    """Empty every buzz_delivery table and the baseline table."""
    conn.execute(f"TRUNCATE {', '.join(BUZZ_TABLES)}, {RAW_TABLE} CASCADE")


def clear_deliveries(conn: psycopg.Connection) -> None:
    """Empty both delivery tables (tenants stay), and what references a delivery (the tasks
    backend's results)."""
    conn.execute(f"TRUNCATE {OURS}, {RAW_TABLE} CASCADE")


def create_tenants(count: int) -> list[Tenant]:
    """Create ``count`` active communities, each with a workflow, a run and a message event (ORM)."""
    from buzz_delivery.testing import EventFactory, WorkflowRunFactory

    tenants = []
    for _ in range(count):
        run = WorkflowRunFactory()
        event = EventFactory(community=run.community)
        tenants.append(Tenant(run.community_id, run.workflow_id, run.id, event.pk, bytes(event.event_id)))
    return tenants


_load_counter = 0


def load(
    conn: psycopg.Connection,
    tenant: Tenant,
    count: int,
    *,
    status: str = "pending",
    table: str = OURS,
    first_target: int = 0,
    targets: int = 1,
    priorities: bool = False,
) -> None:
    """Insert ``count`` rows of ``status`` (pending | finished | lapsed) for one tenant, spread
    round-robin over targets ``first_target .. first_target + targets - 1``, oldest first.
    ``priorities``: spread the rows over every priority, -10..10 (our table only: the baseline
    has no priority), else each has the default, 0."""
    global _load_counter
    _load_counter += 1
    params = {
        "base": time.time_ns() // 1000,
        "tag": f"b{_load_counter}-{uuid.uuid4().hex[:8]}",
        "community_id": tenant.community_id,
        "workflow_id": tenant.workflow_id,
        "run_id": tenant.run_id,
        "first_target": first_target,
        "targets": targets,
        "definition_event_id": DEFINITION_EVENT_ID,
        "message_event_id": tenant.event_id,
        "count": count,
    }
    if priorities and table != OURS:
        raise ValueError("priorities: only our table has a priority column")
    statement = LOAD.format(
        table=table,
        status_columns=(RECORD_STATUS if table == OURS else STATUS_COLUMNS)[status],
        priority_column=", priority" if priorities else "",
        # A scattered spread (7 is prime to 21): neighbours in age differ in priority.
        priority_value=",\n    mod(g.i * 7, 21) - 10" if priorities else "",
    )
    if table == OURS and status in LIVE_COLUMNS:  # the record and its queue row, one statement
        statement = f"WITH loaded AS ({statement} RETURNING *)\n" + QUEUE_LOADED.format(
            live_columns=LIVE_COLUMNS[status]
        )
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")
        conn.execute(statement, params)


def queue_pending(conn: psycopg.Connection, community_id: uuid.UUID) -> int:
    """Give every pending record of ``community_id`` that has no queue row its queue row (as a
    commit writes it), for rows loaded into the record by other means than :func:`load`; the
    number of rows queued."""
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")
        return conn.execute(QUEUE_PENDING, {"community_id": community_id}).rowcount


def load_both(conn: psycopg.Connection, tenant: Tenant, count: int, **kwargs: object) -> None:
    """The same rows into our table and the baseline table."""
    load(conn, tenant, count, table=OURS, **kwargs)  # type: ignore[arg-type]
    load(conn, tenant, count, table=RAW_TABLE, **kwargs)  # type: ignore[arg-type]


def analyze(conn: psycopg.Connection, *, vacuum: bool = False) -> None:
    """ANALYZE (or VACUUM ANALYZE) the delivery tables (ours: the record and the queue). The
    VACUUM forces index cleanup: by default PostgreSQL skips it when few pages hold dead rows,
    which leaves the dead entries of earlier claims at the head of the polling index."""
    verb = "VACUUM (ANALYZE, INDEX_CLEANUP ON)" if vacuum else "ANALYZE"
    for table in (OURS, QUEUE, RAW_TABLE, "buzz_delivery_community"):
        conn.execute(f"{verb} {table}")


def count_status(conn: psycopg.Connection, table: str, status: str) -> int:
    return conn.execute(f"SELECT count(*) FROM {table} WHERE status = %s", [status]).fetchone()[0]
