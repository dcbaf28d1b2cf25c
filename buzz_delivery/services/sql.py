"""Every statement that changes delivery state, named for its guard.

Lease arithmetic uses the database clock only (SPEC section 4), read as
``buzz_delivery_now()`` (:data:`DB_NOW`, migration 0006), which is ``statement_timestamp()``:
the start of the statement, not of the transaction, so a lease call made inside a caller's long
transaction still judges and grants leases by the time it runs (``now()`` would be the
transaction's start). Statements that
pick rows lock them with ``FOR UPDATE ... SKIP LOCKED`` inside a MATERIALIZED CTE,
so the LIMIT is applied exactly once, and every UPDATE re-checks its whole guard (a claim's is
checked in its CTE, on the latest version of each row it locks, which nothing else can then
change before the UPDATE).
Statements that act on a community also require it to be ``active`` inside the
statement, so a fenced tenant is a miss rather than a write-fence error.

Every statement keeps Citus's router form (SPEC section 15; ``tests/test_scale_out_rules.py``
checks it): each UPDATE names ``community_id`` in its own WHERE, so it runs on the one node
that owns the community; no CASE holds a non-immutable call (time comparisons inside one use
:data:`buzz_delivery_when` or a ``%(now)s`` the caller read from the database clock), and time
arithmetic on a column goes through the IMMUTABLE ``buzz_delivery_plus_seconds`` (migration
0007). Fleet-wide maintenance walks communities, one community per statement
(:data:`COMMUNITIES_TO_REAP`).

Every statement that moves a delivery also appends one entry to its ``history`` (issue 17) in
the same SET list, through ``buzz_delivery_history_push`` (migration 0008: append, keep the last
50): ``{"event", "status", "generation", "actor", "at"}`` plus ``renewals`` (the ending lease's
renewal count) or ``attempt`` (a claim's). ``at`` is the database time of the change. A renew
appends nothing: it only counts (``renewals``), so a long lease never floods the history.
"""

from __future__ import annotations

from buzz_delivery.models import DeliveryQueue, DeliveryRecord, SettleTally, WorkflowAgentDelivery, WorkflowRun
from buzz_delivery.triggers import FENCE_LOCK_NAMESPACE

# The delivery table (issue 31, stage 1): every statement that writes or locks a delivery, and
# the plan-cached functions' ``RETURNS SETOF``, name the record; reads name the view of the old
# name (``tests/test_record_writes_rule.py`` refuses a write, a lock or a row type of the view).
RECORD = DeliveryRecord._meta.db_table
# The live state of a pending or claimed delivery (issue 31, stage 2, core migration 0037): one row
# per live delivery, deleted at the terminal; claims, renewals and retries write it alone.
QUEUE = DeliveryQueue._meta.db_table
DELIVERY_VIEW = WorkflowAgentDelivery._meta.db_table
COMMUNITY = "buzz_delivery_community"
WORKFLOW_RUN = WorkflowRun._meta.db_table

# Reader seams (issue 31, stage 1): what the dashboard, /metrics and ``stats`` count, named here
# so that a later stage re-points them at the table that owns the state (stage 2: the live
# queue, stage 3: the outcome) without touching their readers. Since stage 2 the live rows are
# the queue's (every column they read is one of its own); the terminal ones the record's.
LIVE_DELIVERIES = QUEUE  # pending and claimed rows
TERMINAL_DELIVERIES = RECORD  # finished, failed and expired rows
# How many deliveries reached each terminal status when (core migration 0039): one row per settling
# statement, community and status, written by the record's statement trigger. The settle-rate
# readers count its ``n``: no index of the record names the terminal's columns (a HOT terminal).
SETTLE_TALLY = SettleTally._meta.db_table
# Live rows of one status, counted up to %(cap)s.
COUNT_LIVE_BY_STATUS = {
    status: f"SELECT count(*) FROM (SELECT 1 FROM {LIVE_DELIVERIES} WHERE status = '{status}' LIMIT %(cap)s) AS n"
    for status in ("pending", "claimed")
}

# Columns returned by claims: everything but the (possibly large) JSON snapshots and history,
# and the requeue count (read by what needs it, the tasks runner, in its own statement).
SNAPSHOT_FIELDS = ("execution_trace", "trigger_context")
DEFERRED_FIELDS = (*SNAPSHOT_FIELDS, "history", "requeues")
CLAIM_FIELDS = [f for f in WorkflowAgentDelivery._meta.concrete_fields if f.name not in DEFERRED_FIELDS]
CLAIM_ATTNAMES = [f.attname for f in CLAIM_FIELDS]
RETURNING_CLAIM_COLUMNS = ", ".join(f"d.{f.column}" for f in CLAIM_FIELDS)
# The columns a queue row holds the truth of while the delivery is live (the view reads them from
# the queue); every other claimed column is the record's.
LIVE_COLUMNS = (
    "status",
    "lease_generation",
    "lease_until",
    "claimed_at",
    "claimed_by",
    "renewals",
    "attempt",
    "next_attempt_at",
    "expires_at",
    "history",
    "slot_community",
    "slot_target",
    "slot_workflow",
)
# A claim's rows: the claimed queue rows (``q``) joined to their records (``r``) by key, in the
# order of :data:`CLAIM_FIELDS`; and the row type the claim functions return (``RETURNS TABLE``).
CLAIM_SELECT = ", ".join(f"{'q' if f.column in LIVE_COLUMNS else 'r'}.{f.column}" for f in CLAIM_FIELDS)
CLAIMED_LIVE_COLUMNS = ", ".join(f"d.{f.column}" for f in CLAIM_FIELDS if f.column in LIVE_COLUMNS)
_CLAIM_TYPES = {
    "UUIDField": "uuid",
    "ForeignKey": "uuid",
    "BinaryField": "bytea",
    "DateTimeField": "timestamptz",
    "TextField": "text",
    "CharField": "varchar",
    "SmallIntegerField": "smallint",
    "PositiveSmallIntegerField": "smallint",
    "IntegerField": "integer",
    "PositiveIntegerField": "integer",
    "BigIntegerField": "bigint",
}
CLAIM_TABLE = "TABLE(" + ", ".join(f"{f.column} {_CLAIM_TYPES[f.get_internal_type()]}" for f in CLAIM_FIELDS) + ")"

# The database clock of every lease statement: the start of the current statement
# (``statement_timestamp()``, through an inlined SQL function tests can freeze; migration 0006).
DB_NOW = "buzz_delivery_now()"
# Claimed rows whose lease the database clock has passed (not yet reaped), fleet-wide.
# (The queue since stage 2: no index serves the test, the count reads every live row.)
COUNT_LAPSED_LEASES = f"SELECT count(*) FROM {LIVE_DELIVERIES} WHERE status = 'claimed' AND lease_until < {DB_NOW}"


# History fields that hold numbers (counters and generations); every other field but ``at`` is text.
HISTORY_NUMBERS = ("generation", "renewals", "attempt")


def history_object(fields: dict[str, str]) -> str:
    """A JSON object of ``fields`` (name -> SQL expression) built with IMMUTABLE operations only,
    so the expressions may read the row's columns inside a SET list on Citus (SPEC 15):
    ``jsonb_build_object`` is STABLE, and Citus refuses a STABLE function applied to a column in
    an UPDATE ("STABLE functions used in UPDATE queries cannot be called with column
    references"). Text fields go through ``jsonb_object(text[])`` (IMMUTABLE: escapes, and NULL
    becomes JSON null); :data:`HISTORY_NUMBERS` through their text form cast to ``jsonb``
    (``int8out`` and ``jsonb_in`` are IMMUTABLE; they are never NULL); ``at``, a time that never
    reads a column (the database clock or a parameter), through ``jsonb_build_object`` as before,
    so it prints as it always did. The same object as ``jsonb_build_object`` of every field
    (``tests/test_history.py``), at the same cost (measured: 4-5 us a row either way)."""
    parts = []
    if "at" in fields:
        parts.append(f"jsonb_build_object('at', {fields['at']})")
    texts = [f"'{key}', ({value})::text" for key, value in fields.items() if key not in (*HISTORY_NUMBERS, "at")]
    if texts:
        parts.append(f"jsonb_object(ARRAY[{', '.join(texts)}])")
    numbers = [(key, value) for key, value in fields.items() if key in HISTORY_NUMBERS]
    if numbers:
        text = " || ', ".join(f'"{key}": \' || ({value})::text' for key, value in numbers)
        parts.append(f"('{{{text} || '}}')::jsonb")
    return " || ".join(parts)


def history_entry(
    event: str, generation: str, actor: str, *, at: str = DB_NOW, status: str, alias: str = "d", **extra: str
) -> str:
    """The SET assignment that appends one history entry to the ``history`` of the row aliased
    ``alias``; every argument is an SQL expression over the row's old values and the statement's
    parameters (``at`` never over a column). Shared by the workflow steps and agent runs (their
    own ``history`` columns). Built by :func:`history_object`: IMMUTABLE over the columns."""
    fields = {"event": event, "status": status, "generation": generation, "actor": actor, "at": at, **extra}
    return f"history = buzz_delivery_history_push({alias}.history, {history_object(fields)})"


ACTIVE_COMMUNITY = f"EXISTS (SELECT 1 FROM {COMMUNITY} c WHERE c.id = d.community_id AND c.deletion_state = 'active')"
# The same test where the statement names its community (``d.community_id = %(community_id)s``):
# not correlated, so PostgreSQL reads the community row once a statement (an InitPlan) instead of
# once a row (a renewal or settle of 1,000 leases probed that one row, which every backend of
# every worker reads, 1,000 times; core 0041; the peers drains measured no difference, issue 31).
ACTIVE_THIS_COMMUNITY = (
    f"EXISTS (SELECT 1 FROM {COMMUNITY} c WHERE c.id = %(community_id)s AND c.deletion_state = 'active')"
)
LEASE_END = f"LEAST({DB_NOW} + make_interval(secs => %(lease_seconds)s), d.expires_at)"
CURRENT_LEASE = f"""
    d.community_id = %(community_id)s
    AND d.id = %(delivery_id)s
    AND d.target_pubkey = %(target_pubkey)s
    AND d.lease_generation = %(lease_generation)s
    AND d.status = 'claimed'
    AND d.lease_until >= {DB_NOW}
    AND {ACTIVE_THIS_COMMUNITY}
"""

# The database clock read on its own (a terminal move made of two statements reads it first and
# passes it as ``%(now)s``).
READ_DB_NOW = f"SELECT {DB_NOW}"

# Maintenance tries a community's write fence before a batch and skips the community when a
# lifecycle move holds it (never waits): the shared fence lock if it is free at once, else the
# community row, which a move always holds while it runs (migration 0020). A session that merely
# took the advisory lock no longer makes the walk skip that community (issue 27).
TRY_WRITE_FENCE = f"""
SELECT CASE WHEN pg_try_advisory_xact_lock_shared({FENCE_LOCK_NAMESPACE}, hashtext(%(community_id)s::text)) THEN true
            ELSE EXISTS (SELECT 1 FROM {COMMUNITY} AS c WHERE c.id = %(community_id)s FOR SHARE SKIP LOCKED) END
"""

# --- producer ---------------------------------------------------------------

LOCK_IDENTITY = "SELECT pg_advisory_xact_lock(%(namespace)s, hashtext(%(key)s))"

TRANSACTION_ISOLATION = "SELECT current_setting('transaction_isolation')"

# The record holds every delivery's identity (the queue only the live ones): read it there.
IDENTITY_EXISTS = f"""
SELECT EXISTS (
    SELECT 1 FROM {RECORD}
    WHERE community_id = %(community_id)s AND run_id = %(run_id)s AND step_id = %(step_id)s
)
"""

# The tail of the delivery inserts: each created row's id and its wake hint (sent at commit).
_NOTIFY_CREATED = """SELECT created.id,
       pg_notify(%(channel)s, json_build_object(
           'community', %(community_id)s::text,
           'delivery', created.id::text,
           'target', encode(created.target_pubkey, 'hex'))::text)
FROM created
"""

INSERT_DELIVERIES_SKIP_EXISTING = f"""
WITH created AS (
    INSERT INTO {RECORD} AS d (
        id, community_id, workflow_id, run_id, step_id, target_pubkey, definition_event_id,
        message_event_id, cause_kind, cause_event_id, cause_scheduled_for, cause_webhook_invocation_id,
        max_attempts, expires_at, execution_trace, trigger_context, next_attempt_at, priority
    )
    SELECT v.id, %(community_id)s, v.workflow_id, v.run_id, v.step_id, v.target_pubkey, v.definition_event_id,
           %(message_event_id)s, v.cause_kind, v.cause_event_id, v.cause_scheduled_for, v.cause_webhook_invocation_id,
           %(max_attempts)s, %(expires_at)s, %(execution_trace)s::jsonb, %(trigger_context)s::jsonb,
           %(not_before)s::timestamptz, %(priority)s::smallint
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
{_NOTIFY_CREATED}"""

# The second statement of every commit (issue 31, stage 2): the queue rows of the records the
# first one created (its RETURNING ids, ``%(created_ids)s``), in the same transaction, copied from
# them (status pending, their generation, attempt, retry gate, TTL, history and singleton key). On
# Citus a statement that writes two tables is not plannable ("could not create distributed plan"),
# so the commit is two statements, each naming its community: this one an INSERT ... SELECT
# between colocated tables, pushed down to the community's node. ``ON CONFLICT DO NOTHING`` is
# the singleton key's arbiter (the queue's unique ``(community_id, target_pubkey, singleton_key)``,
# services/singleton.py): a row it skips is not returned, and the caller deletes that record
# again. A commit without a key has no other conflict to meet (the ids are new).
INSERT_QUEUE_ROWS_OF_CREATED = f"""
INSERT INTO {QUEUE} AS q (
    id, community_id, target_pubkey, workflow_id, priority, created_at, max_attempts, status,
    lease_generation, attempt, next_attempt_at, expires_at, history, singleton_key
)
SELECT r.id, r.community_id, r.target_pubkey, r.workflow_id, r.priority, r.created_at, r.max_attempts, 'pending',
       r.lease_generation, r.attempt, r.next_attempt_at, r.expires_at, r.history, r.singleton_key
FROM {RECORD} AS r
WHERE r.community_id = %(community_id)s AND r.id = ANY (%(created_ids)s::uuid[])
ORDER BY r.target_pubkey, r.id
ON CONFLICT DO NOTHING
RETURNING q.id
"""

# The identity locks of many (run, step) of one community in one statement, keys taken in the
# order given (the caller sorts them: two batches never take two keys in opposite orders), and
# the transaction's isolation level (the caller refuses any but READ COMMITTED).
LOCK_IDENTITIES = """
SELECT count(pg_advisory_xact_lock(%(namespace)s, hashtext(k.key))), current_setting('transaction_isolation')
FROM unnest(%(keys)s::text[]) AS k(key)
"""

# INSERT_DELIVERIES_SKIP_EXISTING for the deliveries of many messages of one community (a batch
# of send_message steps): each row its own message event, trigger context and priority.
INSERT_DELIVERIES_MANY_SKIP_EXISTING = f"""
WITH created AS (
    INSERT INTO {RECORD} AS d (
        id, community_id, workflow_id, run_id, step_id, target_pubkey, definition_event_id,
        message_event_id, cause_kind, cause_event_id, cause_scheduled_for, cause_webhook_invocation_id,
        max_attempts, expires_at, execution_trace, trigger_context, next_attempt_at, priority
    )
    SELECT v.id, %(community_id)s, v.workflow_id, v.run_id, v.step_id, v.target_pubkey, v.definition_event_id,
           v.message_event_id, v.cause_kind, v.cause_event_id, v.cause_scheduled_for,
           v.cause_webhook_invocation_id, %(max_attempts)s, NULL, NULL, v.trigger_context, NULL, v.priority
    FROM unnest(
        %(ids)s::uuid[], %(workflow_ids)s::uuid[], %(run_ids)s::uuid[], %(step_ids)s::text[],
        %(target_pubkeys)s::bytea[], %(definition_event_ids)s::bytea[], %(message_event_ids)s::bytea[],
        %(cause_kinds)s::text[], %(cause_event_ids)s::bytea[], %(cause_scheduled_fors)s::timestamptz[],
        %(cause_webhook_invocation_ids)s::uuid[], %(trigger_contexts)s::jsonb[], %(priorities)s::smallint[]
    ) AS v(
        id, workflow_id, run_id, step_id, target_pubkey, definition_event_id, message_event_id, cause_kind,
        cause_event_id, cause_scheduled_for, cause_webhook_invocation_id, trigger_context, priority
    )
    ORDER BY v.run_id, v.step_id, v.target_pubkey
    ON CONFLICT ON CONSTRAINT delivery_identity_key DO NOTHING
    RETURNING d.id, d.target_pubkey
)
{_NOTIFY_CREATED}"""

# --- agent ------------------------------------------------------------------


_CLAIM_ENTRY = history_entry(
    "'claim'", "d.lease_generation + 1", "%(holder)s::text", status="'claimed'", attempt="d.attempt + 1"
)


# The batch claim's UPDATE joins the candidates it locked both as rows and as an array of their
# ids, so the planner probes the primary key from whichever side it estimates smaller: the CTE
# (what it expects pending: next to nothing with a fleet of small communities' statistics) or
# the array (10 to the planner, whatever its length). Either alone lost somewhere: ``id = ANY``
# of the array to another index's community prefix when a community looked small (every row of
# it read on every claim), the join with the CTE alone to a hash join over a scan of the table
# when a large backlog had been analysed (a generic LIMIT is a tenth of what it expects).
CLAIM_FROM = "FROM candidate, unnest(ARRAY(SELECT candidate.id FROM candidate)) AS listed(id)"


def claimed_rows(by_id: bool) -> str:
    """How the claim's UPDATE reaches the candidates it locked (see :data:`CLAIM_FROM`); the
    hinted claim names its row, the primary key's equality (test_claim_plan_stale_stats)."""
    if by_id:
        return "d.id = %(delivery_id)s AND d.id IN (SELECT candidate.id FROM candidate)"
    return "d.id = candidate.id AND d.id = listed.id"


def claim_oldest_pending(*, by_id: bool, by_binding: bool) -> str:
    """Claim up to ``%(limit)s`` of the claimable deliveries of one community and target, higher
    ``priority`` first, oldest first within it (the order of the queue's poll index).

    Claimable: ``pending``, past its retry gate, before its TTL, attempts left, community active.
    The winner: ``claimed``, generation + 1, attempt + 1, lease from the database clock, never
    past ``expires_at``.

    Issue 31, stage 2: the claim updates the queue row only, a HOT update (no index of the queue
    names a column it changes: the slots and the singleton key of a pending row are NULL already,
    and setting NULL to NULL is no change); the claimed rows are then joined to their records by
    key for the columns the claim returns (:data:`CLAIM_FIELDS`, live ones from the queue).
    """
    extra = []
    if by_id:
        extra.append("AND d.id = %(delivery_id)s")
    if by_binding:
        extra.append(
            f"""AND d.workflow_id = %(workflow_id)s
      AND EXISTS (
            SELECT 1 FROM {RECORD} AS b
            WHERE b.community_id = %(community_id)s AND b.id = d.id
            AND b.run_id = %(run_id)s AND b.step_id = %(step_id)s
            AND b.definition_event_id = %(definition_event_id)s AND b.message_event_id = %(message_event_id)s
            AND b.cause_kind = %(cause_kind)s
            AND b.cause_event_id IS NOT DISTINCT FROM %(cause_event_id)s::bytea
            AND b.cause_scheduled_for IS NOT DISTINCT FROM %(cause_scheduled_for)s::timestamptz
            AND b.cause_webhook_invocation_id IS NOT DISTINCT FROM %(cause_webhook_invocation_id)s::uuid)"""
        )
    joined = "" if by_id else f"{CLAIM_FROM}\n"
    return f"""
WITH claimed AS (
WITH candidate AS MATERIALIZED (
    SELECT d.id
    FROM {QUEUE} AS d
    WHERE d.community_id = %(community_id)s
      AND d.target_pubkey = %(target_pubkey)s
      AND d.status = 'pending'
      AND (d.next_attempt_at IS NULL OR d.next_attempt_at <= {DB_NOW})
      AND (d.expires_at IS NULL OR d.expires_at > {DB_NOW})
      AND (d.max_attempts IS NULL OR d.attempt < d.max_attempts)
      {" ".join(extra)}
      AND {ACTIVE_THIS_COMMUNITY}
    ORDER BY d.priority DESC, d.created_at, d.id
    LIMIT %(limit)s
    FOR UPDATE OF d SKIP LOCKED
)
UPDATE {QUEUE} AS d
SET status = 'claimed',
    lease_generation = d.lease_generation + 1,
    attempt = d.attempt + 1,
    claimed_at = {DB_NOW},
    lease_until = {LEASE_END},
    next_attempt_at = NULL,
    claimed_by = %(holder)s,
    renewals = 0,
    slot_community = NULL,
    slot_target = NULL,
    slot_workflow = NULL,
    singleton_key = NULL,
    {_CLAIM_ENTRY}
{joined}-- Through the primary key only: no status test here (the CTE locked each candidate FOR UPDATE
-- after re-checking its latest version, so nothing else changed it since), or with stale
-- statistics the pending-only indexes win and every pending row is read (test_claim_plan_stale_stats).
WHERE d.community_id = %(community_id)s AND {claimed_rows(by_id)}
RETURNING {CLAIMED_LIVE_COLUMNS}, d.id
)
SELECT {CLAIM_SELECT}
FROM claimed AS q
JOIN {RECORD} AS r ON r.community_id = %(community_id)s AND r.id = q.id
"""


# The JSON snapshots of claimed deliveries of one community (``load_snapshots``: an async
# handler's claims), %(ids)s a ``uuid[]`` literal of their ids: one text parameter, not one
# bound (and dumped) per id, nor the ORM's query built per claim batch (issue 31).
SNAPSHOTS = f"""
SELECT d.id, {", ".join(f"d.{name}" for name in SNAPSHOT_FIELDS)} FROM {DELIVERY_VIEW} AS d
WHERE d.community_id = %(community_id)s AND d.id = ANY(%(ids)s::uuid[])
"""

RENEW_IF_CURRENT_GENERATION = f"""
UPDATE {QUEUE} AS d
SET lease_until = {LEASE_END},
    renewals = d.renewals + 1
WHERE {CURRENT_LEASE}
RETURNING d.lease_until
"""

# The batch statements' status fence (settles and renewals), the same test as
# ``d.status = 'claimed'`` (equality under "C" is byte equality, as under the database's
# deterministic default collation) in a form the planner cannot match to
# delivery_claimed_lease_idx's predicate. A generic plan (the plan-cached functions,
# services/cached.py; the renewal once psycopg has prepared it) must not read the batch through
# that index: it holds every row claimed in the community (a fleet claiming ahead: thousands),
# and its estimate is whatever an ANALYZE saw claimed at that moment (claimed rows are
# transient), often next to none, so the planner preferred it and read them all to settle 50
# (bench/results/worker-k4.md). Hidden from it, the batch is reached by its keys: a probe of the
# primary key (id, community) per row.
CLAIMED_BY_KEY = "d.status = 'claimed' COLLATE \"C\""

# The batch form (a holder's renewal round): one row of (id, generation, target) per lease, all
# of one community, each row fenced as RENEW_IF_CURRENT_GENERATION fences its one; a lease whose
# row is not returned is lost.
RENEW_MANY_IF_CURRENT_GENERATION = f"""
UPDATE {QUEUE} AS d
SET lease_until = {LEASE_END},
    renewals = d.renewals + 1
FROM unnest(%(delivery_ids)s::uuid[], %(lease_generations)s::bigint[], %(target_pubkeys)s::bytea[])
    AS r(id, generation, target)
WHERE d.community_id = %(community_id)s
  AND d.id = r.id
  AND d.target_pubkey = r.target
  AND d.lease_generation = r.generation
  AND {CLAIMED_BY_KEY}
  AND d.lease_until >= {DB_NOW}
  AND {ACTIVE_THIS_COMMUNITY}
RETURNING d.id, d.lease_until
"""

_SETTLE_ENTRY = history_entry(
    "'settle'", "d.lease_generation", "d.claimed_by", status="%(status)s::varchar", renewals="d.renewals"
)

# Issue 31, stage 2: a terminal deletes the queue row (fenced as the lease statements fence it)
# and writes the record from what the row held, in one statement (on Citus: inside a delegated
# function, one task). ``gone``: the deleted rows, aliased ``d`` in the record's UPDATE, so the
# history entries read the lease's columns as they did when the record was the row.
_GONE = "d.id, d.lease_generation, d.attempt, d.max_attempts, d.claimed_by, d.renewals, d.history"
# What every terminal writes on the record from the queue row (``d``): the lease's last state,
# no live lease, slot or retry gate left.
_FROM_QUEUE = """lease_generation = d.lease_generation,
    attempt = d.attempt,
    claimed_by = d.claimed_by,
    renewals = d.renewals,
    lease_until = NULL,
    claimed_at = NULL,
    next_attempt_at = NULL,
    slot_community = NULL,
    slot_target = NULL,
    slot_workflow = NULL,
"""
# The record's UPDATE of a terminal: its rows are the ``gone`` queue rows, by key.
_RECORD_OF_GONE = """FROM gone AS d
WHERE r.community_id = %(community_id)s AND r.id = d.id"""

# What a settle writes; the single and the batch forms differ only in how they find the rows.
_SETTLE = f"""SET status = %(status)s,
    finished_at = {DB_NOW},
    failure_code = %(failure_code)s,
    failure_message = %(failure_message)s,
    {_FROM_QUEUE}    {_SETTLE_ENTRY}
"""

FINISH_IF_CURRENT_GENERATION = f"""
WITH gone AS (
    DELETE FROM {QUEUE} AS d
    WHERE {CURRENT_LEASE}
    RETURNING {_GONE}
)
UPDATE {RECORD} AS r
{_SETTLE}{_RECORD_OF_GONE}
RETURNING r.status
"""


# The batch form: one row of (id, generation, target) per lease, all of one community (the
# targets may differ: a worker serving many targets settles them in one statement).
FINISH_MANY_IF_CURRENT_GENERATION = f"""
WITH gone AS (
    DELETE FROM {QUEUE} AS d
    USING unnest(%(delivery_ids)s::uuid[], %(lease_generations)s::bigint[], %(target_pubkeys)s::bytea[])
        AS f(id, generation, target)
    WHERE d.community_id = %(community_id)s
      AND d.id = f.id
      AND d.target_pubkey = f.target
      AND d.lease_generation = f.generation
      AND {CLAIMED_BY_KEY}
      AND d.lease_until >= {DB_NOW}
      AND {ACTIVE_THIS_COMMUNITY}
    RETURNING {_GONE}
)
UPDATE {RECORD} AS r
{_SETTLE}{_RECORD_OF_GONE}
RETURNING r.id, r.status
"""

# Before a batch settles anything: the rows of its deliveries' runs, locked in run id order (a
# PL/pgSQL line, the prelude of the plan-cached batch settle, services/cached.py). A settle of a
# delivery may take a lock per run in the same transaction (the workflow engine counts the
# delivery in its waiting step under the run's lock, in the order the UPDATE meets the rows, which
# is its plan's); two batches that hold deliveries of the same runs (two workers, one per target)
# would otherwise take those locks in different orders and deadlock, each deadlock a second of
# both workers' time (``deadlock_timeout``) and a retried batch. Taken this way, the second batch
# waits at its first run in common, holding none of the first's. A row lock of the community's
# (SPEC 15), not an advisory one. A batch whose deliveries are all of one run takes no such lock:
# it can hold at most that run's lock, so it cannot close a cycle, and the inbox's worker settling
# one producer's backlog from K processes is not serialized on that run's row.
LOCK_RUNS_OF_DELIVERIES = f"""PERFORM 1 FROM {WORKFLOW_RUN} AS r
    WHERE r.community_id = p_community_id
      AND r.id IN (SELECT x.run_id FROM {RECORD} AS x
                   WHERE x.community_id = p_community_id AND x.id = ANY (p_delivery_ids))
    ORDER BY r.id
    FOR NO KEY UPDATE OF r;"""
LOCK_RUNS_OF_DELIVERIES_IN_FUNCTION = f"""    IF (SELECT count(DISTINCT x.run_id) FROM {RECORD} AS x
        WHERE x.community_id = p_community_id AND x.id = ANY (p_delivery_ids)) > 1 THEN
    {LOCK_RUNS_OF_DELIVERIES}
    END IF;
"""

# A retry on the last allowed attempt ends ``failed`` / ``attempts_exhausted`` (SPEC section 6).
_EXHAUSTED = "(d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts)"
# base * 2**(attempt - 1), capped. The exponent is clamped before the power is taken: with
# unlimited attempts, 2**1023 and beyond would overflow a double long after the cap applied.
BACKOFF_MAX_EXPONENT = 62
_BACKOFF_SECONDS = (
    f"LEAST(%(backoff_base)s * power(2, LEAST(GREATEST(d.attempt - 1, 0), {BACKOFF_MAX_EXPONENT})), %(backoff_cap)s)"
)
# Equal jitter (a factor in [0.5, 1] drawn by the caller, buzz_delivery.backoff) and the
# failure's Retry-After (0 when none): the next attempt is not before the larger.
_RETRY_DELAY = f"GREATEST({_BACKOFF_SECONDS} * %(jitter)s, %(retry_after)s)"
_RETRY_ENTRY = history_entry("'retry'", "d.lease_generation", "d.claimed_by", status="'pending'", renewals="d.renewals")
_EXHAUSTED_ENTRY = history_entry(
    "'retry'", "d.lease_generation", "d.claimed_by", status="'failed'", renewals="d.renewals"
)
# Back to pending: the queue row only (HOT: the slots it clears are not NULL only under limits).
# On the last allowed attempt: a terminal (the queue row deleted, the record failed). The two
# CTEs' fences exclude each other (the attempt is the claim's), so one of them takes the row.
RETRY_IF_CURRENT_GENERATION = f"""
WITH back AS (
    UPDATE {QUEUE} AS d
    SET status = 'pending',
        next_attempt_at = buzz_delivery_plus_seconds({DB_NOW}, {_RETRY_DELAY}),
        lease_until = NULL,
        claimed_at = NULL,
        slot_community = NULL,
        slot_target = NULL,
        slot_workflow = NULL,
        {_RETRY_ENTRY}
    WHERE {CURRENT_LEASE} AND NOT {_EXHAUSTED}
    RETURNING d.status
),
gone AS (
    DELETE FROM {QUEUE} AS d
    WHERE {CURRENT_LEASE} AND {_EXHAUSTED}
    RETURNING {_GONE}
),
failed AS (
    UPDATE {RECORD} AS r
    SET status = 'failed',
        finished_at = {DB_NOW},
        failure_code = 'attempts_exhausted',
        failure_message = %(failure_message)s,
        {_FROM_QUEUE}        {_EXHAUSTED_ENTRY}
    {_RECORD_OF_GONE}
    RETURNING r.status
)
SELECT back.status FROM back
UNION ALL
SELECT failed.status FROM failed
"""

# The mixed batch form (a remote worker's flush, issue 29): one row of (id, generation, target,
# outcome, failure_code, failure_message, jitter, retry_after) per lease, all of one community,
# each row fenced by its own lease as CURRENT_LEASE fences its one, and each written exactly as
# its single twin writes it: a ``finished``/``failed`` row as FINISH_IF_CURRENT_GENERATION, a
# ``retry`` row as RETRY_IF_CURRENT_GENERATION (its own jitter and Retry-After, 0 when none; the
# last allowed attempt ends failed/attempts_exhausted). The caller checked every combination (no
# failure_code with a retry...). The CASEs read columns and parameters only; the clock goes
# through buzz_delivery_when (SPEC 15). A settled row's next_attempt_at is NULL as FINISH leaves
# it: every claim clears it, so a row held under a current lease has none to keep.
_S_RETRY = "s.outcome = 'retry'"
_S_RETRY_DELAY = f"GREATEST({_BACKOFF_SECONDS} * s.jitter, s.retry_after)"
_SETTLES = """unnest(
        %(delivery_ids)s::uuid[], %(lease_generations)s::bigint[], %(target_pubkeys)s::bytea[],
        %(outcomes)s::varchar[], %(failure_codes)s::varchar[], %(failure_messages)s::text[],
        %(jitters)s::float8[], %(retry_afters)s::float8[]
    ) AS s(id, generation, target, outcome, failure_code, failure_message, jitter, retry_after)"""
_SETTLE_FENCE = f"""d.community_id = %(community_id)s
      AND d.id = s.id
      AND d.target_pubkey = s.target
      AND d.lease_generation = s.generation
      AND {CLAIMED_BY_KEY}
      AND d.lease_until >= {DB_NOW}
      AND {ACTIVE_THIS_COMMUNITY}"""
# In the record's UPDATE, ``d`` is a deleted queue row with its settle's outcome and texts.
_G_RETRY = "d.outcome = 'retry'"
_G_STATUS = f"CASE WHEN {_G_RETRY} THEN 'failed' ELSE d.outcome END"
_SETTLE_MANY_ENTRY = history_entry(
    f"CASE WHEN {_G_RETRY} THEN 'retry' ELSE 'settle' END",
    "d.lease_generation",
    "d.claimed_by",
    status=_G_STATUS,
    renewals="d.renewals",
)
SETTLE_MANY_IF_CURRENT_GENERATION = f"""
WITH back AS (
    UPDATE {QUEUE} AS d
    SET status = 'pending',
        next_attempt_at = buzz_delivery_plus_seconds({DB_NOW}, {_S_RETRY_DELAY}),
        lease_until = NULL,
        claimed_at = NULL,
        slot_community = NULL,
        slot_target = NULL,
        slot_workflow = NULL,
        {_RETRY_ENTRY}
    FROM {_SETTLES}
    WHERE {_SETTLE_FENCE}
      AND {_S_RETRY} AND NOT {_EXHAUSTED}
    RETURNING d.id, d.status
),
gone AS (
    DELETE FROM {QUEUE} AS d
    USING {_SETTLES}
    WHERE {_SETTLE_FENCE}
      AND NOT ({_S_RETRY} AND NOT {_EXHAUSTED})
    RETURNING {_GONE}, s.outcome, s.failure_code, s.failure_message
),
done AS (
    UPDATE {RECORD} AS r
    SET status = {_G_STATUS},
        finished_at = {DB_NOW},
        failure_code = CASE WHEN {_G_RETRY} THEN 'attempts_exhausted' ELSE d.failure_code END,
        failure_message = d.failure_message,
        {_FROM_QUEUE}        {_SETTLE_MANY_ENTRY}
    {_RECORD_OF_GONE}
    RETURNING r.id, r.status
)
SELECT back.id, back.status FROM back
UNION ALL
SELECT done.id, done.status FROM done
"""

STATUS_AT_GENERATION = f"""
SELECT d.status FROM {DELIVERY_VIEW} AS d
WHERE d.community_id = %(community_id)s AND d.id = %(delivery_id)s
  AND d.target_pubkey = %(target_pubkey)s AND d.lease_generation = %(lease_generation)s
"""

# --- reaper -----------------------------------------------------------------

# Fleet-wide maintenance judges by ``now()``: it runs each batch in its own transaction and
# reads ``now()`` (the transaction's start) once, passing it as ``%(now)s`` to the batch's
# statement; an older time only makes it do less (a lease that lapsed before the transaction
# began has surely lapsed), never reap a live lease or expire a delivery early.
MAINTENANCE_NOW = "now()"

_LAPSED = "d.status = 'claimed' AND d.lease_until < %(now)s"
_OVERDUE = "d.status = 'pending' AND d.expires_at <= %(now)s"
_PAST_TTL = "(d.expires_at IS NOT NULL AND d.expires_at <= %(now)s)"


# A terminal move (stage 2) is two statements in one transaction, each routed by its community
# (a two-table data-modifying statement is not plannable on Citus): the fenced DELETE of the
# queue rows RETURNING :func:`ended_columns` (the terminal status, failure and generation, and the
# queue row's attempt, holder, renewals and history), then one of the ``END_*`` statements
# (:func:`end_on_record`), which writes them on the records with the move's history entry and the
# finish time ``%(now)s`` (services/ending.py). The entry is built there, not in the RETURNING
# list: Citus allows only IMMUTABLE functions in a RETURNING list.
def ended_columns(status: str, code: str, message: str, generation: str) -> str:
    """The RETURNING list of a terminal DELETE of queue rows aliased ``d``, in the order the
    ``END_*`` statements take them; every expression IMMUTABLE (Citus)."""
    return (
        f"d.id, ({status})::text, ({code})::text, ({message})::text, ({generation})::bigint, "
        "d.attempt, d.claimed_by, d.renewals, d.history::text"
    )


def end_on_record(history: str | None) -> str:
    """The record's side of a terminal move: each record still ``pending`` (the record of a live
    delivery) takes the state its queue row ended with (``u``), finished at ``%(now)s``, its live
    columns cleared, and ``history`` (a :func:`history_entry` over ``u``; None: the queue row's
    history as it was). Its AFTER UPDATE OF status triggers (workflow fan-in, agents delivery-lost)
    fire here."""
    return f"""
UPDATE {RECORD} AS r
SET status = u.status,
    finished_at = %(now)s::timestamptz,
    failure_code = u.failure_code,
    failure_message = u.failure_message,
    lease_generation = u.lease_generation,
    attempt = u.attempt,
    claimed_by = u.claimed_by,
    renewals = u.renewals,
    {history or "history = u.history"},
    lease_until = NULL,
    claimed_at = NULL,
    next_attempt_at = NULL,
    slot_community = NULL,
    slot_target = NULL,
    slot_workflow = NULL
FROM unnest(%(ids)s::uuid[], %(statuses)s::text[], %(failure_codes)s::text[], %(failure_messages)s::text[],
            %(lease_generations)s::bigint[], %(attempts)s::integer[], %(holders)s::text[], %(renewals)s::integer[],
            %(histories)s::text[]::jsonb[])
    AS u(id, status, failure_code, failure_message, lease_generation, attempt, claimed_by, renewals, history)
WHERE r.community_id = %(community_id)s AND r.id = u.id AND r.status = 'pending'
RETURNING r.id, r.status
"""


_AT_NOW = "%(now)s::timestamptz"
END_REAPED = end_on_record(
    history_entry(
        "'reap'", "u.lease_generation", "'reaper'", at=_AT_NOW, status="u.status", alias="u", renewals="u.renewals"
    )
)
END_EXPIRED = end_on_record(
    history_entry("'expire'", "u.lease_generation", "'reaper'", at=_AT_NOW, status="u.status", alias="u")
)
END_FORCE_FAILED = end_on_record(
    history_entry(
        "'force_fail'",
        "u.lease_generation",
        "%(actor)s::text",
        at=_AT_NOW,
        status="u.status",
        alias="u",
        renewals="u.renewals",
    )
)
# A cancelled run's pending deliveries: no history entry (as before the queue).
END_RUN_EXPIRED = end_on_record(None)

# The walk: active communities that have lapsed leases or overdue pending deliveries, in id
# order after ``%(after)s``, a page at a time. On the queue no index names ``lease_until`` (so a
# claim is a HOT update): the lapsed test walks the community's live rows (the poll index leads
# with community_id); the overdue one probes the pending expiry index. On Citus a pushed-down
# join of colocated tables.
COMMUNITIES_TO_REAP = f"""
SELECT c.id FROM {COMMUNITY} AS c
WHERE c.deletion_state = 'active' AND c.id > %(after)s
  AND (EXISTS (SELECT 1 FROM {QUEUE} AS d WHERE d.community_id = c.id AND {_LAPSED})
       OR EXISTS (SELECT 1 FROM {QUEUE} AS d WHERE d.community_id = c.id AND d.expires_at IS NOT NULL
                  AND {_OVERDUE}))
ORDER BY c.id
LIMIT %(page)s
"""

# One community's batch; its write-fence trigger takes the community's fence lock, which the
# caller bounds with a lock timeout so a lifecycle move of this community never stalls the walk.
# A lapsed lease with attempts and time left goes back to pending (the queue row only, slots
# cleared); one past its deadline or on its last allowed attempt ends: its queue row is deleted
# and returned (ended_columns) for END_REAPED. One statement on the queue (its two data-modifying
# CTEs touch disjoint rows of the locked batch); rows ``('pending', NULL...)`` for the moved ones.
_REAP_TERMINAL = f"({_PAST_TTL} OR {_EXHAUSTED})"
_REAP_ENTRY = history_entry(
    "'reap'",
    "d.lease_generation + 1",
    "'reaper'",
    at="%(now)s::timestamptz",
    status=f"CASE WHEN {_PAST_TTL} THEN 'expired' WHEN {_EXHAUSTED} THEN 'failed' ELSE 'pending' END",
    renewals="d.renewals",
)
REAP_LAPSED_LEASES = f"""
WITH batch AS MATERIALIZED (
    SELECT d.id FROM {QUEUE} AS d
    WHERE d.community_id = %(community_id)s AND {_LAPSED} AND {ACTIVE_COMMUNITY}
    ORDER BY d.lease_until
    LIMIT %(batch_size)s
    FOR UPDATE OF d SKIP LOCKED
), moved AS (
    UPDATE {QUEUE} AS d
    SET status = 'pending',
        lease_generation = d.lease_generation + 1,
        lease_until = NULL,
        claimed_at = NULL,
        slot_community = NULL,
        slot_target = NULL,
        slot_workflow = NULL,
        {_REAP_ENTRY}
    FROM batch
    WHERE d.community_id = %(community_id)s AND d.id = batch.id AND {_LAPSED} AND NOT {_REAP_TERMINAL}
    RETURNING d.id
), ended AS (
    DELETE FROM {QUEUE} AS d
    USING batch
    WHERE d.community_id = %(community_id)s AND d.id = batch.id AND {_LAPSED} AND {_REAP_TERMINAL}
    RETURNING {
    ended_columns(
        f"CASE WHEN {_PAST_TTL} THEN 'expired' ELSE 'failed' END",
        f"CASE WHEN {_PAST_TTL} THEN 'delivery_expired' ELSE 'attempts_exhausted' END",
        f"CASE WHEN {_PAST_TTL} THEN 'deadline passed while the lease was lapsed' "
        "ELSE 'lease lapsed on the last allowed attempt' END",
        "d.lease_generation + 1",
    )
}
)
SELECT moved.id, 'pending', NULL::text, NULL::text, NULL::bigint, NULL::integer, NULL::text, NULL::integer, NULL::text
FROM moved
UNION ALL
SELECT * FROM ended
"""

EXPIRE_OVERDUE_PENDING = f"""
WITH batch AS MATERIALIZED (
    SELECT d.id FROM {QUEUE} AS d
    WHERE d.community_id = %(community_id)s AND d.expires_at IS NOT NULL AND {_OVERDUE} AND {ACTIVE_COMMUNITY}
    ORDER BY d.expires_at
    LIMIT %(batch_size)s
    FOR UPDATE OF d SKIP LOCKED
)
DELETE FROM {QUEUE} AS d
USING batch
WHERE d.community_id = %(community_id)s AND d.id = batch.id AND {_OVERDUE}
RETURNING {
    ended_columns("'expired'", "'delivery_expired'", "'deadline passed before a claim'", "d.lease_generation + 1")
}
"""

_PAST_TTL_NOW = f"(d.expires_at IS NOT NULL AND d.expires_at <= {MAINTENANCE_NOW})"
COUNT_REAPABLE = f"""
SELECT
    count(*) FILTER (WHERE d.status = 'claimed' AND NOT {_PAST_TTL_NOW} AND NOT {_EXHAUSTED}
                     AND c.deletion_state = 'active'),
    count(*) FILTER (WHERE d.status = 'claimed' AND NOT {_PAST_TTL_NOW} AND {_EXHAUSTED}
                     AND c.deletion_state = 'active'),
    count(*) FILTER (WHERE (d.status = 'pending' OR {_PAST_TTL_NOW}) AND c.deletion_state = 'active'),
    count(*) FILTER (WHERE d.status = 'claimed' AND c.deletion_state <> 'active')
FROM (
    SELECT d.status, d.community_id, d.expires_at, d.attempt, d.max_attempts FROM {QUEUE} AS d
    WHERE d.status = 'claimed' AND d.lease_until < {MAINTENANCE_NOW}
    UNION ALL
    SELECT d.status, d.community_id, d.expires_at, d.attempt, d.max_attempts FROM {QUEUE} AS d
    WHERE d.status = 'pending' AND d.expires_at <= {MAINTENANCE_NOW}
) AS d
JOIN {COMMUNITY} AS c ON c.id = d.community_id
"""

# The dry run's batch plan: per active community with work, its lapsed leases and overdue
# pending deliveries, so the dry run reports the batches the run would take (see reaper.reap).
REAP_PLAN = f"""
SELECT d.community_id, count(*) FILTER (WHERE d.status = 'claimed'), count(*) FILTER (WHERE d.status = 'pending')
FROM (
    SELECT d.community_id, d.status FROM {QUEUE} AS d
    WHERE d.status = 'claimed' AND d.lease_until < {MAINTENANCE_NOW}
    UNION ALL
    SELECT d.community_id, d.status FROM {QUEUE} AS d
    WHERE d.status = 'pending' AND d.expires_at <= {MAINTENANCE_NOW}
) AS d
JOIN {COMMUNITY} AS c ON c.id = d.community_id
WHERE c.deletion_state = 'active'
GROUP BY d.community_id
"""

COUNT_FENCED_LAPSED = f"""
SELECT count(*) FROM {QUEUE} AS d
JOIN {COMMUNITY} AS c ON c.id = d.community_id
WHERE d.status = 'claimed' AND d.lease_until < {MAINTENANCE_NOW} AND c.deletion_state <> 'active'
"""

# --- operator actions (admin) --------------------------------------------------

# The requeue (stage 2): the record goes back to pending as it always did (the fence: the record
# is failed or expired, so it has no queue row), then its queue row is inserted from it, in the
# same transaction (services/operator.py): status pending, the record's new generation, attempt
# 0, history and deadline, no singleton key (a requeued delivery never holds its key again).
REQUEUE_IF_TERMINAL_FAILURE = f"""
UPDATE {RECORD} AS d
SET status = 'pending',
    finished_at = NULL,
    failure_code = NULL,
    failure_message = NULL,
    attempt = 0,
    next_attempt_at = NULL,
    expires_at = buzz_delivery_when(d.expires_at > {DB_NOW}, d.expires_at),
    lease_generation = d.lease_generation + 1,
    requeues = d.requeues + 1,
    {history_entry("'requeue'", "d.lease_generation + 1", "%(actor)s::text", status="'pending'")}
WHERE d.community_id = %(community_id)s AND d.id = %(delivery_id)s
  AND d.status IN ('failed', 'expired') AND {ACTIVE_COMMUNITY}
RETURNING d.id
"""

# Copied from the record; the lease columns are NULL (a pending row) and so are the slots and the key.
_QUEUE_COPIED = (
    "id, community_id, target_pubkey, workflow_id, priority, created_at, max_attempts, status, lease_generation, "
    "claimed_by, renewals, attempt, next_attempt_at, expires_at, history"
)
_QUEUE_CLEARED = ("lease_until", "claimed_at", "slot_community", "slot_target", "slot_workflow", "singleton_key")
INSERT_QUEUE_OF_REQUEUED = f"""
INSERT INTO {QUEUE} AS q ({_QUEUE_COPIED}, {", ".join(_QUEUE_CLEARED)})
SELECT {", ".join(f"d.{c}" for c in _QUEUE_COPIED.split(", "))}, {", ".join("NULL" for _ in _QUEUE_CLEARED)}
FROM {RECORD} AS d
WHERE d.community_id = %(community_id)s AND d.id = %(delivery_id)s AND d.status = 'pending'
RETURNING q.id
"""

# The queue row of a claimed delivery, deleted and returned (ended_columns) for END_FORCE_FAILED;
# ``%(now)s``, the database clock, is read first in the same transaction (services/operator.py).
FORCE_FAIL_IF_CLAIMED = f"""
DELETE FROM {QUEUE} AS d
WHERE d.community_id = %(community_id)s AND d.id = %(delivery_id)s
  AND d.status = 'claimed' AND {ACTIVE_COMMUNITY}
RETURNING {ended_columns("'failed'", "'operator_force_failed'", "%(failure_message)s", "d.lease_generation + 1")}
"""
