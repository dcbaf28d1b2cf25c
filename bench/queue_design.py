"""Issue 31 spike: can a narrow queue table beside a rarely-written delivery record drain no-op
deliveries at 1.2x PgQueuer tuned while keeping the inbox's guarantees? Measured before anyone
builds it, in raw SQL, next to our current table and the raw batch-50 floor, in one run,
interleaved:

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_fNAME \\
        python -m bench.queue_design [--deliveries 20000] [--rounds 3] [--only current,raw,A,B,C,...]

Variants (``VARIANTS``), each drained claim 50 -> settle 50 by K = 1 and K = 4 processes, each its
own connection (the shape of the raw floor of ``bench/peers.py``):

- ``current``: our delivery table, the plan-cached claim and batch settle of ``services.cached``
  (what ``bench.server_ladder`` drains), every trigger and index on;
- ``raw``: the raw batch-50 floor (``bench.baseline``: claim 50, settle 50, 2+2 indexes);
- ``A``: a narrow queue row per live delivery (polling index partial on ``pending``, lease index
  partial on ``claimed``) beside the wide record, which the settle updates once (status,
  finished_at, outcome, history) in the statement that deletes the queue row;
- ``B``: the same queue; the record is never updated: the settle deletes the queue row and inserts
  the outcome into an append-only ``outcome`` table (primary key = the delivery: exactly once);
- ``C``: B's terminal (without the outcome's foreign key to the record, redundant with the
  queue row's), with a queue whose claim is a HOT update: no index of the queue names ``status``,
  ``lease_until`` or the generation (key or predicate), fillfactor 30 (room on the page for each
  row's claimed version); the reaper and the expirer would read the polling index (the queue
  holds live rows only);
- ``C_nohist``: C without the history entries (what the history costs);
- ``C_lazy``: C whose claim appends no history entry: the settle appends the claim's entry (built
  from the queue row's claimed_at/claimed_by/generation/attempt) and its own, so the outcome's
  history is the same as C's;
- ``A_hot``: A's terminal with C's queue;
- ``C_lazy_ff70``: C_lazy with the queue at fillfactor 70 (is the claim still HOT?);
- ``C_lazy_nodelfence`` (comparison only, not a candidate): C_lazy without the write fence's
  BEFORE DELETE trigger on the queue, to measure what a BEFORE ROW trigger costs a DELETE;
- ``pgqueuer_tuned`` and ``peers_raw50``: PgQueuer (batch 50, asyncpg) and the raw batch-50 floor
  (and ``worker``: ``run_worker`` on our current table, what issue 31 measures; not in the default
  set) run by ``bench.scenarios.peers.drain_once`` (its process pool and its /proc watcher of every
  backend of the database), so the two harnesses are tied by the raw floor run in both.

Per drain: deliveries/s (common start to the last drainer's end), server CPU µs/delivery (user +
system CPU of the drainers' backends from ``/proc``, sampled before and after), heap HOT updates of
the queue/record/outcome from ``pg_stat_user_tables``. Index inserts per delivery are counted
once per variant after the timed rounds, from the WAL of a 2,000-delivery drain
(``pg_walinspect``: Btree INSERT_LEAF/INSERT_POST records whose block is one of the variant's
indexes), since PostgreSQL 15 keeps no per-index insert counter.

Every candidate keeps, in its statements (see each statement's comments):
- the fenced settle (id, target, generation, ``claimed``, ``lease_until >= now``), judged by the
  rows it returns;
- the community lifecycle (``deletion_state = 'active'``) in each claim and settle;
- the write fence: the product's three BEFORE ROW ``buzz_delivery_write_fence_row`` triggers on
  every candidate table, plus the generation-monotonic trigger on the queue and the history
  append-only trigger on the record;
- history: the claim appends its entry to the queue row's history (as today's claim does to the
  delivery row); the settle moves that history with its own entry into the record (A) or the
  outcome row (B, C), in the same statement;
- exactly-once terminal: a queue row is deleted once (its DELETE is the fence); A's record update
  also requires ``status = 'live'``; B/C's outcome has the delivery as primary key.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import statistics
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg

BATCH = 50
KS = (1, 4)
START_DELAY = 0.5
WAL_DELIVERIES = 2_000
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- schemas ---------------------------------------------------------------------------------------

ACTIVE = (
    "EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = {a}.community_id AND c.deletion_state = 'active')"
)
NOW = "buzz_delivery_now()"


@dataclass(frozen=True)
class Candidate:
    """``hot``: the queue's claim can be a HOT update; ``outcome``: the terminal is an inserted
    outcome row (else an update of the record); ``history``: append history entries."""

    prefix: str
    hot: bool
    outcome: bool
    history: bool = True
    # The claim appends no entry: the queue row's own columns (claimed_at, claimed_by, generation,
    # attempt) are the claim's entry, which the next transition of the row appends before its own
    # (the history ends the same; the claimed row does not grow, so its version fits the page).
    lazy_claim_entry: bool = False
    # The queue's fillfactor when its claim is HOT (a claimed version must fit on its page).
    hot_fillfactor: int = 30
    # COMPARISON ONLY: leave the write fence's BEFORE DELETE trigger off the queue, to measure
    # what a BEFORE ROW trigger costs a DELETE (it locks the old row before testing its WHEN).
    delete_fence: bool = True
    # The outcome's foreign key to the record: each insert takes a KEY SHARE row lock on the
    # record (a heap write and a WAL record per delivery). Redundant with the queue row's key to
    # the record (an outcome is written only for a queue row deleted in the same statement).
    outcome_fk: bool = True

    @property
    def queue(self) -> str:
        return f"{self.prefix}_queue"

    @property
    def record(self) -> str:
        return f"{self.prefix}_delivery"

    @property
    def outcome_table(self) -> str:
        return f"{self.prefix}_outcome"

    @property
    def tables(self) -> list[str]:
        return [self.queue, self.record, *([self.outcome_table] if self.outcome else [])]


def ddl(c: Candidate) -> list[str]:
    q, d, o = c.queue, c.record, c.outcome_table
    statements = [f"DROP TABLE IF EXISTS {o}, {q}, {d} CASCADE"]
    # The record: what the producer writes at commit (binding, payload, identity) and, in A, the
    # terminal outcome written once. No index names status/finished_at (the pruner walks
    # delivery_created_idx's twin and reads status), so A's one update can be HOT; fillfactor 90
    # leaves room for it.
    terminal_columns = (
        ""
        if c.outcome
        else """
        status varchar(16) NOT NULL DEFAULT 'live'
            CHECK (status IN ('live', 'finished', 'failed', 'expired', 'cancelled')),
        finished_at timestamptz,
        attempt integer,
        lease_generation bigint,
        failure_code varchar(64),
        failure_message text,
        history jsonb NOT NULL DEFAULT '[]'::jsonb,"""
    )
    statements.append(f"""
    CREATE TABLE {d} (
        id uuid NOT NULL,
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
        max_attempts integer,
        expires_at timestamptz,
        execution_trace jsonb,
        trigger_context jsonb,
        priority smallint NOT NULL DEFAULT 0,
        singleton_key varchar(64),
        created_at timestamptz NOT NULL DEFAULT statement_timestamp(),{terminal_columns}
        PRIMARY KEY (id, community_id),
        CONSTRAINT {d}_identity_key UNIQUE (community_id, run_id, step_id, target_pubkey)
    ) WITH (fillfactor = {100 if c.outcome else 90})""")
    statements += [
        f"CREATE INDEX {d}_workflow_idx ON {d} (community_id, workflow_id)",
        f"CREATE INDEX {d}_message_event_idx ON {d} (community_id, message_event_id)",
        f"CREATE INDEX {d}_created_idx ON {d} (created_at) WHERE created_at > '1970-01-01 00:00:00+00'",
    ]
    # The queue: one row per live delivery (pending or claimed), what a claim reads and writes;
    # deleted by the terminal settle. Columns named as the delivery table's, so the product's
    # generation-monotonic trigger applies unchanged.
    statements.append(f"""
    CREATE TABLE {q} (
        id uuid NOT NULL,
        community_id uuid NOT NULL,
        target_pubkey bytea NOT NULL,
        priority smallint NOT NULL DEFAULT 0,
        created_at timestamptz NOT NULL,
        next_attempt_at timestamptz,
        expires_at timestamptz,
        attempt integer NOT NULL DEFAULT 0,
        max_attempts integer,
        status varchar(16) NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'claimed')),
        lease_generation bigint NOT NULL DEFAULT 0,
        lease_until timestamptz,
        claimed_at timestamptz,
        claimed_by text,
        renewals integer NOT NULL DEFAULT 0,
        history jsonb NOT NULL DEFAULT '[]'::jsonb,
        CHECK ((status = 'claimed') = (lease_until IS NOT NULL)),
        PRIMARY KEY (id, community_id),
        FOREIGN KEY (id, community_id) REFERENCES {d} (id, community_id)
    ) WITH (fillfactor = {c.hot_fillfactor if c.hot else 100})""")
    if c.hot:
        # No key or predicate names status, lease_until, lease_generation, claimed_*: a claim
        # changes only those (and attempt, history), so it is a HOT update when the page has room.
        statements.append(
            f"CREATE INDEX {q}_poll_idx ON {q} (community_id, target_pubkey, priority DESC, created_at, id)"
        )
    else:
        statements += [
            f"CREATE INDEX {q}_poll_idx ON {q} (community_id, target_pubkey, priority DESC, created_at, id)"
            " WHERE status = 'pending'",
            f"CREATE INDEX {q}_lease_idx ON {q} (community_id, lease_until) WHERE status = 'claimed'",
        ]
    fk = f",\n        FOREIGN KEY (delivery_id, community_id) REFERENCES {d} (id, community_id)" if c.outcome_fk else ""
    if c.outcome:
        # Append-only: one row per delivery (the primary key makes a second terminal an error),
        # the pruner's age index.
        statements += [
            f"""
    CREATE TABLE {o} (
        delivery_id uuid NOT NULL,
        community_id uuid NOT NULL,
        status varchar(16) NOT NULL CHECK (status IN ('finished', 'failed', 'expired', 'cancelled')),
        finished_at timestamptz NOT NULL,
        attempt integer NOT NULL,
        lease_generation bigint NOT NULL,
        failure_code varchar(64),
        failure_message text,
        history jsonb NOT NULL,
        PRIMARY KEY (delivery_id, community_id){fk}
    )""",
            f"CREATE INDEX {o}_age_idx ON {o} (community_id, finished_at)",
        ]
    return statements


def copy_triggers(conn: psycopg.Connection, c: Candidate) -> list[str]:
    """The product's write fence on every candidate table and its generation-monotonic trigger on
    the queue. The history guard becomes a write-once guard: A's record takes its claim and
    settle entries in one update, which the product's one-entry-per-statement trigger refuses,
    so a record that is no longer ``live`` refuses any update (stronger: its history is final);
    the outcome table refuses UPDATE and DELETE (append-only; the pruner would pass the fence as
    the product's pruner does). Neither fires on the measured statements' rows but as a WHEN test."""
    rows = conn.execute(
        "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger "
        "WHERE tgrelid = 'buzz_delivery_delivery_record'::regclass AND NOT tgisinternal"
    ).fetchall()
    out = []
    for name, definition in rows:
        if "write_fence_delete" in name and not c.delete_fence:
            targets = [t for t in c.tables if t != c.queue]
        elif "write_fence" in name:
            targets = c.tables
        elif "generation_monotonic" in name:
            targets = [c.queue]
        else:
            continue
        for table in targets:
            out.append(
                definition.replace("public.buzz_delivery_delivery_record", table).replace(
                    f"TRIGGER {name} ", f"TRIGGER {name}_{table} "
                )
            )
    out.append(
        "CREATE OR REPLACE FUNCTION qd_final() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "RAISE EXCEPTION '%: % is final', TG_TABLE_NAME, OLD.community_id; END $$"
    )
    if c.outcome:
        out.append(f"CREATE TRIGGER {c.outcome_table}_append_only BEFORE UPDATE OR DELETE ON {c.outcome_table} "
                   "FOR EACH ROW EXECUTE FUNCTION qd_final()")  # fmt: skip
    else:
        out.append(f"CREATE TRIGGER {c.record}_write_once BEFORE UPDATE ON {c.record} "
                   "FOR EACH ROW WHEN (OLD.status <> 'live') EXECUTE FUNCTION qd_final()")  # fmt: skip
    return out


LOAD_RECORD = """
INSERT INTO {d} (id, community_id, workflow_id, run_id, step_id, target_pubkey, definition_event_id,
                 message_event_id, cause_kind, cause_webhook_invocation_id, max_attempts, created_at)
SELECT (lpad(to_hex(%(base)s::bigint + g.i), 16, '0') || substr(md5(%(tag)s || g.i::text), 1, 16))::uuid,
       %(community_id)s, %(workflow_id)s, %(run_id)s, %(tag)s || '-' || g.i,
       %(target)s, %(definition_event_id)s, %(message_event_id)s, 'webhook', md5(%(tag)s || g.i::text)::uuid, 3,
       now() - make_interval(secs => %(count)s - g.i) / 1000000
FROM generate_series(0, %(count)s - 1) AS g(i)
"""
LOAD_QUEUE = """
INSERT INTO {q} (id, community_id, target_pubkey, priority, created_at, expires_at, max_attempts)
SELECT id, community_id, target_pubkey, priority, created_at, expires_at, max_attempts FROM {d}
"""


# --- statements --------------------------------------------------------------------------------------


def _claim_entry(c: Candidate) -> str:
    from buzz_delivery.services import sql

    if not c.history or c.lazy_claim_entry:
        return ""
    entry = sql.history_entry(
        "'claim'", "q.lease_generation + 1", "%(holder)s::text", status="'claimed'", alias="q", attempt="q.attempt + 1"
    )
    return f",\n        {entry}"


def claim_sql(c: Candidate) -> str:
    """Claim 50 of one community and target: only the queue row is written (lease, generation,
    holder, the claim's history entry); the record is read for what the handler needs."""
    return f"""
WITH candidate AS MATERIALIZED (
    SELECT q.id FROM {c.queue} AS q
    WHERE q.community_id = %(community_id)s AND q.target_pubkey = %(target_pubkey)s
      AND q.status = 'pending'
      AND (q.next_attempt_at IS NULL OR q.next_attempt_at <= {NOW})
      AND (q.expires_at IS NULL OR q.expires_at > {NOW})
      AND (q.max_attempts IS NULL OR q.attempt < q.max_attempts)
      AND {ACTIVE.format(a="q")}  -- lifecycle: a fenced community's rows are not claimable
    ORDER BY q.priority DESC, q.created_at, q.id
    LIMIT %(limit)s
    FOR UPDATE OF q SKIP LOCKED
), claimed AS (
    UPDATE {c.queue} AS q
    SET status = 'claimed',
        lease_generation = q.lease_generation + 1,  -- the fence token
        attempt = q.attempt + 1,
        claimed_at = {NOW},
        lease_until = LEAST({NOW} + make_interval(secs => %(lease_seconds)s), q.expires_at),
        next_attempt_at = NULL,
        claimed_by = %(holder)s,
        renewals = 0{_claim_entry(c)}
    WHERE q.community_id = %(community_id)s AND q.id = ANY (ARRAY(SELECT candidate.id FROM candidate))
    RETURNING q.id, q.lease_generation, q.attempt, q.lease_until
)
SELECT k.id, k.lease_generation, k.attempt, k.lease_until, d.workflow_id, d.run_id, d.step_id, d.target_pubkey,
       d.definition_event_id, d.message_event_id, d.cause_kind, d.cause_event_id, d.cause_scheduled_for,
       d.cause_webhook_invocation_id, d.max_attempts, d.expires_at, d.priority, d.created_at
FROM claimed AS k JOIN {c.record} AS d ON d.community_id = %(community_id)s AND d.id = k.id
"""


def _settle_entry(c: Candidate, base: str) -> str:
    """``base`` (a jsonb of earlier entries) with the settle's entry appended (the product's
    50-entry bound), built with the product's IMMUTABLE history builder (Citus, SPEC 15)."""
    from buzz_delivery.services import sql

    entry = sql.history_object(
        {"event": "'settle'", "status": "%(status)s::varchar", "generation": "g.lease_generation",
         "actor": "g.claimed_by", "at": NOW, "renewals": "g.renewals"}
    )  # fmt: skip
    if c.lazy_claim_entry:
        # The claim's entry, from the queue row's columns ('at' is the claim's time, a column:
        # jsonb_build_object is STABLE, which Citus refuses in an UPDATE's SET list but not here,
        # an INSERT's SELECT list; a product build would check it in Citus mode).
        claim = sql.history_object(
            {"event": "'claim'", "status": "'claimed'", "generation": "g.lease_generation",
             "actor": "g.claimed_by", "at": "g.claimed_at", "attempt": "g.attempt"}
        )  # fmt: skip
        base = f"buzz_delivery_history_push({base}, {claim})"
    return f"buzz_delivery_history_push({base}, {entry})"


def settle_sql(c: Candidate) -> str:
    """Settle 50 leases of one community: the fenced DELETE of the queue rows is the guarantee
    (a lease that lapsed, was reaped, or belongs to another generation deletes nothing), and the
    terminal is written only for the rows it deleted, in the same statement. Rows returned =
    settled; a lease whose id is missing was lost."""
    gone = f"""
WITH gone AS (
    DELETE FROM {c.queue} AS q
    USING unnest(%(delivery_ids)s::uuid[], %(lease_generations)s::bigint[], %(target_pubkeys)s::bytea[])
        AS f(id, generation, target)
    WHERE q.community_id = %(community_id)s
      AND q.id = f.id
      AND q.target_pubkey = f.target
      AND q.lease_generation = f.generation     -- fenced by the generation of the caller's lease
      AND q.status = 'claimed'
      AND q.lease_until >= {NOW}                -- a lapsed lease settles nothing
      AND {ACTIVE.format(a="q")}  -- lifecycle in the statement
    RETURNING q.id, q.lease_generation, q.attempt, q.claimed_by, q.claimed_at, q.renewals, q.history
)"""
    if c.outcome:
        history = _settle_entry(c, "g.history") if c.history else "'[]'::jsonb"
        # Exactly once: the outcome's primary key is the delivery; the record is never updated.
        return f"""{gone}
INSERT INTO {c.outcome_table} AS o (delivery_id, community_id, status, finished_at, attempt, lease_generation,
                                   failure_code, failure_message, history)
SELECT g.id, %(community_id)s, %(status)s, {NOW}, g.attempt, g.lease_generation,
       %(failure_code)s, %(failure_message)s, {history}
FROM gone AS g
RETURNING o.delivery_id, o.status
"""
    history = f",\n    history = {_settle_entry(c, 'd.history || g.history')}" if c.history else ""
    # Exactly once: only a live record takes a terminal (and only for a queue row just deleted).
    return f"""{gone}
UPDATE {c.record} AS d
SET status = %(status)s,
    finished_at = {NOW},
    attempt = g.attempt,
    lease_generation = g.lease_generation,
    failure_code = %(failure_code)s,
    failure_message = %(failure_message)s{history}
FROM gone AS g
WHERE d.community_id = %(community_id)s AND d.id = g.id AND d.status = 'live'
RETURNING d.id, d.status
"""


CANDIDATES = {
    "A": Candidate("qd_a", hot=False, outcome=False),
    "B": Candidate("qd_b", hot=False, outcome=True),
    "C": Candidate("qd_c", hot=True, outcome=True, outcome_fk=False),
    "C_nohist": Candidate("qd_cn", hot=True, outcome=True, history=False, outcome_fk=False),
    "C_lazy": Candidate("qd_cl", hot=True, outcome=True, outcome_fk=False, lazy_claim_entry=True),
    "C_lazy_ff70": Candidate(
        "qd_c7", hot=True, outcome=True, outcome_fk=False, lazy_claim_entry=True, hot_fillfactor=70
    ),
    "C_lazy_nodelfence": Candidate(
        "qd_cd", hot=True, outcome=True, outcome_fk=False, lazy_claim_entry=True, delete_fence=False
    ),
    "A_hot": Candidate("qd_ah", hot=True, outcome=False),
}
LABELS = {
    "current": "current delivery table (services.cached claim -> settle)",
    "raw": "raw batch-50 floor (bench.baseline)",
    "A": "A: narrow queue + record updated once",
    "B": "B: narrow queue + append-only outcome",
    "C": "C: HOT-claim queue + append-only outcome (no outcome FK)",
    "C_nohist": "C without history entries",
    "C_lazy": "C, the claim's history entry written by the settle (from the row's columns)",
    "C_lazy_ff70": "C_lazy with the queue at fillfactor 70",
    "C_lazy_nodelfence": "C_lazy without the write fence's BEFORE DELETE trigger on the queue (comparison only)",
    "A_hot": "A's record update + C's HOT-claim queue",
    "peers_raw50": "raw batch-50 floor, peers harness",
    "pgqueuer_tuned": "PgQueuer tuned (batch 50, asyncpg), peers harness",
    "worker": "run_worker on the current table (issue 31's subject), peers harness",
}
OWN = ["current", "raw", *CANDIDATES]
PEERS = {"peers_raw50": "raw_batch50", "pgqueuer_tuned": "pgqueuer_tuned", "worker": "worker"}


# --- one drainer (a pool process) ----------------------------------------------------------------


def one(conn: psycopg.Connection, query: str, params: Any = None) -> tuple[Any, ...]:
    """The one row of ``query``."""
    row = conn.execute(query, params).fetchone()  # type: ignore[arg-type]
    if row is None:
        raise RuntimeError(f"no row: {query}")
    return row


def _backend_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def drainer(url: str, kind: str, claim: str, settle: str, community_id: uuid.UUID, target: bytes,
            start_at: float) -> tuple[int, int, float, int, float]:  # fmt: skip
    """Claim 50 -> settle 50 until a claim returns nothing; returns (settled, backend CPU ticks,
    end instant, pid, this process's CPU seconds over the drain). ``kind``: the settle's
    parameters (``raw`` | ``current`` | ``queue``)."""
    conn = psycopg.connect(url, autocommit=True)
    pid = conn.info.backend_pid
    claim_params = {"community_id": community_id, "target_pubkey": target, "limit": BATCH, "lease_seconds": 60.0,
                    "holder": f"spike-{os.getpid()}"}  # fmt: skip
    while time.monotonic() < start_at:
        time.sleep(0.001)
    before = _backend_ticks(pid)
    client = time.process_time()
    settled = 0
    while True:
        rows = conn.execute(claim, claim_params).fetchall()
        if not rows:
            break
        ids, gens = [r[0] for r in rows], [r[1] for r in rows]
        if kind == "raw":
            params: dict[str, Any] = {"ids": ids, "generations": gens, "community_id": community_id,
                                      "target_pubkey": target}  # fmt: skip
            cur = conn.execute(settle, params)
            settled += cur.rowcount
        else:
            params = {"community_id": community_id, "delivery_ids": ids, "lease_generations": gens,
                      "target_pubkeys": [target] * len(rows), "status": "finished", "failure_code": None,
                      "failure_message": None}  # fmt: skip
            settled += len(conn.execute(settle, params).fetchall())
    ended = time.monotonic()
    client = time.process_time() - client
    ticks = _backend_ticks(pid) - before
    conn.close()
    return settled, ticks, ended, os.getpid(), client


# --- the controller --------------------------------------------------------------------------------


class Spike:
    def __init__(self, url: str, pool: ProcessPoolExecutor) -> None:
        from bench import data, env
        from bench.baseline import CLAIM, FINISH_BATCH, TABLE
        from buzz_delivery.services import cached

        self.url, self.pool, self.data = url, pool, data
        self.conn = env.connect(url)
        self.raw_table = TABLE
        self.statements: dict[str, tuple[str, str, str]] = {
            "current": ("current", cached.CLAIM.call.replace("SELECT ", "SELECT d.id, d.lease_generation, ", 1),
                        cached.FINISH_MANY.call),
            "raw": ("raw", CLAIM, FINISH_BATCH),
        }  # fmt: skip
        for name, c in CANDIDATES.items():
            self.statements[name] = ("queue", claim_sql(c), settle_sql(c))
        self.tenant: Any = None
        self.loaded: Any = None  # called after each load (the WAL count's start)

    def create(self) -> None:
        for c in CANDIDATES.values():
            for statement in ddl(c):
                self.conn.execute(statement)
            for statement in copy_triggers(self.conn, c):
                self.conn.execute(statement)

    def tables(self, name: str) -> list[str]:
        if name == "current":
            return [self.data.OURS]
        if name == "raw":
            return [self.raw_table]
        return CANDIDATES[name].tables

    def load(self, name: str, n: int) -> None:
        data, conn, tenant = self.data, self.conn, self.tenant
        data.clear_deliveries(conn)
        if name in ("current", "raw"):
            data.load(conn, tenant, n, table=data.OURS if name == "current" else self.raw_table)
        else:
            c = CANDIDATES[name]
            conn.execute(f"TRUNCATE {', '.join(c.tables)}")
            with conn.transaction():
                conn.execute("SET LOCAL session_replication_role = replica")
                conn.execute(LOAD_RECORD.format(d=c.record), {
                    "base": time.time_ns() // 1000, "tag": uuid.uuid4().hex[:8], "community_id": tenant.community_id,
                    "workflow_id": tenant.workflow_id, "run_id": tenant.run_id, "target": data.target(0),
                    "definition_event_id": data.DEFINITION_EVENT_ID, "message_event_id": tenant.event_id,
                    "count": n})  # fmt: skip
                conn.execute(LOAD_QUEUE.format(q=c.queue, d=c.record))
        for table in [*self.tables(name), "buzz_delivery_community"]:
            conn.execute(f"VACUUM (ANALYZE) {table}")
        conn.execute("CHECKPOINT")
        if self.loaded:
            self.loaded()

    def check(self, name: str, n: int) -> None:
        """Every delivery settled exactly once, at generation 1."""
        if name in ("current", "raw"):
            table = self.data.OURS if name == "current" else self.raw_table
            done, once = one(
                self.conn,
                f"SELECT count(*) FILTER (WHERE status = 'finished'), count(*) FILTER (WHERE lease_generation = 1) "
                f"FROM {table}",
            )
        else:
            c = CANDIDATES[name]
            terminal = c.outcome_table if c.outcome else c.record
            done, once = one(
                self.conn,
                f"SELECT count(*) FILTER (WHERE status = 'finished'), count(*) FILTER (WHERE lease_generation = 1) "
                f"FROM {terminal}",
            )
            (left,) = one(self.conn, f"SELECT count(*) FROM {c.queue}")
            if left:
                raise RuntimeError(f"{name}: {left} queue rows left")
        if done != n or once != n:
            raise RuntimeError(f"{name}: {done} of {n} finished, {once} at generation 1")

    def hot(self, name: str) -> dict[str, tuple[int, int, int, int]]:
        rows = self.conn.execute(
            "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del FROM pg_stat_user_tables "
            "WHERE relname = ANY(%s)",
            [self.tables(name)],
        ).fetchall()
        return {r[0]: (r[1], r[2], r[3], r[4]) for r in rows}

    def drain(self, name: str, k: int, n: int) -> dict[str, float]:
        kind, claim, settle = self.statements[name]
        self.load(name, n)
        stats_before = self.hot(name)
        start_at = time.monotonic() + START_DELAY
        futures = [
            self.pool.submit(
                drainer, self.url, kind, claim, settle, self.tenant.community_id, self.data.target(0), start_at
            )
            for _ in range(k)
        ]
        results = [f.result() for f in futures]
        if len({r[3] for r in results}) != k:
            raise RuntimeError(f"{name}: the drainers did not run in {k} processes")
        settled = sum(r[0] for r in results)
        if settled != n:
            raise RuntimeError(f"{name}: settled {settled} of {n}")
        wall = max(r[2] for r in results) - start_at
        time.sleep(0.6)  # the drainers' statistics are flushed
        self.check(name, n)
        after = self.hot(name)
        upd = sum(after[t][1] - stats_before.get(t, (0, 0, 0, 0))[1] for t in after)
        hot = sum(after[t][2] - stats_before.get(t, (0, 0, 0, 0))[2] for t in after)
        return {"rate": n / wall, "server_us": sum(r[1] for r in results) / CLK_TCK / n * 1e6,
                "client_us": sum(r[4] for r in results) / n * 1e6,
                "hot_share": hot / upd if upd else float("nan")}  # fmt: skip


# --- index inserts per delivery, from the WAL --------------------------------------------------------


_BLOCK = re.compile(r"rel \d+/(\d+)/(\d+)")


def wal_counts(conn: psycopg.Connection, start: str, end: str, tables: list[str]) -> dict[str, int]:
    """Btree leaf inserts per index of ``tables`` and heap records per kind, between two LSNs."""
    (db_oid,) = one(conn, "SELECT oid FROM pg_database WHERE datname = current_database()")
    names: dict[str, str] = dict(
        conn.execute(
            "SELECT pg_relation_filenode(i.indexrelid)::text, i.indexrelid::regclass::text FROM pg_index i "
            "WHERE i.indrelid = ANY(%s::regclass[]) UNION ALL "
            "SELECT pg_relation_filenode(t)::text, t::text FROM unnest(%s::regclass[]) AS t",
            [tables, tables],
        ).fetchall()
    )
    counts: dict[str, int] = {}
    rows = conn.execute(
        "SELECT resource_manager, record_type, block_ref FROM pg_get_wal_records_info(%s::pg_lsn, %s::pg_lsn) "
        "WHERE (resource_manager = 'Btree' AND record_type IN ('INSERT_LEAF', 'INSERT_POST')) "
        "   OR resource_manager IN ('Heap', 'Heap2')",
        [start, end],
    )
    for rmgr, record, block_ref in rows:
        match = _BLOCK.search(block_ref or "")
        if not match or int(match.group(1)) != db_oid or match.group(2) not in names:
            continue
        key = f"{names[match.group(2)]} {record}" if rmgr != "Btree" else f"{names[match.group(2)]}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def index_inserts(spike: Spike, name: str, runner: Any) -> tuple[float, dict[str, int]]:
    """One K=1 drain of WAL_DELIVERIES; btree leaf inserts per delivery over the variant's indexes."""
    conn = spike.conn
    if name == "pgqueuer_tuned":
        pgq = "SELECT relname FROM pg_class WHERE relkind = 'r' AND relname LIKE 'pgqueuer%'"
        tables = [r[0] for r in conn.execute(pgq)]
    else:
        tables = spike.tables({"peers_raw50": "raw", "worker": "current"}.get(name, name))
    marks: list[str] = []
    runner(name, 1, WAL_DELIVERIES, lambda: marks.append(one(conn, "SELECT pg_current_wal_insert_lsn()::text")[0]))
    start = marks[0]
    (end,) = one(conn, "SELECT pg_current_wal_flush_lsn()::text")  # walinspect reads flushed WAL
    counts = wal_counts(conn, start, end, tables)
    index_names = set(
        r[0]
        for r in conn.execute(
            "SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = ANY(%s::regclass[])", [tables]
        )
    )
    inserts = sum(v for key, v in counts.items() if key in index_names)
    return inserts / WAL_DELIVERIES, counts


def _marked_queues() -> Any:
    from bench.scenarios.peers import Queues

    class MarkedQueues(Queues):
        """The peers scenario's queues, calling ``loaded`` after each load."""

        loaded: Any = None

        def load(self, system: str, n: int) -> None:
            super().load(system, n)
            if self.loaded:
                self.loaded()

    return MarkedQueues


# --- main -----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.queue_design", description=__doc__.splitlines()[0])
    parser.add_argument("--deliveries", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help=f"comma-separated of {', '.join([*OWN, *PEERS])}")
    parser.add_argument("--no-wal", action="store_true", help="skip the index-insert count from the WAL")
    parser.add_argument(
        "--async-commit",
        action="store_true",
        help="synchronous_commit = off for every session of the bench database, PgQueuer's too "
        "(ALTER DATABASE, set back to on by a run without it): the rates then measure CPU, not the shared disk's fsync",
    )
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or [*OWN, "peers_raw50", "pgqueuer_tuned"]
    unknown = set(names) - set(OWN) - set(PEERS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}")

    from bench import baseline, env

    url = env.database_url()
    if not url.rsplit("/", 1)[1].startswith("bench_f"):
        raise SystemExit("BENCH_DATABASE_URL must name a bench_f... database")
    env.ensure_database(url)
    env.setup_django(url)
    env.migrate()
    with env.connect(url) as conn:
        conn.execute(
            f"ALTER DATABASE {url.rsplit('/', 1)[1]} SET synchronous_commit = {'off' if args.async_commit else 'on'}"
        )
    from bench.peers import PeerPool
    from bench.scenarios import peers as peers_scenario

    with ProcessPoolExecutor(max_workers=max(KS), mp_context=mp.get_context("spawn")) as pool:
        spike = Spike(url, pool)
        baseline.create_table(spike.conn)
        bench = SimpleNamespace(url=url, conn=spike.conn)
        queues = _marked_queues()(bench)  # type: ignore[arg-type]
        queues.prepare(["pgqueuer_tuned", "raw_batch50", "worker"])
        spike.tenant = queues.tenant
        spike.create()
        spike.conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        peer_pool = PeerPool(url, max(KS)) if any(n in PEERS for n in names) else None
        if peer_pool:
            peer_pool.__enter__()
        # warm the drainer processes (imports) outside any timing
        list(pool.map(_warm, range(max(KS))))

        def run(name: str, k: int, n: int, loaded: Any = None) -> dict[str, float]:
            """One drain; ``loaded`` is called once the queue is loaded (the WAL count's start)."""
            spike.loaded = queues.loaded = loaded
            if name in PEERS:
                assert peer_pool is not None
                m = peers_scenario.drain_once(bench, queues, peer_pool, PEERS[name], k, n)  # type: ignore[arg-type]
                return {"rate": m["rate"], "server_us": m["server_us"], "client_us": m["client_us"],
                        "hot_share": float("nan")}  # fmt: skip
            return spike.drain(name, k, n)

        results: dict[tuple[str, int], list[dict[str, float]]] = {(n, k): [] for n in names for k in KS}
        loads: list[float] = []
        try:
            for round_ in range(args.rounds):
                shift = round_ % len(names)
                order = names[shift:] + names[:shift]
                for k in KS if round_ % 2 == 0 else tuple(reversed(KS)):
                    for name in order:
                        load = float(Path("/proc/loadavg").read_text().split()[0])
                        loads.append(load)
                        m = run(name, k, args.deliveries)
                        results[(name, k)].append(m)
                        print(f"round {round_ + 1} K={k} {name}: {m['rate']:,.0f}/s server {m['server_us']:.1f} "
                              f"µs/delivery client {m['client_us']:.1f} µs HOT {m['hot_share']:.2f} "
                              f"(load {load:.2f})", flush=True)  # fmt: skip
            inserts: dict[str, float] = {}
            if not args.no_wal:
                for name in names:
                    per, counts = index_inserts(spike, name, run)
                    inserts[name] = per
                    detail = ", ".join(f"{key} {value / WAL_DELIVERIES:.2f}" for key, value in sorted(counts.items()))
                    print(f"WAL {name}: {per:.2f} index inserts/delivery; per delivery: {detail}", flush=True)
        finally:
            if peer_pool:
                peer_pool.__exit__(None, None, None)
            spike.conn.close()

    def med(name: str, k: int, key: str) -> float:
        values = [m[key] for m in results[(name, k)] if m[key] == m[key]]
        return statistics.median(values) if values else float("nan")

    ref = "pgqueuer_tuned" if "pgqueuer_tuned" in names else None
    print(f"\nload average (1 min) during the rounds: {min(loads):.2f}-{max(loads):.2f}; "
          f"median of {args.rounds} rounds, {args.deliveries:,} deliveries per drain\n")  # fmt: skip
    print("| variant | K=1 /s (min-max) | K=4 /s (min-max) | vs PgQueuer tuned K=1 / K=4 | "
          "server µs/delivery K=1 / K=4 | client µs/delivery K=1 / K=4 | index inserts/delivery | "
          "HOT share of updates |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        cells = []
        for k in KS:
            rates = [m["rate"] for m in results[(name, k)]]
            cells.append(f"{med(name, k, 'rate'):,.0f} ({min(rates):,.0f}-{max(rates):,.0f})")
        ratio = " / ".join(f"{med(name, k, 'rate') / med(ref, k, 'rate'):.2f}x" for k in KS) if ref else "-"
        server = " / ".join(f"{med(name, k, 'server_us'):.0f}" for k in KS)
        client = " / ".join(f"{med(name, k, 'client_us'):.0f}" for k in KS)
        hot = med(name, 1, "hot_share")
        print(f"| {LABELS[name]} | {cells[0]} | {cells[1]} | {ratio} | {server} | {client} | "
              f"{inserts.get(name, float('nan')):.2f} | {'-' if hot != hot else f'{hot:.2f}'} |")  # fmt: skip
    return 0


def _warm(_: int) -> int:
    time.sleep(0.2)
    return os.getpid()


if __name__ == "__main__":
    raise SystemExit(main())
