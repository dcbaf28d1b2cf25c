"""Where the server's CPU of a delivery goes (issue 31): the plan-cached claim 50 -> batch settle 50
of ``services.cached``, one backend, on copies of the bench database that each lack one piece of
the delivery table (a trigger, an index, the CHECKs, the settle's run-lock prelude), against the
full schema, alternating, in one run:

    python -m bench.server_ladder [--deliveries 20000] [--rounds 3] [--only full,fan_in,...]

Every variant is a ``CREATE DATABASE ... TEMPLATE`` copy of the migrated bench database with its
DDL applied (a copy, never the bench database itself; dropped at the end). Each round loads
``--deliveries`` pending rows of one target, ``VACUUM ANALYZE``, and drains them from one
connection with ``synchronous_commit = off`` (the WAL flush is not the backend's CPU); the
backend's user + system CPU is read from ``/proc`` around each statement, so the claim's and the
settle's shares are printed apart. Variants run in a rotating order per round. The deliveries are
the peers bench's (one workflow, one run, one message event, not of an engine run): the numbers
are what the inbox's worker pays, not what an engine step's deliveries pay.

A removed piece is not a proposal: most are guarantees or read paths (SPEC 3, 5, 8, 15); the
ladder says what each costs, so that the gap to a peer can be judged piece by piece.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg

from bench import baseline, data, env
from bench.scenarios.overhead import _backend_cpu

BATCH = 50
D = data.OURS
TALLY = "buzz_delivery_settle_tally"
TALLY_TRIGGER = "buzz_delivery_settle_tally"
_TALLY_FUNCTION = (
    "CREATE OR REPLACE FUNCTION buzz_delivery_tally_settles() RETURNS trigger LANGUAGE plpgsql AS $$"
    " DECLARE settled record; BEGIN {body} RETURN NULL; END $$"
)
_TALLY_NO_JOIN = (
    "FOR settled IN SELECT n.community_id, n.status, count(*)::integer AS moved FROM buzz_delivery_settled_new AS n"
    " WHERE n.status IN ('finished', 'failed', 'expired') GROUP BY n.community_id, n.status LOOP"
    f" INSERT INTO {TALLY} (community_id, at, status, n)"
    " VALUES (settled.community_id, buzz_delivery_now(), settled.status, settled.moved); END LOOP;"
)


def _checks(conn: psycopg.Connection) -> list[str]:
    rows = conn.execute(
        "SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'c'", [D]
    ).fetchall()
    return [f'ALTER TABLE {D} DROP CONSTRAINT "{name}"' for (name,) in rows]


def _triggers(conn: psycopg.Connection, like: str) -> list[str]:
    rows = conn.execute(
        "SELECT tgname FROM pg_trigger WHERE tgrelid = %s::regclass AND NOT tgisinternal AND tgname LIKE %s",
        [D, like],
    ).fetchall()
    return [f'DROP TRIGGER "{name}" ON {D}' for (name,) in rows]


def _no_prelude(conn: psycopg.Connection) -> list[str]:
    """``buzz_delivery_finish_leases`` without its run-lock prelude (the count of the batch's runs)."""
    body = conn.execute("SELECT pg_get_functiondef('buzz_delivery_finish_leases'::regproc)").fetchone()[0]
    start = body.index("    IF (SELECT count(DISTINCT")
    end = body.index("END IF;", start) + len("END IF;")
    return [body[:start] + body[end:]]


OUTCOME = "buzz_delivery_delivery_outcome"
_GONE_RETURNING = "RETURNING d.id, d.lease_generation, d.attempt, d.max_attempts, d.claimed_by, d.renewals, d.history"
_RECORD_UPDATE = f"UPDATE {D} AS r\n"
_HISTORY_SET = "    history = "


def _outcome(conn: psycopg.Connection, *, lean: bool = False) -> list[str]:
    """Stage 3's terminal (bench/results/queue-design-plan.md): an immutable outcome row inserted
    instead of the record's terminal UPDATE, on this copy only. ``buzz_delivery_finish_leases`` is
    re-created from its installed body with its terminal statement swapped: the prelude, the
    queue DELETE and its fence are the installed text, the outcome's history is the record's
    UPDATE expression (the queue's history and the settle's entry). The outcome keeps the record's
    CHECKs that a terminal can break and its write-fence trigger (whose WHEN is already false: the
    queue's DELETE passed the fence in this transaction); no FK to the record (the plan's), no
    fan-in or delivery-lost trigger (the bench's deliveries are not an engine's: the record's fire
    only their WHEN). ``lean``: a status row (no history copy, holder, renewals or created_at)
    with only its key."""
    body = conn.execute("SELECT pg_get_functiondef('buzz_delivery_finish_leases'::regproc)").fetchone()[0]
    update = body.index(_RECORD_UPDATE)
    history_at = body.index(_HISTORY_SET, update) + len(_HISTORY_SET)
    history = body[history_at : body.index("\nFROM gone AS d", history_at)]
    end = body.index("RETURNING r.id, r.status;", update) + len("RETURNING r.id, r.status;")
    # (column, its value from the queue row ``d`` and the call's parameters)
    kept = [
        ("delivery_id uuid NOT NULL", "d.id"),
        ("community_id uuid NOT NULL", "p_community_id"),
        ("status varchar(16) NOT NULL", "p_status"),
        ("finished_at timestamptz NOT NULL", "buzz_delivery_now()"),
        ("attempt integer NOT NULL", "d.attempt"),
        ("lease_generation bigint NOT NULL", "d.lease_generation"),
        ("failure_code varchar(64)", "p_failure_code"),
        ("failure_message text", "p_failure_message"),
    ]
    checks = [
        "status IN ('finished', 'failed', 'expired')",
        "failure_code IS NULL OR status IN ('failed', 'expired')",
        "attempt >= 0",
        "lease_generation >= 0",
    ]
    indexes = []
    if not lean:
        kept += [
            ("claimed_by text", "d.claimed_by"),
            ("renewals integer NOT NULL", "d.renewals"),
            ("history jsonb NOT NULL", history),
            ("created_at timestamptz NOT NULL", "d.created_at"),
        ]
        checks += [
            "renewals >= 0",
            "claimed_by IS NULL OR length(claimed_by) <= 200",
            "jsonb_typeof(history) = 'array' AND jsonb_array_length(history) <= 50",
        ]
        indexes = [
            f"CREATE INDEX outcome_finished_idx ON {OUTCOME} (community_id, finished_at)",
            f"CREATE INDEX outcome_created_idx ON {OUTCOME} (created_at, delivery_id)",
            f"CREATE INDEX outcome_failure_code_idx ON {OUTCOME} (failure_code, created_at) "
            "WHERE failure_code IS NOT NULL",
        ]
    names = ", ".join(column.split()[0] for column, _ in kept)
    values = ", ".join(value for _, value in kept)
    insert = (
        f"INSERT INTO {OUTCOME} AS o ({names})\nSELECT {values}\nFROM gone AS d\nRETURNING o.delivery_id, o.status;"
    )
    body = body[:update] + insert + body[end:]
    if _GONE_RETURNING not in body:
        raise ValueError("buzz_delivery_finish_leases: its queue DELETE's RETURNING changed")
    body = body.replace(_GONE_RETURNING, _GONE_RETURNING + ", d.created_at", 1)
    definition = [column for column, _ in kept] + ["PRIMARY KEY (delivery_id, community_id)"]
    definition += [f"CHECK ({check})" for check in checks]
    table = [
        f"CREATE TABLE {OUTCOME} ({', '.join(definition)})",
        f"CREATE TRIGGER outcome_write_fence BEFORE INSERT OR UPDATE ON {OUTCOME} FOR EACH ROW "
        "WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM NEW.community_id::text) "
        "EXECUTE FUNCTION buzz_delivery_write_fence_row()",
        *indexes,
    ]
    return [*table, body]


# name -> (what it is, DDL maker). "full" first: every other is compared with it.
VARIANTS = {
    "full": ("the full schema", lambda c: []),
    "fan_in": (
        "- the engine's fan-in AFTER trigger (buzz_workflows_delivery_fan_in)",
        lambda c: [f"DROP TRIGGER buzz_workflows_delivery_fan_in ON {D}"],
    ),
    "prelude": ("- the settle's run-lock prelude (count of distinct runs)", _no_prelude),
    "history_guard": ("- the history append-only trigger's WHEN", lambda c: _triggers(c, "%history_append_only%")),
    "history_push": (
        "history push as a plain append (no 50-entry bound)",
        lambda c: [
            "CREATE OR REPLACE FUNCTION buzz_delivery_history_push(history jsonb, entry jsonb) RETURNS jsonb "
            "LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT history || entry $$"
        ],
    ),
    "row_triggers": (
        "- every BEFORE ROW trigger (write fence, generation, history, binding)",
        lambda c: _triggers(c, "pgtrigger_%"),
    ),
    "checks": ("- the 22 CHECK constraints", _checks),
    "created_idx": ("- delivery_created_idx (the admin's age list)", lambda c: ["DROP INDEX delivery_created_idx"]),
    "message_idx": (
        "- delivery_message_event_idx (message event FK)",
        lambda c: ["DROP INDEX delivery_message_event_idx"],
    ),
    "message_created_idx": (
        "- delivery_message_event_idx and delivery_created_idx",
        lambda c: ["DROP INDEX delivery_message_event_idx", "DROP INDEX delivery_created_idx"],
    ),
    # Core 0035's schema: a key to the workflow and one to the run, delivery_workflow_idx for the
    # first one's cascade (what core 0036 merged into one key and dropped, bench/results/index-diet.md).
    "before_0036": (
        "+ core 0035's two keys and delivery_workflow_idx",
        lambda c: [
            f"CREATE INDEX delivery_workflow_idx ON {D} (community_id, workflow_id)",
            f"ALTER TABLE {D} ADD CONSTRAINT delivery_workflow_same_community FOREIGN KEY (community_id, workflow_id)"
            " REFERENCES buzz_delivery_workflow (community_id, id) ON DELETE CASCADE",
            f"ALTER TABLE {D} ADD CONSTRAINT delivery_run_same_community FOREIGN KEY (community_id, run_id)"
            " REFERENCES buzz_delivery_workflow_run (community_id, id) ON DELETE CASCADE",
            f"ALTER TABLE {D} DROP CONSTRAINT delivery_run_workflow_same_community",
            "CREATE INDEX workflow_run_workflow_idx ON buzz_delivery_workflow_run (community_id, workflow_id)",
            "ALTER TABLE buzz_delivery_workflow_run DROP CONSTRAINT workflow_run_workflow_run_key",
        ],
    ),
    "identity_key": (
        "- delivery_identity_key (exactly-once identity)",
        lambda c: [f"ALTER TABLE {D} DROP CONSTRAINT delivery_identity_key"],
    ),
    # (lease_idx, delivery_claimed_lease_idx, is gone since core 0037: the queue has no lease index.)
    # Core 0039 made the record's terminal UPDATE HOT (bench/results/hot-record.md): no index names
    # what it writes, the record at fillfactor 30, the settle tally's statement trigger counting the
    # settles the terminal-age index served. "before_hot" puts core 0038's record back: the index,
    # fillfactor 100, no tally.
    "before_hot": (
        "+ delivery_terminal_age_idx, fillfactor 100, no settle tally (core 0038's non-HOT terminal)",
        lambda c: [
            f"CREATE INDEX delivery_terminal_age_idx ON {D} (community_id, finished_at) "
            "WHERE status IN ('finished', 'failed', 'expired')",
            f"ALTER TABLE {D} SET (fillfactor = 100)",
            f"DROP TRIGGER {TALLY_TRIGGER} ON {D}",
        ],
    ),
    "no_tally": (
        "- the settle tally's statement trigger (its cost)",
        lambda c: [f"DROP TRIGGER {TALLY_TRIGGER} ON {D}"],
    ),
    # The tally's pieces: the trigger's transition tables alone (a function that returns at once),
    # and the count without the join of the two (the new rows' terminal statuses alone).
    "tally_capture": (
        "the settle tally's trigger capturing its transition tables, writing nothing",
        lambda c: [_TALLY_FUNCTION.format(body="")],
    ),
    "tally_capture_new": (
        "the trigger capturing its NEW TABLE only, writing nothing",
        lambda c: [
            _TALLY_FUNCTION.format(body=""),
            f"DROP TRIGGER {TALLY_TRIGGER} ON {D}",
            f"CREATE TRIGGER {TALLY_TRIGGER} AFTER UPDATE ON {D} REFERENCING NEW TABLE AS buzz_delivery_settled_new"
            " FOR EACH STATEMENT EXECUTE FUNCTION buzz_delivery_tally_settles()",
        ],
    ),
    "tally_plain": (
        "the trigger without transition tables, writing nothing",
        lambda c: [
            _TALLY_FUNCTION.format(body=""),
            f"DROP TRIGGER {TALLY_TRIGGER} ON {D}",
            f"CREATE TRIGGER {TALLY_TRIGGER} AFTER UPDATE ON {D}"
            " FOR EACH STATEMENT EXECUTE FUNCTION buzz_delivery_tally_settles()",
        ],
    ),
    "tally_no_join": (
        "the settle tally counting the new rows alone (no join with the old ones)",
        lambda c: [_TALLY_FUNCTION.format(body=_TALLY_NO_JOIN)],
    ),
    # A terminal writes the record's second version, about twice the first (its history, 300-odd
    # bytes, and the end's columns): on its own page only at fillfactor 30 for every row (50: about half).
    "hot_record_50": (
        "the record at fillfactor 50 (its terminal update HOT when it fits)",
        lambda c: [f"ALTER TABLE {D} SET (fillfactor = 50)"],
    ),
    # Stage 3 (queue-design-plan.md): the terminal inserts an outcome row, the record is written
    # once (it stays 'pending' here: the real stage drops its terminal columns).
    "outcome": (
        "terminal as an outcome row (INSERT; PK + 3 indexes, history copied), no record UPDATE",
        _outcome,
    ),
    "outcome_lean": (
        "terminal as a lean outcome row (status, time, attempt, generation, failure; PK only)",
        lambda c: _outcome(c, lean=True),
    ),
}


def _url(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


def _drain(url: str, tenant: data.Tenant, deliveries: int) -> tuple[float, float]:
    """Server CPU µs per delivery of the claims and of the settles, one drain."""
    from buzz_delivery.services import cached

    control = env.connect(url)
    outcome = control.execute("SELECT to_regclass(%s) IS NOT NULL", [OUTCOME]).fetchone()[0]
    control.execute(f"TRUNCATE {D}, {TALLY}{f', {OUTCOME}' if outcome else ''} CASCADE")
    data.load(control, tenant, deliveries)
    control.execute(f"VACUUM (ANALYZE) {D}, {data.QUEUE}{f', {OUTCOME}' if outcome else ''}")
    updates_before = _record_updates(control)
    control.close()
    target = data.target(0)
    claim = {"community_id": tenant.community_id, "target_pubkey": target, "limit": BATCH, "lease_seconds": 60.0,
             "holder": "ladder"}  # fmt: skip
    claim_sql = cached.CLAIM.call.replace("SELECT ", "SELECT d.id, d.lease_generation, ", 1)
    with psycopg.connect(url, autocommit=True, options="-c synchronous_commit=off") as conn:
        pid = conn.info.backend_pid
        claimed = settled = 0.0
        done = 0
        while True:
            before = _backend_cpu(pid)
            rows = conn.execute(claim_sql, claim).fetchall()
            middle = _backend_cpu(pid)
            claimed += middle - before  # type: ignore[operator]
            if not rows:
                break
            conn.execute(
                cached.FINISH_MANY.call,
                {"community_id": tenant.community_id, "delivery_ids": [r[0] for r in rows],
                 "lease_generations": [r[1] for r in rows], "target_pubkeys": [target] * len(rows),
                 "status": "finished", "failure_code": None, "failure_message": None},
            ).fetchall()  # fmt: skip
            settled += _backend_cpu(pid) - middle  # type: ignore[operator]
            done += len(rows)
        conn.execute("SELECT pg_stat_force_next_flush()")
    if done != deliveries:
        raise SystemExit(f"drained {done} of {deliveries}")
    with env.connect(url) as control:
        updates, hot = (after - before for after, before in zip(_record_updates(control), updates_before, strict=True))
        if outcome:  # the drain's end: every delivery one outcome row, no queue row
            counts = control.execute(
                f"SELECT (SELECT count(*) FROM {data.QUEUE}), (SELECT count(*) FROM {OUTCOME}), "
                f"(SELECT count(*) FROM {D} r WHERE NOT EXISTS (SELECT 1 FROM {OUTCOME} o "
                " WHERE o.community_id = r.community_id AND o.delivery_id = r.id AND o.status = 'finished'))"
            ).fetchone()
            if counts != (0, deliveries, 0):
                raise SystemExit(f"outcome drain: queue rows, outcome rows, records without one: {counts}")
        sizes = ", ".join(f"{table.removeprefix('buzz_delivery_delivery_')} {heap // 1024} + {index // 1024} kB"
                          for table, heap, index in _sizes(control))  # fmt: skip
    print(f"  the record's updates: {updates}, HOT {hot}; heap + indexes: {sizes}", flush=True)
    return claimed / done * 1e6, settled / done * 1e6


def _sizes(conn: psycopg.Connection) -> list[tuple[str, int, int]]:
    """The record's, the queue's and the outcome's heap and index bytes (no vacuum since the load)."""
    sizes = []
    for table in (D, data.QUEUE, OUTCOME):
        if conn.execute("SELECT to_regclass(%s) IS NOT NULL", [table]).fetchone()[0]:
            row = conn.execute("SELECT pg_relation_size(%s::regclass), pg_indexes_size(%s::regclass)", [table, table])
            heap, index = row.fetchone()
            sizes.append((table, heap, index))
    return sizes


def _record_updates(conn: psycopg.Connection) -> tuple[int, int]:
    """The record's updates and HOT updates so far (the statistics as last flushed)."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = %s::regclass", [D]
    ).fetchone()
    return (row[0], row[1]) if row else (0, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.server_ladder", description=__doc__.splitlines()[0])
    parser.add_argument("--deliveries", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated variants (full is always run)")
    args = parser.parse_args(argv)
    names = ["full", *[n for n in args.only.split(",") if n and n != "full"]] if args.only else list(VARIANTS)
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    url = env.database_url()
    env.ensure_database(url)
    env.setup_django(url)
    env.migrate()
    base = urlsplit(url).path.lstrip("/")
    control = env.connect(url)
    baseline.create_table(control)
    data.reset(control)
    (tenant,) = data.create_tenants(1)
    from django.db import connections

    connections.close_all()  # a template must have no other session
    control.close()
    admin = env.connect(_url(url, "postgres"))
    copies = {}
    try:
        for name in names:
            copy = f"{base}_ladder_{name}"
            admin.execute(f'DROP DATABASE IF EXISTS "{copy}"')
            admin.execute(f'CREATE DATABASE "{copy}" TEMPLATE "{base}"')
            copies[name] = _url(url, copy)
            with env.connect(copies[name]) as conn:
                for statement in VARIANTS[name][1](conn):
                    conn.execute(statement)
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                load = Path("/proc/loadavg").read_text().split()[0]
                started = time.monotonic()
                results[name].append(_drain(copies[name], tenant, args.deliveries))
                claim, settle = results[name][-1]
                print(f"round {round_ + 1} {name}: claim {claim:.1f} + settle {settle:.1f} = {claim + settle:.1f} "
                      f"µs/delivery (load {load}, {time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip
    finally:
        for name in copies:
            admin.execute(f'DROP DATABASE IF EXISTS "{base}_ladder_{name}"')
        admin.close()
    full = statistics.median(c + s for c, s in results["full"])
    print("\n| variant | claim µs | settle µs | server µs per delivery | vs full |\n|---|---|---|---|---|")
    for name in names:
        claim = statistics.median(c for c, _ in results[name])
        settle = statistics.median(s for _, s in results[name])
        total = statistics.median(c + s for c, s in results[name])
        print(f"| {VARIANTS[name][0]} | {claim:.1f} | {settle:.1f} | {total:.1f} | "
              f"{'' if name == 'full' else f'{total - full:+.1f}'} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
