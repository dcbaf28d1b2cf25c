"""What the worker's gap to PgQueuer tuned is made of (issue 31): the ``peers`` scenario (our
``run_worker``, PgQueuer tuned, the raw batch-50 floor, each drain interleaved) run on copies of
the bench database that each lack more of the delivery table's work than the one before:

    python -m bench.worker_ladder [--repeats 3] [--steps full,after_triggers,...] [--peer-jobs 48000]
        [--synchronous-commit off]

Each step is a ``CREATE DATABASE ... TEMPLATE`` copy of the migrated bench database with its own
DDL and every earlier step's applied (a copy, never the bench database itself; dropped at the
end), drained by ``python -m bench.run --only peers`` in a child process on that copy, so every
figure of a step stands next to PgQueuer's and the floor's of the same minutes (PgQueuer's and the
floor's tables are not touched by any step). :mod:`bench.server_ladder` measures the same pieces
one at a time at the statement level; this one asks the question of the issue: with how much of
the table's work taken away would the worker reach 1.2x PgQueuer tuned?

A removed piece is not a proposal: the labels say which are guarantees (SPEC 3, 5, 8) and which
are the read paths of the reaper, pruner, admin, flow limits and foreign keys. After each run the
step's DDL is checked to still hold (a ``migrate`` must not have put a piece back).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg

from bench import baseline, data, env

D = data.OURS
TABLES = (D, data.QUEUE)  # the record and the live queue (issue 31, stage 2)
SYSTEMS = ("raw_batch50", "worker", "pgqueuer_tuned")
KS = (1, 4)
LINE = re.compile(r"^peers: (\S+) K=(\d+) n=\d+: ([\d,]+)/s server ([\d,]+) µs client ([\d,]+) µs")
# The lifecycle test, per row (``d.community_id``) or once a statement (``p_community_id``, core 0041).
LIFECYCLE = re.compile(
    r"EXISTS \(SELECT 1 FROM buzz_delivery_community c WHERE c\.id = (?:d\.|p_)community_id"
    r" AND c\.deletion_state = 'active'\)"
)
PRELUDE = re.compile(r"\n    IF \(SELECT count\(DISTINCT.*?END IF;", re.S)


def _triggers(conn: psycopg.Connection, *likes: str) -> list[str]:
    """Drop the triggers named like ``likes`` of the record and of its live queue (issue 31,
    stage 2: claims and renewals write the queue, terminals both)."""
    rows = conn.execute(
        "SELECT tgrelid::regclass::text, tgname FROM pg_trigger"
        " WHERE tgrelid = ANY (%s::regclass[]) AND NOT tgisinternal AND tgname LIKE ANY (%s)",
        [list(TABLES), list(likes)],
    ).fetchall()
    return [f'DROP TRIGGER "{name}" ON {table}' for table, name in rows]


def _checks(conn: psycopg.Connection) -> list[str]:
    rows = conn.execute(
        "SELECT conrelid::regclass::text, conname FROM pg_constraint"
        " WHERE conrelid = ANY (%s::regclass[]) AND contype = 'c'",
        [list(TABLES)],
    ).fetchall()
    return [f'ALTER TABLE {table} DROP CONSTRAINT "{name}"' for table, name in rows]


def _rewritten(conn: psycopg.Connection, change) -> list[str]:  # type: ignore[no-untyped-def]
    """Every ``buzz_delivery_*`` function whose definition ``change`` alters, redefined."""
    rows = conn.execute(
        "SELECT pg_get_functiondef(p.oid) FROM pg_proc p WHERE p.proname LIKE 'buzz\\_delivery\\_%' AND p.prokind = 'f'"
    ).fetchall()
    return [new for (old,) in rows if (new := change(old)) != old]


def _no_lifecycle_or_prelude(conn: psycopg.Connection) -> list[str]:
    return _rewritten(conn, lambda body: PRELUDE.sub("", LIFECYCLE.sub("true", body)))


# Core 0037 (issue 31, stage 2) moved the live partial indexes (claimed lease: gone; pending age:
# the queue's created index; expiry, singleton and slot keys) from the record to the queue; core
# 0039 dropped the pruner's terminal-age index (the record's terminal UPDATE is HOT).
PARTIAL_INDEXES = (
    "delivery_failure_code_idx",
    "delivery_queue_expiry_idx",
    "delivery_queue_singleton_key",
    "delivery_queue_slot_community_key",
    "delivery_queue_slot_target_key",
    "delivery_queue_slot_workflow_key",
)

# name -> (what it takes away, DDL maker, a query that is true while the step holds). Each step
# keeps every earlier one's removals (earlier in ``--steps``, by default this order: the
# guarantees first, then the read paths and the sibling apps' triggers).
STEPS = {
    "full": ("the full schema", lambda c: [], "SELECT true"),
    "lifecycle": (
        "- the lifecycle test in claim and settle and the settle's run-lock prelude (guarantees)",
        _no_lifecycle_or_prelude,
        "SELECT NOT EXISTS (SELECT 1 FROM pg_proc WHERE proname LIKE 'buzz\\_delivery\\_claim\\_%' AND prosrc LIKE "
        "'%c.deletion_state = ''active''%')",
    ),
    "history": (
        "- the history entries of claim and settle (guarantee: the push returns the history unchanged)",
        lambda c: [
            "CREATE OR REPLACE FUNCTION buzz_delivery_history_push(history jsonb, entry jsonb) RETURNS jsonb "
            "LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT history $$"
        ],
        "SELECT prosrc LIKE '%SELECT history %' FROM pg_proc WHERE proname = 'buzz_delivery_history_push'",
    ),
    "write_fence": (
        "- the write fence's triggers (guarantee: SPEC 5)",
        lambda c: _triggers(c, "pgtrigger\\_community\\_write\\_fence%"),
        f"SELECT NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = '{D}'::regclass"
        " AND tgname LIKE '%write\\_fence%')",
    ),
    "invariants": (
        "- the generation, binding and history-guard triggers and the 22 CHECKs"
        " (guarantees: invariants in the database)",
        lambda c: _triggers(c, "pgtrigger\\_delivery\\_%") + _checks(c),
        f"SELECT NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = '{D}'::regclass AND contype = 'c')",
    ),
    "after_triggers": (
        "- the engine's fan-in, the agents' lost-delivery and the settle tally's AFTER triggers"
        " (sibling apps' features, the settle-rate metric's source: core 0039)",
        lambda c: _triggers(
            c, "buzz_workflows_delivery_fan_in", "buzz_agents_delivery_lost", "buzz_delivery_settle_tally"
        ),
        f"SELECT NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = '{D}'::regclass AND tgname LIKE 'buzz\\_%')",
    ),
    "fk_admin_indexes": (
        # (delivery_workflow_idx, the third index of this step, is gone since core migration 0036.)
        "- the message-event FK index, the admin's and the pruner's age indexes (read paths)",
        lambda c: [
            "DROP INDEX delivery_message_event_idx",
            "DROP INDEX delivery_created_idx",
            "DROP INDEX delivery_community_created_idx",
        ],
        "SELECT to_regclass('delivery_created_idx') IS NULL",
    ),
    "partial_indexes": (
        "- the reaper's, expiry's, failure list's, singleton's and slots' partial indexes (read paths, flow limits)",
        lambda c: [f"DROP INDEX {name}" for name in PARTIAL_INDEXES],
        "SELECT to_regclass('delivery_failure_code_idx') IS NULL",
    ),
}


def _url(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


def _run_peers(
    url: str, repeats: int, systems: tuple[str, ...] = SYSTEMS, extra: tuple[str, ...] = ()
) -> dict[tuple[str, int], list[tuple[float, float, float]]]:
    """``bench.run --only peers`` on ``url`` in a child process: (system, K) -> [(rate, server µs,
    client µs)] of each drain. ``extra``: more ``bench.run`` arguments (``bench.hot_claim_ab``
    passes ``--synchronous-commit off``)."""
    command = [sys.executable, "-m", "bench.run", "--only", "peers", "--repeats", str(repeats)]
    command += ["--peers", ",".join(systems), "--output", os.devnull, *extra]
    environ = {**os.environ, "BENCH_DATABASE_URL": url, "PYTHONPATH": str(env.ROOT)}
    found: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    with subprocess.Popen(command, cwd=env.ROOT, env=environ, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = LINE.match(line)
            if match:
                print("   ", line.rstrip(), flush=True)
                system, k, *figures = match.groups()
                rate, server, client = (float(f.replace(",", "")) for f in figures)
                found.setdefault((system, int(k)), []).append((rate, server, client))
    if proc.returncode:
        raise SystemExit(f"bench.run on {url} failed (exit {proc.returncode})")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.worker_ladder", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--steps",
        default=",".join(STEPS),
        help="comma-separated steps, each keeping the removals of those before it (default: all, in order)",
    )
    parser.add_argument("--peer-jobs", type=int, help="jobs per drain (bench.run --peer-jobs)")
    parser.add_argument(
        "--synchronous-commit", choices=("on", "off"), help="bench.run --synchronous-commit (off: CPU, not WAL flushes)"
    )
    args = parser.parse_args(argv)
    extra: tuple[str, ...] = ()
    if args.peer_jobs:
        extra += ("--peer-jobs", str(args.peer_jobs))
    if args.synchronous_commit:
        extra += ("--synchronous-commit", args.synchronous_commit)
    names = [n for n in args.steps.split(",") if n]
    unknown = set(names) - set(STEPS)
    if unknown:
        raise SystemExit(f"unknown steps {sorted(unknown)}; known: {', '.join(STEPS)}")
    url = env.database_url()
    env.ensure_database(url)
    env.setup_django(url)
    env.migrate()
    control = env.connect(url)
    baseline.create_table(control)
    from django.db import connections

    connections.close_all()  # a template must have no other session
    control.close()
    base = urlsplit(url).path.lstrip("/")
    admin = env.connect(_url(url, "postgres"))
    figures: dict[str, dict[tuple[str, int], list[tuple[float, float, float]]]] = {}
    loads: dict[str, str] = {}
    copy = f"{base}_wladder"
    try:
        for position, name in enumerate(names):
            admin.execute(f'DROP DATABASE IF EXISTS "{copy}"')
            admin.execute(f'CREATE DATABASE "{copy}" TEMPLATE "{base}"')
            with env.connect(_url(url, copy)) as conn:
                for step in names[: position + 1]:
                    for statement in STEPS[step][1](conn):
                        conn.execute(statement)
            load = Path("/proc/loadavg").read_text().split()[0]
            print(f"step {position + 1} {name}: {STEPS[name][0]} (load {load})", flush=True)
            figures[name] = _run_peers(_url(url, copy), args.repeats, extra=extra)
            loads[name] = f"{load}-{Path('/proc/loadavg').read_text().split()[0]}"
            with env.connect(_url(url, copy)) as conn:
                for step in names[: position + 1]:
                    (holds,) = conn.execute(STEPS[step][2]).fetchone() or (False,)
                    if not holds:
                        raise SystemExit(f"step {step} no longer holds on the copy after the run")
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{copy}"')
        admin.close()

    def median(name: str, system: str, k: int, index: int) -> float:
        return statistics.median(f[index] for f in figures[name][(system, k)])

    print(
        "\n| step (load 1 min) | worker K=1 /s | ÷ PgQueuer tuned | ÷ floor "
        "| worker K=4 /s | ÷ PgQueuer tuned | ÷ floor "
        "| server µs ours / PgQueuer / floor (K=1) | client µs ours / PgQueuer (K=1) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        cells = []
        for k in KS:
            ours = median(name, "worker", k, 0)
            cells += [
                f"{ours:,.0f}",
                f"{ours / median(name, 'pgqueuer_tuned', k, 0):.2f}x",
                f"{ours / median(name, 'raw_batch50', k, 0):.2f}x",
            ]
        server = " / ".join(f"{median(name, s, 1, 1):.0f}" for s in ("worker", "pgqueuer_tuned", "raw_batch50"))
        client = " / ".join(f"{median(name, s, 1, 2):.0f}" for s in ("worker", "pgqueuer_tuned"))
        print(f"| {STEPS[name][0]} ({loads[name]}) | {' | '.join(cells)} | {server} | {client} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
