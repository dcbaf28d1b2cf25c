"""Issue 31, before building design C_lazy (bench/results/queue-design.md): can the delivery
table's name become a VIEW over three tables (the immutable record, the live queue row, the
terminal outcome) that Django reads as an unmanaged model? Two checks, printed, not asserted:

    # on a Citus coordinator database that is migrated and distributed (tests/citus_mode.py's way)
    python -m bench.queue_design_view citus postgres://postgres@127.0.0.1:9850/plan31

    # on plain PostgreSQL: the admin list's plans at --rows deliveries (a bench_ database)
    python -m bench.queue_design_view pg postgres://postgres@127.0.0.1:5433/bench_plan31 [--rows 200000]

``citus``: creates ``qv_record``/``qv_queue``/``qv_outcome`` (the shape of C_lazy, trimmed to
what the checks need) distributed by ``community_id`` and colocated with the delivery table, and
two views over them (LEFT JOIN form and UNION ALL form); then reports (a) how many tasks
Citus plans for the view filtered by one community, (b) whether INSTEAD OF INSERT / UPDATE /
DELETE triggers on the view work, (c) whether the settle (DELETE queue + INSERT outcome), the
requeue (DELETE outcome + INSERT queue) and the producer's commit (INSERT record + INSERT
queue) run as one task, plain or as PL/pgSQL functions delegated to the community's node, in
each plan cache mode, over more calls than PL/pgSQL's five custom plans; (d) whether an AFTER
INSERT trigger on the outcome (the fan-in's shape) works inside the delegated settle, and the
pruner's two-table DELETE as a delegated function.

``pg``: creates ``qv_current`` (the migrated delivery table's columns, CHECKs and indexes), loads
``--rows`` deliveries like bench/admin_changelist.py (90% finished, 4% failed, 1% expired, 4%
pending, 1% claimed; 5 communities; one every 2 s), copies them into the three tables, and
prints ``EXPLAIN (ANALYZE, BUFFERS)`` summaries of the admin's list queries (newest first,
100 rows, by status) on the table and on both views.
"""

from __future__ import annotations

import argparse
import re
import time
import uuid
from typing import Any

import psycopg

A = uuid.UUID("00000000-0000-0000-0000-00000000000a")
B = uuid.UUID("00000000-0000-0000-0000-00000000000b")

# --- shared DDL ---------------------------------------------------------------------------------

QUEUE = """
CREATE TABLE qv_queue (
  id uuid NOT NULL, community_id uuid NOT NULL, target_pubkey bytea NOT NULL,
  priority smallint NOT NULL DEFAULT 0, created_at timestamptz NOT NULL,
  next_attempt_at timestamptz, expires_at timestamptz, attempt integer NOT NULL DEFAULT 0, max_attempts integer,
  status varchar(16) NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'claimed')),
  lease_generation bigint NOT NULL DEFAULT 0, lease_until timestamptz, claimed_at timestamptz, claimed_by text,
  renewals integer NOT NULL DEFAULT 0, requeues integer NOT NULL DEFAULT 0, history jsonb NOT NULL DEFAULT '[]',
  PRIMARY KEY (id, community_id),
  FOREIGN KEY (id, community_id) REFERENCES qv_record (id, community_id)
) WITH (fillfactor = 30)"""
QUEUE_INDEX = "CREATE INDEX qv_queue_poll_idx ON qv_queue (community_id, target_pubkey, priority DESC, created_at, id)"
OUTCOME = """
CREATE TABLE qv_outcome (
  delivery_id uuid NOT NULL, community_id uuid NOT NULL,
  status varchar(16) NOT NULL CHECK (status IN ('finished', 'failed', 'expired')),
  finished_at timestamptz NOT NULL, attempt integer NOT NULL, lease_generation bigint NOT NULL,
  failure_code varchar(64), failure_message text, claimed_by text, renewals integer NOT NULL DEFAULT 0,
  requeues integer NOT NULL DEFAULT 0, history jsonb NOT NULL,
  created_at timestamptz,  -- the record's, copied at the settle (the admin's lists by status)
  PRIMARY KEY (delivery_id, community_id)
)"""
OUTCOME_INDEX = "CREATE INDEX qv_outcome_age_idx ON qv_outcome (community_id, finished_at)"

_STATE = {
    # column: (from the queue row, from the outcome row)
    "status": ("q.status", "o.status"),
    "lease_generation": ("q.lease_generation", "o.lease_generation"),
    "lease_until": ("q.lease_until", "NULL::timestamptz"),
    "claimed_at": ("q.claimed_at", "NULL::timestamptz"),
    "finished_at": ("NULL::timestamptz", "o.finished_at"),
    "attempt": ("q.attempt", "o.attempt"),
    "next_attempt_at": ("q.next_attempt_at", "NULL::timestamptz"),
    "expires_at": ("q.expires_at", "NULL::timestamptz"),
    "failure_code": ("NULL::varchar(64)", "o.failure_code"),
    "failure_message": ("NULL::text", "o.failure_message"),
    "claimed_by": ("q.claimed_by", "o.claimed_by"),
    "renewals": ("q.renewals", "o.renewals"),
    "requeues": ("q.requeues", "o.requeues"),
    "history": ("q.history", "o.history"),
}


def views(record_columns: list[str]) -> list[str]:
    """``qv_delivery`` (record LEFT JOIN queue LEFT JOIN outcome, state = COALESCE of the two)
    and ``qv_delivery_u`` (record JOIN queue UNION ALL record JOIN outcome): the old table's
    columns either way. ``security_invoker``: row-level security of the caller applies."""
    rec = ", ".join(f"r.{c}" for c in record_columns if c not in _STATE)

    def coalesce(q: str, o: str, name: str) -> str:
        if q.startswith("NULL"):
            return f"{o} AS {name}"
        if o.startswith("NULL"):
            return f"{q} AS {name}"
        return f"COALESCE({q}, {o}) AS {name}"

    left = ", ".join(coalesce(q, o, name) for name, (q, o) in _STATE.items())
    in_queue = ", ".join(f"{q} AS {name}" for name, (q, _) in _STATE.items())
    in_outcome = ", ".join(o for _, o in _STATE.values())
    in_queue = in_queue.replace("q.status AS status", "q.status::varchar(16) AS status")
    return [
        f"""CREATE VIEW qv_delivery WITH (security_invoker = true) AS
SELECT {rec}, {left}
FROM qv_record AS r
LEFT JOIN qv_queue AS q ON q.community_id = r.community_id AND q.id = r.id
LEFT JOIN qv_outcome AS o ON o.community_id = r.community_id AND o.delivery_id = r.id""",
        f"""CREATE VIEW qv_delivery_u WITH (security_invoker = true) AS
SELECT {rec}, {in_queue}
FROM qv_record AS r JOIN qv_queue AS q ON q.community_id = r.community_id AND q.id = r.id
UNION ALL
SELECT {rec}, {in_outcome.replace("o.status", "o.status::varchar(16)", 1)}
FROM qv_record AS r JOIN qv_outcome AS o ON o.community_id = r.community_id AND o.delivery_id = r.id""",
    ]


# The writes a test makes on the old table's name, carried out on the three tables.
INSTEAD_OF = """
CREATE OR REPLACE FUNCTION qv_delivery_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    INSERT INTO qv_record (id, community_id, run_id, step_id, target_pubkey, message_event_id, priority, created_at)
    VALUES (NEW.id, NEW.community_id, NEW.run_id, NEW.step_id, NEW.target_pubkey, NEW.message_event_id,
            COALESCE(NEW.priority, 0), COALESCE(NEW.created_at, statement_timestamp()));
    NEW.status := COALESCE(NEW.status, 'pending');
  ELSE
    DELETE FROM qv_queue WHERE community_id = OLD.community_id AND id = OLD.id;
    DELETE FROM qv_outcome WHERE community_id = OLD.community_id AND delivery_id = OLD.id;
    IF TG_OP = 'DELETE' THEN
      DELETE FROM qv_record WHERE community_id = OLD.community_id AND id = OLD.id;
      RETURN OLD;
    END IF;
  END IF;
  IF NEW.status IN ('pending', 'claimed') THEN
    INSERT INTO qv_queue (id, community_id, target_pubkey, priority, created_at, next_attempt_at, expires_at, attempt,
                          status, lease_generation, lease_until, claimed_at, claimed_by, renewals, requeues, history)
    VALUES (NEW.id, NEW.community_id, NEW.target_pubkey, COALESCE(NEW.priority, 0),
            COALESCE(NEW.created_at, statement_timestamp()), NEW.next_attempt_at, NEW.expires_at,
            COALESCE(NEW.attempt, 0), NEW.status, COALESCE(NEW.lease_generation, 0), NEW.lease_until, NEW.claimed_at,
            NEW.claimed_by, COALESCE(NEW.renewals, 0), COALESCE(NEW.requeues, 0), COALESCE(NEW.history, '[]'));
  ELSE
    INSERT INTO qv_outcome (delivery_id, community_id, status, finished_at, attempt, lease_generation, failure_code,
                            failure_message, claimed_by, renewals, requeues, history)
    VALUES (NEW.id, NEW.community_id, NEW.status, COALESCE(NEW.finished_at, statement_timestamp()),
            COALESCE(NEW.attempt, 0), COALESCE(NEW.lease_generation, 0), NEW.failure_code, NEW.failure_message,
            NEW.claimed_by, COALESCE(NEW.renewals, 0), COALESCE(NEW.requeues, 0), COALESCE(NEW.history, '[]'));
  END IF;
  RETURN NEW;
END $$"""
INSTEAD_OF_TRIGGER = (
    "CREATE TRIGGER qv_delivery_write INSTEAD OF INSERT OR UPDATE OR DELETE ON qv_delivery "
    "FOR EACH ROW EXECUTE FUNCTION qv_delivery_write()"
)

# C_lazy's settle: the fenced DELETE of the queue rows, the outcome for exactly those.
SETTLE = """
WITH gone AS (
  DELETE FROM qv_queue AS q USING unnest({ids}, {gens}) AS f(id, generation)
  WHERE q.community_id = {community} AND q.id = f.id AND q.lease_generation = f.generation
    AND q.status = 'claimed' AND q.lease_until >= buzz_delivery_now()
    AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = q.community_id AND c.deletion_state = 'active')
  RETURNING q.id, q.lease_generation, q.attempt, q.claimed_by, q.claimed_at, q.renewals, q.requeues, q.history)
INSERT INTO qv_outcome AS o (delivery_id, community_id, status, finished_at, attempt, lease_generation, claimed_by,
                             renewals, requeues, history)
SELECT g.id, {community}, {status}, buzz_delivery_now(), g.attempt, g.lease_generation, g.claimed_by, g.renewals,
       g.requeues,
       buzz_delivery_history_push(buzz_delivery_history_push(g.history,
           jsonb_build_object('event', 'claim', 'generation', g.lease_generation, 'at', g.claimed_at)),
           jsonb_build_object('event', 'settle', 'status', {status}, 'generation', g.lease_generation))
FROM gone AS g
RETURNING o.delivery_id, o.status"""

# The operator's requeue: the fenced DELETE of a failed/expired outcome, a new queue row
# (generation + 1, requeues + 1, the history carried with the requeue's entry).
REQUEUE = """
WITH gone AS (
  DELETE FROM qv_outcome AS o
  WHERE o.community_id = {community} AND o.delivery_id = {id} AND o.status IN ('failed', 'expired')
    AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = o.community_id AND c.deletion_state = 'active')
  RETURNING o.delivery_id, o.lease_generation, o.requeues, o.history)
INSERT INTO qv_queue AS q (id, community_id, target_pubkey, priority, created_at, lease_generation, requeues, history)
SELECT g.delivery_id, {community}, r.target_pubkey, r.priority, r.created_at, g.lease_generation + 1, g.requeues + 1,
       buzz_delivery_history_push(g.history,
           jsonb_build_object('event', 'requeue', 'generation', g.lease_generation + 1, 'actor', {actor}))
FROM gone AS g JOIN qv_record AS r ON r.community_id = {community} AND r.id = g.delivery_id
RETURNING q.id"""

# The producer's commit: the record and its queue row in one statement (the record first:
# Citus runs a CTE as a subplan before the main statement, so the queue's foreign key needs it).
COMMIT = """
WITH v AS (SELECT * FROM unnest({ids}, {steps}) AS v(id, step_id)),
recorded AS (
  INSERT INTO qv_record AS r (id, community_id, run_id, step_id, target_pubkey, message_event_id)
  SELECT v.id, {community}, '00000000-0000-0000-0000-0000000000ff'::uuid, v.step_id, '\\xab'::bytea, '\\xcd'::bytea
  FROM v
  ON CONFLICT DO NOTHING
  RETURNING r.id, r.target_pubkey, r.created_at)
INSERT INTO qv_queue AS q (id, community_id, target_pubkey, created_at)
SELECT recorded.id, {community}, recorded.target_pubkey, recorded.created_at FROM recorded
RETURNING q.id"""

CLAIM = """
UPDATE qv_queue AS q
SET status = 'claimed', lease_generation = q.lease_generation + 1, attempt = q.attempt + 1,
    claimed_at = buzz_delivery_now(), lease_until = buzz_delivery_now() + interval '1 minute', claimed_by = 'bench'
WHERE q.community_id = %(community)s AND q.id IN (
  SELECT c.id FROM qv_queue AS c WHERE c.community_id = %(community)s AND c.status = 'pending'
  ORDER BY c.priority DESC, c.created_at, c.id LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
RETURNING q.id, q.lease_generation"""


# C's claim in the product's shape: the candidates locked in a plain CTE, one UPDATE of the queue
# joined to the record for the binding the handler needs (no data-modifying CTE).
CLAIM_JOINED = """
WITH candidate AS MATERIALIZED (
  SELECT c.id FROM qv_queue AS c WHERE c.community_id = {community} AND c.status = 'pending'
  ORDER BY c.priority DESC, c.created_at, c.id LIMIT {limit} FOR UPDATE OF c SKIP LOCKED)
UPDATE qv_queue AS q
SET status = 'claimed', lease_generation = q.lease_generation + 1, attempt = q.attempt + 1,
    claimed_at = buzz_delivery_now(), lease_until = buzz_delivery_now() + interval '1 minute', claimed_by = 'bench'
FROM candidate, qv_record AS r
WHERE q.community_id = {community} AND q.id = candidate.id AND r.community_id = {community} AND r.id = q.id
RETURNING q.id, q.lease_generation, r.run_id, r.step_id"""

# The claim of the queue alone (the product's claim shape today), then the record read by key.
CLAIM_THEN_READ = """
DECLARE
  rec record;
  claimed uuid[] := '{}';
BEGIN
  FOR rec IN
    WITH candidate AS MATERIALIZED (
      SELECT c.id FROM qv_queue AS c WHERE c.community_id = p_community_id AND c.status = 'pending'
      ORDER BY c.priority DESC, c.created_at, c.id LIMIT p_limit FOR UPDATE OF c SKIP LOCKED)
    UPDATE qv_queue AS q
    SET status = 'claimed', lease_generation = q.lease_generation + 1, attempt = q.attempt + 1,
        claimed_at = buzz_delivery_now(), lease_until = buzz_delivery_now() + interval '1 minute', claimed_by = 'bench'
    FROM candidate
    WHERE q.community_id = p_community_id AND q.id = candidate.id
    RETURNING q.id
  LOOP
    claimed := claimed || rec.id;
  END LOOP;
  RETURN QUERY
  SELECT q.id, q.lease_generation, r.run_id, r.step_id
  FROM qv_queue AS q JOIN qv_record AS r ON r.community_id = p_community_id AND r.id = q.id
  WHERE q.community_id = p_community_id AND q.id = ANY (claimed);
END"""

# The settle as two plain statements (no data-modifying CTE): the outcomes of the fenced queue
# rows, locked by the INSERT's SELECT, then the DELETE of exactly those rows.
SETTLE_TWO_STATEMENTS = """
DECLARE
  settled uuid[] := '{}';
  rec record;
BEGIN
  FOR rec IN
    INSERT INTO qv_outcome AS o (delivery_id, community_id, status, finished_at, attempt, lease_generation, claimed_by,
                                 renewals, requeues, history)
    SELECT q.id, p_community_id, p_status, buzz_delivery_now(), q.attempt, q.lease_generation, q.claimed_by,
           q.renewals, q.requeues,
           buzz_delivery_history_push(buzz_delivery_history_push(q.history,
               jsonb_build_object('event', 'claim', 'generation', q.lease_generation, 'at', q.claimed_at)),
               jsonb_build_object('event', 'settle', 'status', p_status, 'generation', q.lease_generation))
    FROM qv_queue AS q, unnest(p_ids, p_gens) AS f(id, generation)
    WHERE q.community_id = p_community_id AND q.id = f.id AND q.lease_generation = f.generation
      AND q.status = 'claimed' AND q.lease_until >= buzz_delivery_now()
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = q.community_id AND c.deletion_state = 'active')
    FOR UPDATE OF q
    RETURNING o.delivery_id, o.status
  LOOP
    settled := settled || rec.delivery_id;
    id := rec.delivery_id;
    status := rec.status;
    RETURN NEXT;
  END LOOP;
  DELETE FROM qv_queue AS q WHERE q.community_id = p_community_id AND q.id = ANY (settled);
END"""


def _params(template: str, names: dict[str, str]) -> str:
    return template.format(**names)


def function(name: str, args: str, returns: str, body: str, mode: str | None) -> str:
    setting = f"SET plan_cache_mode = {mode}\n" if mode else ""
    if body.lstrip().startswith("DECLARE"):
        return (
            f"CREATE OR REPLACE FUNCTION {name}({args}) RETURNS {returns} LANGUAGE plpgsql VOLATILE\n{setting}"
            f"AS $fn$\n#variable_conflict use_column\n{body}\n$fn$"
        )
    return (
        f"CREATE OR REPLACE FUNCTION {name}({args}) RETURNS {returns} LANGUAGE plpgsql VOLATILE\n{setting}"
        f"AS $fn$\n#variable_conflict use_column\nBEGIN\n  RETURN QUERY\n{body};\nEND\n$fn$"
    )


def first_error(exc: Exception) -> str:
    return str(exc).splitlines()[0][:150]


def tasks(conn: psycopg.Connection, query: str, params: Any = None) -> str:
    """'<n> task(s)' from a Citus plan, or the plan's first line."""
    plan = "\n".join(r[0] for r in conn.execute(f"EXPLAIN (COSTS OFF) {query}", params))
    counts = re.findall(r"Task Count: (\d+)", plan)
    kinds = [k for k in ("Function Scan", "pull to coordinator", "repartition") if k in plan]
    if not counts:
        return plan.splitlines()[0].strip()
    return f"task counts {'+'.join(counts)}" + (f" ({', '.join(kinds)})" if kinds else "")


# --- Citus --------------------------------------------------------------------------------------


def citus(url: str) -> None:
    conn = psycopg.connect(url, autocommit=True)
    print(conn.execute("SELECT version()").fetchone()[0].split(" on ")[0],  # type: ignore[index]
          "/ citus", conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'citus'").fetchone()[0])  # type: ignore[index]  # fmt: skip
    conn.execute("DROP VIEW IF EXISTS qv_delivery, qv_delivery_u CASCADE")
    conn.execute("DROP TABLE IF EXISTS qv_outcome, qv_queue, qv_record CASCADE")
    conn.execute("""
CREATE TABLE qv_record (
  id uuid NOT NULL, community_id uuid NOT NULL, run_id uuid NOT NULL, step_id varchar(64) NOT NULL,
  target_pubkey bytea NOT NULL, message_event_id bytea NOT NULL, payload jsonb,
  priority smallint NOT NULL DEFAULT 0, created_at timestamptz NOT NULL DEFAULT statement_timestamp(),
  PRIMARY KEY (id, community_id),
  CONSTRAINT qv_record_identity UNIQUE (community_id, run_id, step_id, target_pubkey))""")
    for statement in (QUEUE, QUEUE_INDEX, OUTCOME, OUTCOME_INDEX):
        conn.execute(statement)
    for table in ("qv_record", "qv_queue", "qv_outcome"):
        conn.execute(
            "SELECT create_distributed_table(%s, 'community_id', colocate_with => 'buzz_delivery_delivery_record')",
            [table],
        )
    for statement in views(
        ["id", "community_id", "run_id", "step_id", "target_pubkey", "message_event_id", "priority", "created_at"]
    ):
        conn.execute(statement)
    conn.execute(
        "INSERT INTO buzz_delivery_community (id, name) VALUES (%s, 'qv-a'), (%s, 'qv-b') ON CONFLICT DO NOTHING",
        [A, B],
    )
    for community in (A, B):
        conn.execute(
            "INSERT INTO qv_record (id, community_id, run_id, step_id, target_pubkey, message_event_id) "
            "SELECT gen_random_uuid(), %s, gen_random_uuid(), 's' || g, '\\xab', '\\xcd' "
            "FROM generate_series(1, 400) g",
            [community],
        )
        conn.execute(
            "INSERT INTO qv_queue (id, community_id, target_pubkey, created_at) "
            "SELECT id, community_id, target_pubkey, created_at FROM qv_record WHERE community_id = %s", [community]
        )  # fmt: skip

    print("\n(a) the view filtered by one community / fleet-wide")
    for view in ("qv_delivery", "qv_delivery_u"):
        for label, query in (
            ("list by status, one community", f"SELECT id, status, history FROM {view} WHERE community_id = %s "
             "AND status = 'failed' ORDER BY created_at DESC LIMIT 100"),
            ("one row by key", f"SELECT status, lease_generation FROM {view} WHERE community_id = %s AND id = %s"),
            ("join to the community row", f"SELECT d.id, c.deletion_state FROM {view} AS d "
             "JOIN buzz_delivery_community AS c ON c.id = d.community_id "
             "WHERE d.community_id = %s AND d.status = 'pending' LIMIT 10"),
            ("FOR UPDATE OF the record", f"SELECT id FROM {view} WHERE community_id = %s AND status = 'pending' "
             "LIMIT 5 FOR UPDATE"),
            ("fleet: count by status", f"SELECT status, count(*) FROM {view} GROUP BY status"),
            ("fleet: list by status", f"SELECT id FROM {view} WHERE status = 'failed' "
             "ORDER BY created_at DESC LIMIT 100"),
        ):  # fmt: skip
            params: list[Any] = [A, uuid.uuid4()] if "%s AND id" in query else ([A] if "%s" in query else [])
            try:
                print(f"  {view:14} {label:32} {tasks(conn, query, params)}")
            except psycopg.Error as exc:
                print(f"  {view:14} {label:32} ERROR {first_error(exc)}")

    print("\n(b) INSTEAD OF triggers on the LEFT JOIN view (created on the coordinator)")
    conn.execute(INSTEAD_OF)
    conn.execute(INSTEAD_OF_TRIGGER)
    writes = [
        ("INSERT ... RETURNING", "INSERT INTO qv_delivery (id, community_id, run_id, step_id, target_pubkey, "
         "message_event_id) VALUES (gen_random_uuid(), %s, gen_random_uuid(), 'via-view', '\\xab', '\\xcd') "
         "RETURNING id, status", [A]),
        ("UPDATE one community", "UPDATE qv_delivery SET status = 'failed', failure_code = 'x' "
         "WHERE community_id = %s AND step_id = 's1'", [A]),
        ("UPDATE ... RETURNING", "UPDATE qv_delivery SET status = 'failed' WHERE community_id = %s "
         "AND step_id = 's2' RETURNING id", [A]),
        ("UPDATE fleet-wide", "UPDATE qv_delivery SET status = 'failed' WHERE step_id = 's3'", []),
        ("DELETE one community", "DELETE FROM qv_delivery WHERE community_id = %s AND step_id = 's4'", [A]),
    ]  # fmt: skip
    for label, statement, params in writes:
        try:
            rows = conn.execute(statement, params)
            print(f"  {label:24} ok, {rows.rowcount} row(s)")
        except psycopg.Error as exc:
            print(f"  {label:24} ERROR {first_error(exc)}")
    conn.execute("DROP TRIGGER qv_delivery_write ON qv_delivery")

    print("\n(c) two-table transitions: plain SQL, and delegated PL/pgSQL functions (11 calls each)")
    plain = {
        "settle (DELETE queue + INSERT outcome)": _params(SETTLE, {"ids": "%(ids)s::uuid[]",
            "gens": "%(gens)s::bigint[]", "community": "%(community)s::uuid", "status": "%(status)s::varchar"}),
        "commit (INSERT queue + INSERT record)": _params(COMMIT, {"ids": "%(ids)s::uuid[]",
            "steps": "%(steps)s::text[]", "community": "%(community)s::uuid"}),
    }  # fmt: skip
    for label, statement in plain.items():
        with conn.transaction(force_rollback=True):
            params = _call_params(conn, label)
            try:
                print(f"  plain {label:40} {tasks(conn, statement, params)}")
                rows = conn.execute(statement, params).fetchall()
                print(f"  plain {label:40} ran: {len(rows)} row(s)")
            except psycopg.Error as exc:
                print(f"  plain {label:40} ERROR {first_error(exc)}")
    bodies = {
        "settle": ("p_community_id uuid, p_ids uuid[], p_gens bigint[], p_status varchar",
                   "TABLE(id uuid, status varchar)",
                   _params(SETTLE, {"ids": "p_ids", "gens": "p_gens", "community": "p_community_id",
                                    "status": "p_status"})),
        "requeue": ("p_community_id uuid, p_id uuid, p_actor text", "TABLE(id uuid)",
                    _params(REQUEUE, {"id": "p_id", "community": "p_community_id", "actor": "p_actor"})),
        "claim": ("p_community_id uuid, p_limit bigint", "TABLE(id uuid, lease_generation bigint, run_id uuid, "
                  "step_id varchar)", _params(CLAIM_JOINED, {"community": "p_community_id", "limit": "p_limit"})),
        "claim2": ("p_community_id uuid, p_limit bigint", "TABLE(id uuid, lease_generation bigint, run_id uuid, "
                   "step_id varchar)", CLAIM_THEN_READ),
        "settle2": ("p_community_id uuid, p_ids uuid[], p_gens bigint[], p_status varchar",
                    "TABLE(id uuid, status varchar)", SETTLE_TWO_STATEMENTS),
        "commit": ("p_community_id uuid, p_ids uuid[], p_steps text[]", "TABLE(id uuid)",
                   _params(COMMIT, {"ids": "p_ids", "steps": "p_steps", "community": "p_community_id"})),
    }  # fmt: skip
    for mode in ("force_generic_plan", None, "force_custom_plan"):
        for name, (args, returns, body) in bodies.items():
            fn = f"qv_fn_{name}"
            conn.execute(f"DROP FUNCTION IF EXISTS {fn}")
            conn.execute(function(fn, args, returns, body, mode))
            signature = re.sub(r"p_\w+ ", "", args)
            conn.execute(
                "SELECT create_distributed_function(%s, 'p_community_id', "
                "colocate_with => 'buzz_delivery_delivery_record', "
                "force_delegation => true)",
                [f"{fn}({signature})"],
            )
            print(f"  {name:8} plan_cache_mode={mode or 'auto':19} {_run_function(conn, name, fn)}")
    extras(conn)
    conn.close()


FAN_IN = [
    "DROP TABLE IF EXISTS qv_count",
    "CREATE TABLE qv_count (community_id uuid NOT NULL, run_id uuid NOT NULL, terminal int NOT NULL DEFAULT 0, "
    "failed int NOT NULL DEFAULT 0, PRIMARY KEY (community_id, run_id))",
    "SELECT create_distributed_table('qv_count', 'community_id', colocate_with => 'buzz_delivery_delivery_record')",
    """CREATE OR REPLACE FUNCTION qv_fan_in() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  UPDATE qv_count AS k SET terminal = k.terminal + 1,
         failed = k.failed + CASE WHEN NEW.status = 'finished' THEN 0 ELSE 1 END
  FROM qv_record AS r
  WHERE r.community_id = NEW.community_id AND r.id = NEW.delivery_id
    AND k.community_id = NEW.community_id AND k.run_id = r.run_id;
  RETURN NULL;
END $$""",
    "CREATE TRIGGER qv_fan_in AFTER INSERT ON qv_outcome FOR EACH ROW EXECUTE FUNCTION qv_fan_in()",
]
PRUNE = """
WITH batch AS MATERIALIZED (
  SELECT o.delivery_id FROM qv_outcome AS o
  WHERE o.community_id = p_community_id AND o.finished_at < now() - make_interval(secs => p_age_seconds)
  ORDER BY o.finished_at LIMIT p_batch FOR UPDATE OF o SKIP LOCKED),
gone AS (
  DELETE FROM qv_outcome AS o USING batch
  WHERE o.community_id = p_community_id AND o.delivery_id = batch.delivery_id
  RETURNING o.delivery_id)
DELETE FROM qv_record AS r USING gone
WHERE r.community_id = p_community_id AND r.id = gone.delivery_id
RETURNING r.id"""


def extras(conn: psycopg.Connection) -> None:
    """(d) the fan-in's shape (an AFTER INSERT trigger on the outcome updating another colocated
    table, joined to the record) fired inside the delegated settle, and the pruner's two-table
    DELETE as a delegated function."""
    print("\n(d) a trigger on the outcome inside the delegated settle; the pruner as a delegated function")
    for statement in FAN_IN:
        conn.execute(statement)
    conn.execute(
        "INSERT INTO qv_count (community_id, run_id) SELECT DISTINCT community_id, run_id FROM qv_record "
        "WHERE community_id = %s",
        [A],
    )
    p = _call_params(conn, "settle")
    settled = conn.execute(
        "SELECT * FROM qv_fn_settle(%s, %s::uuid[], %s::bigint[], 'failed')", [A, p["ids"], p["gens"]]
    ).fetchall()
    counted = conn.execute("SELECT sum(terminal), sum(failed) FROM qv_count WHERE community_id = %s", [A]).fetchone()
    print(f"  settled {len(settled)} as failed; the trigger counted terminal/failed {counted}")
    conn.execute("DROP FUNCTION IF EXISTS qv_fn_prune")
    conn.execute(
        function("qv_fn_prune", "p_community_id uuid, p_age_seconds float8, p_batch bigint", "TABLE(id uuid)",
                 PRUNE, "force_custom_plan")
    )  # fmt: skip
    conn.execute(
        "SELECT create_distributed_function('qv_fn_prune(uuid, float8, bigint)', 'p_community_id', "
        "colocate_with => 'buzz_delivery_delivery_record', force_delegation => true)"
    )
    outcomes = conn.execute("SELECT count(*) FROM qv_outcome WHERE community_id = %s", [A]).fetchone()
    call = "SELECT * FROM qv_fn_prune(%s, 0, 100000)"
    plan = tasks(conn, call, [A])
    first = len(conn.execute(call, [A]).fetchall())
    second = len(conn.execute(call, [A]).fetchall())
    left = conn.execute(
        "SELECT (SELECT count(*) FROM qv_outcome WHERE community_id = %s), (SELECT count(*) FROM qv_record AS r "
        "WHERE r.community_id = %s AND NOT EXISTS (SELECT 1 FROM qv_queue AS q WHERE q.community_id = r.community_id "
        "AND q.id = r.id))",
        [A, A],
    ).fetchone()
    print(f"  prune: {plan}; {outcomes} outcomes -> deleted {first} records, then {second}; "
          f"left (outcomes, records without a queue row) {left}")  # fmt: skip


def _call_params(conn: psycopg.Connection, label: str) -> dict[str, Any]:
    if label.startswith("settle") or label.startswith("plain settle"):
        rows = conn.execute(CLAIM, {"community": A, "limit": 3}).fetchall()
        return {"ids": [r[0] for r in rows], "gens": [r[1] for r in rows], "community": A, "status": "finished"}
    n = 3
    return {"ids": [uuid.uuid4() for _ in range(n)], "steps": [f"c-{uuid.uuid4().hex[:8]}" for _ in range(n)],
            "community": A}  # fmt: skip


def _make_failed(conn: psycopg.Connection) -> uuid.UUID:
    """A pending delivery of A made failed by two plain statements (what the requeue takes back)."""
    with conn.transaction():
        row = conn.execute(
            "DELETE FROM qv_queue WHERE community_id = %s AND id = (SELECT id FROM qv_queue WHERE community_id = %s "
            "AND status = 'pending' LIMIT 1) RETURNING id",
            [A, A],
        ).fetchone()
        assert row is not None
        conn.execute(
            "INSERT INTO qv_outcome (delivery_id, community_id, status, finished_at, attempt, lease_generation, "
            "history) VALUES (%s, %s, 'failed', now(), 1, 1, '[]')",
            [row[0], A],
        )
    return row[0]


def _run_function(conn: psycopg.Connection, name: str, fn: str) -> str:
    """Eleven calls on one connection (one worker connection: PL/pgSQL's plan cache there sees
    them all): each must return what it did; the first call's plan's task count."""
    results, plan, error = [], "", ""
    for i in range(11):
        try:
            if name in ("claim", "claim2"):
                call, args, expected = f"SELECT * FROM {fn}(%s, 2)", [A], 2
            elif name in ("settle", "settle2"):
                p = _call_params(conn, "settle")
                call, args = f"SELECT * FROM {fn}(%s, %s::uuid[], %s::bigint[], %s::varchar)", [
                    A, p["ids"], p["gens"], "finished"]  # fmt: skip
                expected = len(p["ids"])
            elif name == "requeue":
                failed = _make_failed(conn)
                call, args, expected = f"SELECT * FROM {fn}(%s, %s, 'bench')", [A, failed], 1
            else:
                p = _call_params(conn, "commit")
                call, args, expected = f"SELECT * FROM {fn}(%s, %s::uuid[], %s::text[])", [A, p["ids"], p["steps"]], 3
            if i == 0:
                plan = tasks(conn, call, args)
            results.append(len(conn.execute(call, args).fetchall()) == expected)
        except psycopg.Error as exc:
            error = f"call {i + 1}: ERROR {first_error(exc)}"
            break
    ok = sum(results)
    return f"{plan}; {ok}/{len(results)} calls did their rows" + (f"; {error}" if error else "")


# --- plain PostgreSQL: the admin list's plans on the views ---------------------------------------

RECORD_DROPPED = [
    "status", "lease_generation", "lease_until", "claimed_at", "finished_at", "slot_community", "slot_target",
    "slot_workflow", "attempt", "next_attempt_at", "failure_code", "failure_message", "claimed_by", "renewals",
    "history", "requeues",
]  # fmt: skip


def pg(url: str, rows: int) -> None:
    from bench import env

    if not url.rsplit("/", 1)[1].startswith("bench_"):
        raise SystemExit("the database must be named bench_...")
    env.ensure_database(url)
    env.setup_django(url)
    env.migrate()
    conn = psycopg.connect(url, autocommit=True)
    conn.execute("DROP VIEW IF EXISTS qv_delivery, qv_delivery_u CASCADE")
    conn.execute("DROP TABLE IF EXISTS qv_outcome, qv_queue, qv_record, qv_current CASCADE")
    conn.execute("CREATE TABLE qv_current (LIKE buzz_delivery_delivery_record INCLUDING ALL)")
    conn.execute("CREATE TABLE qv_record (LIKE buzz_delivery_delivery_record INCLUDING DEFAULTS)")
    conn.execute("ALTER TABLE qv_record " + ", ".join(f"DROP COLUMN {c}" for c in RECORD_DROPPED))
    conn.execute("ALTER TABLE qv_record ADD PRIMARY KEY (id, community_id)")
    for statement in (
        "CREATE UNIQUE INDEX ON qv_record (community_id, run_id, step_id, target_pubkey)",
        "CREATE INDEX ON qv_record (community_id, workflow_id)",
        "CREATE INDEX ON qv_record (community_id, message_event_id)",
        "CREATE INDEX qv_record_created_idx ON qv_record (created_at) WHERE created_at > '1970-01-01 00:00:00+00'",
        QUEUE, QUEUE_INDEX, OUTCOME, OUTCOME_INDEX,
        "CREATE INDEX qv_outcome_failure_code_idx ON qv_outcome (failure_code) WHERE failure_code IS NOT NULL",
        # The lists by status driven from the table that owns the status (HOT-safe on the queue:
        # created_at and id never change).
        "CREATE INDEX qv_queue_created_idx ON qv_queue (created_at, id)",
        "CREATE INDEX qv_outcome_created_idx ON qv_outcome (created_at, delivery_id)",
    ):  # fmt: skip
        conn.execute(statement)
    record_columns = [
        r[0]
        for r in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'qv_record'::regclass AND attnum > 0 "
            "AND NOT attisdropped ORDER BY attnum"
        )
    ]
    for statement in views(record_columns):
        conn.execute(statement)
    started = time.monotonic()
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")
        communities = [uuid.UUID(int=0xC0 + i) for i in range(5)]
        for c in communities:
            conn.execute("INSERT INTO buzz_delivery_community (id, name) VALUES (%s, 'qv') ON CONFLICT DO NOTHING", [c])
        # 90% finished, 4% failed, 1% expired, 4% pending, 1% claimed (bench/admin_changelist.py)
        conn.execute(
            """
INSERT INTO qv_current (id, community_id, workflow_id, run_id, step_id, target_pubkey, definition_event_id,
    message_event_id, cause_kind, cause_webhook_invocation_id, status, lease_generation, lease_until, claimed_at,
    finished_at, attempt, failure_code, claimed_by, history, created_at)
SELECT gen_random_uuid(), (%(communities)s::uuid[])[1 + g %% 5], gen_random_uuid(), gen_random_uuid(), 's' || g,
       decode(lpad(to_hex(g %% 50), 64, '0'), 'hex'), decode(repeat('ab', 32), 'hex'), decode(repeat('cd', 32), 'hex'),
       'webhook', gen_random_uuid(), s.status,
       CASE WHEN s.status = 'pending' THEN 0 ELSE 1 END,
       CASE WHEN s.status = 'claimed' THEN now() + interval '1 minute' END,
       CASE WHEN s.status = 'claimed' THEN now() END,
       CASE WHEN s.status IN ('finished', 'failed', 'expired')
            THEN now() - make_interval(secs => (%(rows)s - g) * 2) END,
       CASE WHEN s.status = 'pending' THEN 0 ELSE 1 END,
       CASE WHEN s.status IN ('failed', 'expired') THEN 'boom' END,
       CASE WHEN s.status <> 'pending' THEN 'bench' END,
       CASE WHEN s.status = 'pending' THEN '[]' ELSE '[{"event": "claim"}, {"event": "settle"}]' END::jsonb,
       now() - make_interval(secs => (%(rows)s - g) * 2)
FROM generate_series(1, %(rows)s) AS g,
     LATERAL (SELECT CASE WHEN g %% 100 < 90 THEN 'finished' WHEN g %% 100 < 94 THEN 'failed'
                          WHEN g %% 100 < 95 THEN 'expired' WHEN g %% 100 < 99 THEN 'pending'
                          ELSE 'claimed' END AS status) AS s""",
            {"communities": communities, "rows": rows},
        )
        cols = ", ".join(record_columns)
        conn.execute(f"INSERT INTO qv_record ({cols}) SELECT {cols} FROM qv_current")
        conn.execute(
            "INSERT INTO qv_queue (id, community_id, target_pubkey, priority, created_at, attempt, status, "
            "lease_generation, lease_until, claimed_at, claimed_by, history) SELECT id, community_id, target_pubkey, "
            "priority, created_at, attempt, status, lease_generation, lease_until, claimed_at, claimed_by, history "
            "FROM qv_current WHERE status IN ('pending', 'claimed')"
        )
        conn.execute(
            "INSERT INTO qv_outcome (delivery_id, community_id, status, finished_at, attempt, lease_generation, "
            "failure_code, claimed_by, history, created_at) SELECT id, community_id, status, finished_at, attempt, "
            "lease_generation, failure_code, claimed_by, history, created_at FROM qv_current "
            "WHERE status IN ('finished', 'failed', 'expired')"
        )
    for table in ("qv_current", "qv_record", "qv_queue", "qv_outcome", "buzz_delivery_community"):
        conn.execute(f"VACUUM ANALYZE {table}")
    print(f"loaded {rows:,} deliveries in {time.monotonic() - started:.0f} s")

    floor = "created_at > '1970-01-01 00:00:00+00'"
    list_columns = ("d.id, d.status, d.community_id, d.target_pubkey, d.run_id, d.step_id, d.claimed_by, "
                    "d.lease_until, d.claimed_at, d.finished_at, d.next_attempt_at, d.attempt, d.lease_generation, "
                    "d.failure_code, d.created_at, c.name, c.deletion_state")  # fmt: skip
    queries = {
        "list, no filter": f"WHERE d.{floor}",
        "list, status=finished (90%)": f"WHERE d.{floor} AND d.status = 'finished'",
        "list, status=failed (4%)": f"WHERE d.{floor} AND d.status = 'failed'",
        "list, status=pending (4%)": f"WHERE d.{floor} AND d.status = 'pending'",
        "list, status=claimed (1%)": f"WHERE d.{floor} AND d.status = 'claimed'",
        "list, failure_code=boom": f"WHERE d.{floor} AND d.failure_code = 'boom'",
        "list, one community, failed": (
            f"WHERE d.{floor} AND d.community_id = '{communities[2]}' AND d.status = 'failed'"
        ),
    }  # fmt: skip
    print(
        "\nadmin list (100 newest; + join to the community row): planning + execution ms / shared buffers "
        "hit+read, median of 5"
    )
    sources = ("qv_current", "qv_delivery", "qv_delivery_u", "owner")
    print("| query | qv_current (table) | qv_delivery (LEFT JOIN view) | qv_delivery_u (UNION ALL view) | "
          "from the owning table (queue or outcome) JOIN record |")  # fmt: skip
    print("|---|---|---|---|---|")
    for label, where in queries.items():
        cells = []
        for source in sources:
            if source == "owner":
                statement = _owner_list(where)
                if statement is None:
                    cells.append("-")
                    continue
            else:
                statement = (
                    f"SELECT {list_columns} FROM {source} AS d JOIN buzz_delivery_community AS c "
                    f"ON c.id = d.community_id {where} ORDER BY d.created_at DESC, d.id DESC LIMIT 100"
                )
            cells.append(_analyze(conn, statement))
        print(f"| {label} | {' | '.join(cells)} |")
    print("\nother readers")
    for label, template in {
        "one row by key (detail page)": "SELECT * FROM {s} AS d WHERE d.community_id = %s AND d.id = %s",
        "count(*) by status (exact dashboard)": "SELECT status, count(*) FROM {s} AS d GROUP BY status",
        "count(*) status=claimed": "SELECT count(*) FROM {s} AS d WHERE d.status = 'claimed'",
    }.items():
        key = conn.execute("SELECT community_id, id FROM qv_current WHERE status = 'failed' LIMIT 1").fetchone()
        cells = []
        for source in ("qv_current", "qv_delivery", "qv_delivery_u"):
            statement = template.format(s=source)
            cells.append(_analyze(conn, statement, list(key) if "%s" in statement else None))  # type: ignore[arg-type]
        print(f"| {label} | {' | '.join(cells)} |")
    conn.close()


def _owner_list(where: str) -> str | None:
    """The list by status read from the table that owns that status (the queue for pending and
    claimed, the outcome for the terminal ones), ordered by its own copy of created_at."""
    match = re.search(r"d\.(status|failure_code) = '(\w+)'", where)
    if match is None:
        return None
    terminal = match.group(1) == "failure_code" or match.group(2) not in ("pending", "claimed")
    t, key = ("o", "o.delivery_id") if terminal else ("q", "q.id")
    table = "qv_outcome" if terminal else "qv_queue"
    owner_where = where.replace("d.created_at", f"{t}.created_at").replace("d.status", f"{t}.status")
    owner_where = owner_where.replace("d.failure_code", "o.failure_code").replace("d.community_id", f"{t}.community_id")
    state = ("o.status, NULL::timestamptz, o.finished_at, o.attempt, o.lease_generation, o.failure_code, o.claimed_by"
             if terminal else "q.status, q.lease_until, NULL::timestamptz, q.attempt, q.lease_generation, NULL, "
             "q.claimed_by")  # fmt: skip
    return (
        f"SELECT {key}, {state}, r.community_id, r.target_pubkey, r.run_id, r.step_id, {t}.created_at, c.name, "
        f"c.deletion_state FROM {table} AS {t} "
        f"JOIN qv_record AS r ON r.community_id = {t}.community_id AND r.id = {key} "
        f"JOIN buzz_delivery_community AS c ON c.id = {t}.community_id "
        f"{owner_where} ORDER BY {t}.created_at DESC, {key} DESC LIMIT 100"
    )


def _analyze(conn: psycopg.Connection, statement: str, params: Any = None) -> str:
    times, buffers = [], ""
    for _ in range(5):
        plan = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}", params).fetchone()[0][0]  # type: ignore[index]
        times.append(plan["Execution Time"] + plan["Planning Time"])
        top = plan["Plan"]
        buffers = f"{top.get('Shared Hit Blocks', 0) + top.get('Shared Read Blocks', 0):,}"
    times.sort()
    return f"{times[2]:.2f} ms / {buffers}"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.queue_design_view", description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("citus", "pg"))
    parser.add_argument("url")
    parser.add_argument("--rows", type=int, default=200_000)
    args = parser.parse_args()
    if args.mode == "citus":
        citus(args.url)
    else:
        pg(args.url, args.rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
