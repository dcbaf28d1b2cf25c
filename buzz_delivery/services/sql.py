"""Every statement that changes delivery state, named for its guard.

Lease arithmetic uses the database clock only (SPEC section 4), read as
``buzz_delivery_now()`` (:data:`DB_NOW`, migration 0006), which is ``statement_timestamp()``:
the start of the statement, not of the transaction, so a lease call made inside a caller's long
transaction still judges and grants leases by the time it runs (``now()`` would be the
transaction's start). Statements that
pick rows lock them with ``FOR UPDATE ... SKIP LOCKED`` inside a MATERIALIZED CTE,
so the LIMIT is applied exactly once, and every UPDATE re-checks its whole guard.
Statements that act on a community also require it to be ``active`` inside the
statement, so a fenced tenant is a miss rather than a write-fence error. Fleet-wide
statements (reaper, pruner) also skip, for that batch, any community whose write-fence lock
is not free at once (:func:`fleet_batch`): a lifecycle move queued behind a writer of
community X must never stall the maintenance of every other community (SPEC section 4.6).
"""

from __future__ import annotations

from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.triggers import FENCE_LOCK_NAMESPACE

DELIVERY = WorkflowAgentDelivery._meta.db_table
COMMUNITY = "buzz_delivery_community"

# Columns returned by claims: everything but the (possibly large) JSON snapshots.
SNAPSHOT_FIELDS = ("execution_trace", "trigger_context")
CLAIM_FIELDS = [f for f in WorkflowAgentDelivery._meta.concrete_fields if f.name not in SNAPSHOT_FIELDS]
CLAIM_ATTNAMES = [f.attname for f in CLAIM_FIELDS]
RETURNING_CLAIM_COLUMNS = ", ".join(f"d.{f.column}" for f in CLAIM_FIELDS)

# The database clock of every lease statement: the start of the current statement
# (``statement_timestamp()``, through an inlined SQL function tests can freeze; migration 0006).
DB_NOW = "buzz_delivery_now()"

ACTIVE_COMMUNITY = f"EXISTS (SELECT 1 FROM {COMMUNITY} c WHERE c.id = d.community_id AND c.deletion_state = 'active')"
# Fleet-wide maintenance never waits on a community's write-fence lock: a lifecycle move that
# holds it or waits for it (PostgreSQL queues new shared requests behind a waiting exclusive one)
# would stall the batch, and with it every other community. Two guards, neither of which takes
# a lock per row scanned (the lock table is bounded):
# - FENCE_LOCK_BUSY: the fence-lock keys some session holds or awaits exclusively right now, read
#   from pg_locks once per statement; candidate rows of those communities are left out before
#   the LIMIT, so they never crowd healthy rows out of a batch;
# - FENCE_LOCK_FREE: a try-lock, taken only for the distinct communities of a batch's candidates,
#   closes the race with a move that queued after pg_locks was read. Taken, the lock is held to
#   the end of the statement's transaction, so the write-fence trigger gets it again at once.
FENCE_LOCK_BUSY = f"""(
    SELECT l.objid FROM pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.mode = 'ExclusiveLock'
      AND l.classid = {FENCE_LOCK_NAMESPACE}::oid AND l.objsubid = 2
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
)"""
NOT_FENCE_BUSY = f"hashtext(d.community_id::text)::oid NOT IN {FENCE_LOCK_BUSY}"
FENCE_LOCK_FREE = f"pg_try_advisory_xact_lock_shared({FENCE_LOCK_NAMESPACE}, hashtext(c.community_id::text))"


def fleet_batch(candidates: str) -> str:
    """``candidates`` (a SELECT of ``d.id, d.community_id`` ... ``LIMIT ... FOR UPDATE SKIP
    LOCKED`` that already leaves out :data:`NOT_FENCE_BUSY` communities), narrowed to the rows
    whose community's fence lock this statement could take at once: the CTE ``batch(id)``."""
    return f"""candidates AS MATERIALIZED (
    {candidates}
),
free AS MATERIALIZED (
    SELECT c.community_id FROM (SELECT DISTINCT community_id FROM candidates) AS c WHERE {FENCE_LOCK_FREE}
),
batch AS MATERIALIZED (
    SELECT candidates.id FROM candidates JOIN free USING (community_id)
)"""


LEASE_END = f"LEAST({DB_NOW} + make_interval(secs => %(lease_seconds)s), d.expires_at)"
CURRENT_LEASE = f"""
    d.community_id = %(community_id)s
    AND d.id = %(delivery_id)s
    AND d.target_pubkey = %(target_pubkey)s
    AND d.lease_generation = %(lease_generation)s
    AND d.status = 'claimed'
    AND d.lease_until >= {DB_NOW}
    AND {ACTIVE_COMMUNITY}
"""

# --- producer ---------------------------------------------------------------

LOCK_IDENTITY = "SELECT pg_advisory_xact_lock(%(namespace)s, hashtext(%(key)s))"

TRANSACTION_ISOLATION = "SELECT current_setting('transaction_isolation')"

IDENTITY_EXISTS = f"""
SELECT EXISTS (
    SELECT 1 FROM {DELIVERY}
    WHERE community_id = %(community_id)s AND run_id = %(run_id)s AND step_id = %(step_id)s
)
"""

INSERT_DELIVERIES_SKIP_EXISTING = f"""
WITH created AS (
    INSERT INTO {DELIVERY} AS d (
        id, community_id, workflow_id, run_id, step_id, target_pubkey, definition_event_id,
        message_event_id, cause_kind, cause_event_id, cause_scheduled_for, cause_webhook_invocation_id,
        max_attempts, expires_at, execution_trace, trigger_context
    )
    SELECT v.id, %(community_id)s, v.workflow_id, v.run_id, v.step_id, v.target_pubkey, v.definition_event_id,
           %(message_event_id)s, v.cause_kind, v.cause_event_id, v.cause_scheduled_for, v.cause_webhook_invocation_id,
           %(max_attempts)s, %(expires_at)s, %(execution_trace)s::jsonb, %(trigger_context)s::jsonb
    FROM unnest(
        %(ids)s::uuid[], %(workflow_ids)s::uuid[], %(run_ids)s::uuid[], %(step_ids)s::text[],
        %(target_pubkeys)s::bytea[], %(definition_event_ids)s::bytea[], %(cause_kinds)s::text[],
        %(cause_event_ids)s::bytea[], %(cause_scheduled_fors)s::timestamptz[],
        %(cause_webhook_invocation_ids)s::uuid[]
    ) AS v(
        id, workflow_id, run_id, step_id, target_pubkey, definition_event_id, cause_kind,
        cause_event_id, cause_scheduled_for, cause_webhook_invocation_id
    )
    -- Identity order, not binding order: two producers committing the same identities in
    -- different orders would otherwise deadlock on the unique index.
    ORDER BY v.run_id, v.step_id, v.target_pubkey
    ON CONFLICT ON CONSTRAINT delivery_identity_key DO NOTHING
    RETURNING d.id, d.target_pubkey
)
SELECT created.id,
       pg_notify(%(channel)s, json_build_object(
           'community', %(community_id)s::text,
           'delivery', created.id::text,
           'target', encode(created.target_pubkey, 'hex'))::text)
FROM created
"""

# --- agent ------------------------------------------------------------------


def claim_oldest_pending(*, by_id: bool, by_binding: bool) -> str:
    """Claim up to ``%(limit)s`` of the oldest claimable deliveries of one community and target.

    Claimable: ``pending``, past its retry gate, before its TTL, attempts left, community active.
    The winner: ``claimed``, generation + 1, attempt + 1, lease from the database clock, never
    past ``expires_at``.
    """
    extra = []
    if by_id:
        extra.append("AND d.id = %(delivery_id)s")
    if by_binding:
        extra.append(
            """AND d.workflow_id = %(workflow_id)s AND d.run_id = %(run_id)s AND d.step_id = %(step_id)s
            AND d.definition_event_id = %(definition_event_id)s AND d.message_event_id = %(message_event_id)s
            AND d.cause_kind = %(cause_kind)s
            AND d.cause_event_id IS NOT DISTINCT FROM %(cause_event_id)s::bytea
            AND d.cause_scheduled_for IS NOT DISTINCT FROM %(cause_scheduled_for)s::timestamptz
            AND d.cause_webhook_invocation_id IS NOT DISTINCT FROM %(cause_webhook_invocation_id)s::uuid"""
        )
    return f"""
WITH candidate AS MATERIALIZED (
    SELECT d.id
    FROM {DELIVERY} AS d
    WHERE d.community_id = %(community_id)s
      AND d.target_pubkey = %(target_pubkey)s
      AND d.status = 'pending'
      AND (d.next_attempt_at IS NULL OR d.next_attempt_at <= {DB_NOW})
      AND (d.expires_at IS NULL OR d.expires_at > {DB_NOW})
      AND (d.max_attempts IS NULL OR d.attempt < d.max_attempts)
      {" ".join(extra)}
      AND {ACTIVE_COMMUNITY}
    ORDER BY d.created_at, d.id
    LIMIT %(limit)s
    FOR UPDATE OF d SKIP LOCKED
)
UPDATE {DELIVERY} AS d
SET status = 'claimed',
    lease_generation = d.lease_generation + 1,
    attempt = d.attempt + 1,
    claimed_at = {DB_NOW},
    lease_until = {LEASE_END},
    next_attempt_at = NULL
FROM candidate
WHERE d.id = candidate.id AND d.status = 'pending'
RETURNING {RETURNING_CLAIM_COLUMNS}
"""


RENEW_IF_CURRENT_GENERATION = f"""
UPDATE {DELIVERY} AS d
SET lease_until = {LEASE_END}
WHERE {CURRENT_LEASE}
RETURNING d.lease_until
"""

# What a settle writes; the single and the batch forms differ only in how they find the rows.
_SETTLE = f"""SET status = %(status)s,
    finished_at = {DB_NOW},
    lease_until = NULL,
    claimed_at = NULL,
    failure_code = %(failure_code)s,
    failure_message = %(failure_message)s
"""

FINISH_IF_CURRENT_GENERATION = f"""
UPDATE {DELIVERY} AS d
{_SETTLE}WHERE {CURRENT_LEASE}
RETURNING d.status
"""

# The batch form: one row of (id, generation) per lease, all of one community and target.
FINISH_MANY_IF_CURRENT_GENERATION = f"""
UPDATE {DELIVERY} AS d
{_SETTLE}FROM unnest(%(delivery_ids)s::uuid[], %(lease_generations)s::bigint[]) AS f(id, generation)
WHERE d.community_id = %(community_id)s
  AND d.id = f.id
  AND d.target_pubkey = %(target_pubkey)s
  AND d.lease_generation = f.generation
  AND d.status = 'claimed'
  AND d.lease_until >= {DB_NOW}
  AND {ACTIVE_COMMUNITY}
RETURNING d.id, d.status
"""

# A retry on the last allowed attempt ends ``failed`` / ``attempts_exhausted`` (SPEC section 6).
_EXHAUSTED = "(d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts)"
# base * 2**(attempt - 1), capped. The exponent is clamped before the power is taken: with
# unlimited attempts, 2**1023 and beyond would overflow a double long after the cap applied.
BACKOFF_MAX_EXPONENT = 62
_BACKOFF_SECONDS = (
    f"LEAST(%(backoff_base)s * power(2, LEAST(GREATEST(d.attempt - 1, 0), {BACKOFF_MAX_EXPONENT})), %(backoff_cap)s)"
)
RETRY_IF_CURRENT_GENERATION = f"""
UPDATE {DELIVERY} AS d
SET status = CASE WHEN {_EXHAUSTED} THEN 'failed' ELSE 'pending' END,
    finished_at = CASE WHEN {_EXHAUSTED} THEN {DB_NOW} END,
    failure_code = CASE WHEN {_EXHAUSTED} THEN 'attempts_exhausted' END,
    failure_message = CASE WHEN {_EXHAUSTED} THEN %(failure_message)s END,
    next_attempt_at = CASE WHEN {_EXHAUSTED} THEN NULL ELSE {DB_NOW} + make_interval(secs => {_BACKOFF_SECONDS}) END,
    lease_until = NULL,
    claimed_at = NULL
WHERE {CURRENT_LEASE}
RETURNING d.status
"""

STATUS_AT_GENERATION = f"""
SELECT d.status FROM {DELIVERY} AS d
WHERE d.community_id = %(community_id)s AND d.id = %(delivery_id)s
  AND d.target_pubkey = %(target_pubkey)s AND d.lease_generation = %(lease_generation)s
"""

# --- reaper -----------------------------------------------------------------

# Fleet-wide maintenance judges by ``now()``: it runs in autocommit, where that is the
# statement's start; called inside a caller's transaction, an older ``now()`` only makes it
# do less (a lease that lapsed before the transaction began has surely lapsed), never reap a
# live lease or expire a delivery early.
MAINTENANCE_NOW = "now()"

_PAST_TTL = f"(d.expires_at IS NOT NULL AND d.expires_at <= {MAINTENANCE_NOW})"
_LAPSED_CANDIDATES = f"""SELECT d.id, d.community_id FROM {DELIVERY} AS d
    WHERE d.status = 'claimed' AND d.lease_until < {MAINTENANCE_NOW} AND {ACTIVE_COMMUNITY} AND {NOT_FENCE_BUSY}
    ORDER BY d.lease_until
    LIMIT %(batch_size)s
    FOR UPDATE OF d SKIP LOCKED"""
REAP_LAPSED_LEASES = f"""
WITH {fleet_batch(_LAPSED_CANDIDATES)}
UPDATE {DELIVERY} AS d
SET status = CASE WHEN {_PAST_TTL} THEN 'expired' WHEN {_EXHAUSTED} THEN 'failed' ELSE 'pending' END,
    finished_at = CASE WHEN {_PAST_TTL} OR {_EXHAUSTED} THEN {MAINTENANCE_NOW} END,
    failure_code = CASE WHEN {_PAST_TTL} THEN 'delivery_expired'
                        WHEN {_EXHAUSTED} THEN 'attempts_exhausted' END,
    failure_message = CASE WHEN {_PAST_TTL} THEN 'deadline passed while the lease was lapsed'
                           WHEN {_EXHAUSTED} THEN 'lease lapsed on the last allowed attempt' END,
    lease_generation = d.lease_generation + 1,
    lease_until = NULL,
    claimed_at = NULL
FROM batch
WHERE d.id = batch.id AND d.status = 'claimed' AND d.lease_until < {MAINTENANCE_NOW}
RETURNING d.status
"""

_OVERDUE_CANDIDATES = f"""SELECT d.id, d.community_id FROM {DELIVERY} AS d
    WHERE d.status = 'pending' AND d.expires_at <= {MAINTENANCE_NOW} AND {ACTIVE_COMMUNITY} AND {NOT_FENCE_BUSY}
    ORDER BY d.expires_at
    LIMIT %(batch_size)s
    FOR UPDATE OF d SKIP LOCKED"""
EXPIRE_OVERDUE_PENDING = f"""
WITH {fleet_batch(_OVERDUE_CANDIDATES)}
UPDATE {DELIVERY} AS d
SET status = 'expired',
    finished_at = {MAINTENANCE_NOW},
    failure_code = 'delivery_expired',
    failure_message = 'deadline passed before a claim',
    lease_generation = d.lease_generation + 1,
    next_attempt_at = NULL
FROM batch
WHERE d.id = batch.id AND d.status = 'pending' AND d.expires_at <= {MAINTENANCE_NOW}
RETURNING d.status
"""

COUNT_REAPABLE = f"""
SELECT
    count(*) FILTER (WHERE d.status = 'claimed' AND NOT {_PAST_TTL} AND NOT {_EXHAUSTED}
                     AND c.deletion_state = 'active'),
    count(*) FILTER (WHERE d.status = 'claimed' AND NOT {_PAST_TTL} AND {_EXHAUSTED}
                     AND c.deletion_state = 'active'),
    count(*) FILTER (WHERE (d.status = 'pending' OR {_PAST_TTL}) AND c.deletion_state = 'active'),
    count(*) FILTER (WHERE d.status = 'claimed' AND c.deletion_state <> 'active')
FROM (
    SELECT * FROM {DELIVERY} AS d WHERE d.status = 'claimed' AND d.lease_until < {MAINTENANCE_NOW}
    UNION ALL
    SELECT * FROM {DELIVERY} AS d WHERE d.status = 'pending' AND d.expires_at <= {MAINTENANCE_NOW}
) AS d
JOIN {COMMUNITY} AS c ON c.id = d.community_id
"""

COUNT_FENCED_LAPSED = f"""
SELECT count(*) FROM {DELIVERY} AS d
JOIN {COMMUNITY} AS c ON c.id = d.community_id
WHERE d.status = 'claimed' AND d.lease_until < {MAINTENANCE_NOW} AND c.deletion_state <> 'active'
"""

# Active communities with lapsed leases whose write-fence lock a lifecycle move holds or awaits
# right now: the reap batches skipped them. Reads pg_locks; takes no lock.
COUNT_BUSY_LAPSED = f"""
SELECT count(DISTINCT d.community_id) FROM {DELIVERY} AS d
WHERE d.status = 'claimed' AND d.lease_until < {MAINTENANCE_NOW} AND {ACTIVE_COMMUNITY}
  AND NOT ({NOT_FENCE_BUSY})
"""

# --- operator actions (admin) --------------------------------------------------

REQUEUE_IF_TERMINAL_FAILURE = f"""
UPDATE {DELIVERY} AS d
SET status = 'pending',
    finished_at = NULL,
    failure_code = NULL,
    failure_message = NULL,
    attempt = 0,
    next_attempt_at = NULL,
    expires_at = CASE WHEN d.expires_at <= {DB_NOW} THEN NULL ELSE d.expires_at END,
    lease_generation = d.lease_generation + 1
WHERE d.community_id = %(community_id)s AND d.id = %(delivery_id)s
  AND d.status IN ('failed', 'expired') AND {ACTIVE_COMMUNITY}
RETURNING d.id
"""

FORCE_FAIL_IF_CLAIMED = f"""
UPDATE {DELIVERY} AS d
SET status = 'failed',
    finished_at = {DB_NOW},
    lease_until = NULL,
    claimed_at = NULL,
    failure_code = 'operator_force_failed',
    failure_message = %(failure_message)s,
    lease_generation = d.lease_generation + 1
WHERE d.community_id = %(community_id)s AND d.id = %(delivery_id)s
  AND d.status = 'claimed' AND {ACTIVE_COMMUNITY}
RETURNING d.id
"""
