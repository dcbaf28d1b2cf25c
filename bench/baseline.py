"""The raw-SQL baseline: plain psycopg, no ORM, no Django.

Table ``bench_raw_delivery`` has the same columns as ``buzz_delivery_delivery`` but only a
primary key, the identity unique key (the producer's idempotent skip needs it), the polling
partial index and the reaper partial index: no CHECK constraints, no foreign keys, no write-fence
trigger and none of our other indexes. The statements are the cheapest correct ones: a claim
is one statement (``FOR UPDATE SKIP LOCKED``, generation bump, lease from ``now()``); a finish
is fenced by id, generation, status and ``lease_until >= now()``.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg

TABLE = "bench_raw_delivery"

CREATE_TABLE = f"""
DROP TABLE IF EXISTS {TABLE};
CREATE TABLE {TABLE} (
    id uuid PRIMARY KEY,
    community_id uuid NOT NULL,
    workflow_id uuid NOT NULL,
    run_id uuid NOT NULL,
    step_id varchar(64) NOT NULL,
    target_pubkey bytea NOT NULL,
    definition_event_id bytea NOT NULL,
    message_event_id bytea NOT NULL,
    cause_kind varchar(16) NOT NULL,
    cause_event_id bytea,
    cause_scheduled_for timestamptz,
    cause_webhook_invocation_id uuid,
    status varchar(16) NOT NULL DEFAULT 'pending',
    lease_generation bigint NOT NULL DEFAULT 0,
    lease_until timestamptz,
    claimed_at timestamptz,
    finished_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT now(),
    attempt integer NOT NULL DEFAULT 0,
    max_attempts integer,
    next_attempt_at timestamptz,
    expires_at timestamptz,
    failure_code varchar(64),
    failure_message text,
    execution_trace jsonb,
    trigger_context jsonb,
    CONSTRAINT bench_raw_identity_key UNIQUE (community_id, run_id, step_id, target_pubkey)
);
CREATE INDEX bench_raw_pending_poll_idx ON {TABLE} (community_id, target_pubkey, created_at, id)
    WHERE status = 'pending';
CREATE INDEX bench_raw_claimed_lease_idx ON {TABLE} (lease_until) WHERE status = 'claimed';
"""

# Claim: an InitPlan picks and locks the rows once; the UPDATE bumps the fence token.
CLAIM = f"""
UPDATE {TABLE} AS d
SET status = 'claimed',
    lease_generation = d.lease_generation + 1,
    attempt = d.attempt + 1,
    claimed_at = now(),
    lease_until = now() + make_interval(secs => %(lease_seconds)s)
WHERE d.id = ANY(ARRAY(
    SELECT c.id FROM {TABLE} AS c
    WHERE c.community_id = %(community_id)s AND c.target_pubkey = %(target_pubkey)s AND c.status = 'pending'
    ORDER BY c.created_at, c.id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
))
RETURNING d.id, d.lease_generation
"""

FINISH = f"""
UPDATE {TABLE}
SET status = 'finished', finished_at = now(), lease_until = NULL, claimed_at = NULL
WHERE id = %(id)s AND community_id = %(community_id)s AND target_pubkey = %(target_pubkey)s
  AND lease_generation = %(generation)s AND status = 'claimed' AND lease_until >= now()
"""

FINISH_BATCH = f"""
UPDATE {TABLE} AS d
SET status = 'finished', finished_at = now(), lease_until = NULL, claimed_at = NULL
FROM unnest(%(ids)s::uuid[], %(generations)s::bigint[]) AS f(id, generation)
WHERE d.id = f.id AND d.lease_generation = f.generation
  AND d.community_id = %(community_id)s AND d.target_pubkey = %(target_pubkey)s
  AND d.status = 'claimed' AND d.lease_until >= now()
"""

REAP = f"""
UPDATE {TABLE} AS d
SET status = 'pending', lease_generation = d.lease_generation + 1, lease_until = NULL, claimed_at = NULL
WHERE d.id = ANY(ARRAY(
    SELECT c.id FROM {TABLE} AS c
    WHERE c.status = 'claimed' AND c.lease_until < now()
    ORDER BY c.lease_until
    LIMIT %(batch_size)s
    FOR UPDATE SKIP LOCKED
)) AND d.status = 'claimed' AND d.lease_until < now()
"""

INSERT = f"""
WITH created AS (
    INSERT INTO {TABLE} (id, community_id, workflow_id, run_id, step_id, target_pubkey, definition_event_id,
                         message_event_id, cause_kind, cause_webhook_invocation_id, max_attempts)
    SELECT v.id, %(community_id)s, %(workflow_id)s, %(run_id)s, v.step_id, v.target_pubkey,
           %(definition_event_id)s, %(message_event_id)s, 'webhook', v.invocation_id, 3
    FROM unnest(%(ids)s::uuid[], %(step_ids)s::text[], %(targets)s::bytea[], %(invocations)s::uuid[])
        AS v(id, step_id, target_pubkey, invocation_id)
    ON CONFLICT ON CONSTRAINT bench_raw_identity_key DO NOTHING
    RETURNING id, target_pubkey
)
SELECT id, pg_notify('bench_raw', json_build_object(
    'community', %(community_id)s::text, 'delivery', id::text, 'target', encode(target_pubkey, 'hex'))::text)
FROM created
"""


def create_table(conn: psycopg.Connection) -> None:
    """(Re)create the baseline table and its two partial indexes."""
    conn.execute(CREATE_TABLE)


class RawClient:
    """One plain psycopg connection running the baseline statements for one community and target.

    ``prepare``: psycopg's default (statements prepared after 5 runs); ``False`` disables it."""

    def __init__(self, url: str, community_id: uuid.UUID, target_pubkey: bytes, *, prepare: bool = True):
        self.conn = psycopg.connect(url, autocommit=True, prepare_threshold=5 if prepare else None)
        self.community_id = community_id
        self.target_pubkey = target_pubkey

    def close(self) -> None:
        self.conn.close()

    def claim(self, limit: int = 1, lease_seconds: float = 60.0) -> list[tuple[Any, ...]]:
        """Claim up to ``limit`` rows; returns ``[(id, generation), ...]``."""
        params = {
            "community_id": self.community_id,
            "target_pubkey": self.target_pubkey,
            "limit": limit,
            "lease_seconds": lease_seconds,
        }
        return self.conn.execute(CLAIM, params).fetchall()

    def finish(self, delivery_id: uuid.UUID, generation: int) -> int:
        """Settle one claim; returns the row count (1 = settled)."""
        params = {
            "id": delivery_id,
            "generation": generation,
            "community_id": self.community_id,
            "target_pubkey": self.target_pubkey,
        }
        return self.conn.execute(FINISH, params).rowcount

    def finish_batch(self, claims: list[tuple[Any, ...]]) -> int:
        """Settle many claims in one statement; returns how many were settled."""
        params = {
            "ids": [c[0] for c in claims],
            "generations": [c[1] for c in claims],
            "community_id": self.community_id,
            "target_pubkey": self.target_pubkey,
        }
        return self.conn.execute(FINISH_BATCH, params).rowcount

    def reap(self, batch_size: int) -> int:
        """One reaper batch; returns how many leases it returned to pending."""
        return self.conn.execute(REAP, {"batch_size": batch_size}).rowcount
