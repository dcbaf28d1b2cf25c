"""A HOT claim on the one delivery table, and its fillfactor (issue 31): ``run_worker`` next to
PgQueuer tuned on copies of the migrated bench database that differ only in the delivery
record's index predicates, claim functions and fillfactor:

    python -m bench.hot_claim_ab [--repeats 3] [--variants main,hot,hot_ff70,hot_ff50,hot_ff30]
                                 [--probe-variants ...] [--probe-deliveries 12000]

- ``main``: the migrated schema as it is.
- ``hot``: every index predicate that names status says ``finished_at IS NULL`` (live) or
  ``finished_at IS NOT NULL`` (terminal) instead; ``delivery_claimed_lease_idx`` dropped; the slot
  keys' predicate is ``slot_x IS NOT NULL``; the singleton unique key sits on a new column
  (``pending_singleton_key``) the claim sets NULL; the plan-cached claim functions
  (``buzz_delivery_claim_*``, redefined from ``pg_get_functiondef``) add ``d.finished_at IS NULL``
  so the planner matches the poll index. No column the claim writes is then named by an index, so
  the claim can be a HOT update when its page has room; the settle writes ``finished_at`` (named
  by the live/terminal predicates) and stays a non-HOT update.
- ``hot_ffNN``: ``hot`` with ``fillfactor = NN`` on the table. The bench loads each drain's
  deliveries after a ``TRUNCATE`` (``bench.data.clear_deliveries``), so every page a drain claims
  from was written under the setting: no ``VACUUM FULL`` is needed.
- ``hot_ffNN_nohist``: with the claim's and settle's history entries taken away (the history push
  returns the history unchanged, :data:`bench.worker_ladder.STEPS` ``history``): whether the row the
  claim grows limits HOT. A comparison, not a proposal.

Rounds: each repeat drains every variant once (``bench.run --only peers --peers
worker,pgqueuer_tuned --synchronous-commit off --repeats 1`` in a child process on the variant's
copy: K=1 then K=4), the variants' order rotating every repeat; ``bench.run`` checks that every
drain of ours finished each delivery exactly once (status finished, lease generation 1). Around
each child the record's ``n_tup_upd`` / ``n_tup_hot_upd`` give the HOT share of its updates.

Probe (after the rounds, one child per variant, ``--probe``): one K=1 and one K=4 drain of
``--probe-deliveries`` through :func:`bench.scenarios.peers.drain_once`, each read back from the
WAL (``pg_walinspect``: btree leaf inserts on the record's indexes, heap UPDATE / HOT_UPDATE
records, WAL bytes between the two LSNs) and the record's heap size a delivery after the load and
after the drain.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import psycopg

from bench import baseline, data, env
from bench.worker_ladder import STEPS, _rewritten, _run_peers, _url

D = data.OURS
SYSTEMS = ("worker", "pgqueuer_tuned")
KS = (1, 4)
SYNC_OFF = ("--synchronous-commit", "off")
SINGLETON = "pending_singleton_key"
POLL = "delivery_pending_poll_idx"

# The record's indexes whose predicate names status, as the HOT form defines them.
HOT_INDEXES = {
    "delivery_pending_poll_idx": f"CREATE INDEX delivery_pending_poll_idx ON {D} "
    "(community_id, target_pubkey, priority DESC, created_at, id) WHERE finished_at IS NULL",
    "delivery_pending_age_idx": f"CREATE INDEX delivery_pending_age_idx ON {D} (timezone('UTC', created_at)) "
    "WHERE created_at > '1970-01-01 00:00:00+00' AND finished_at IS NULL",
    "delivery_pending_expiry_idx": f"CREATE INDEX delivery_pending_expiry_idx ON {D} (community_id, expires_at) "
    "WHERE expires_at IS NOT NULL AND finished_at IS NULL",
    "delivery_singleton_pending_key": f"CREATE UNIQUE INDEX delivery_singleton_pending_key ON {D} "
    f"(community_id, target_pubkey, {SINGLETON}) WHERE {SINGLETON} IS NOT NULL",
    "delivery_slot_community_key": f"CREATE UNIQUE INDEX delivery_slot_community_key ON {D} "
    "(community_id, slot_community) WHERE slot_community IS NOT NULL",
    "delivery_slot_target_key": f"CREATE UNIQUE INDEX delivery_slot_target_key ON {D} "
    "(community_id, target_pubkey, slot_target) WHERE slot_target IS NOT NULL",
    "delivery_slot_workflow_key": f"CREATE UNIQUE INDEX delivery_slot_workflow_key ON {D} "
    "(community_id, workflow_id, slot_workflow) WHERE slot_workflow IS NOT NULL",
    "delivery_terminal_age_idx": f"CREATE INDEX delivery_terminal_age_idx ON {D} (community_id, finished_at) "
    "WHERE finished_at IS NOT NULL",
}


def _one(conn: psycopg.Connection, query: str, params: list[Any] | None = None) -> Any:
    row = conn.execute(query, params).fetchone()  # type: ignore[call-overload]
    assert row is not None
    return row


def _live_claim(body: str) -> str:
    """A claim function with the liveness predicate (the poll index's) and the singleton column
    cleared; any other function unchanged."""
    if not re.search(r"FUNCTION public\.buzz_delivery_claim_\w+\(", body):
        return body
    pending = "AND d.status = 'pending'"
    if pending not in body or "SET status = 'claimed'," not in body:
        raise SystemExit(f"a claim function no longer has the expected form:\n{body}")
    body = body.replace(pending, f"{pending}\n      AND d.finished_at IS NULL")
    return body.replace("SET status = 'claimed',", f"SET status = 'claimed',\n    {SINGLETON} = NULL,")


def _hot_ddl(conn: psycopg.Connection) -> list[str]:
    (kind,) = _one(
        conn,
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = %s::regclass"
        " AND attname = 'singleton_key'",
        [D],
    )
    statements = [f"ALTER TABLE {D} ADD COLUMN {SINGLETON} {kind}", "DROP INDEX delivery_claimed_lease_idx"]
    for name, create in HOT_INDEXES.items():
        statements += [f"DROP INDEX {name}", create]
    # The functions' row type now has the new column: redefine them after it exists.
    return statements


def _variant(fillfactor: int | None, history: bool = True) -> Callable[[psycopg.Connection], None]:
    def apply(conn: psycopg.Connection) -> None:
        for statement in _hot_ddl(conn):
            conn.execute(statement)
        for statement in _rewritten(conn, _live_claim):
            conn.execute(statement)
        if not history:
            for statement in STEPS["history"][1](conn):
                conn.execute(statement)
        if fillfactor is not None:
            conn.execute(f"ALTER TABLE {D} SET (fillfactor = {fillfactor})")
        conn.execute(f"VACUUM (FULL, ANALYZE) {D}")  # the copy's table is empty: a no-op but for certainty

    return apply


VARIANTS: dict[str, tuple[str, Callable[[psycopg.Connection], None] | None]] = {
    "main": ("main's schema", None),
    "hot": ("HOT DDL, default fillfactor (100)", _variant(None)),
    "hot_ff70": ("HOT DDL, fillfactor 70", _variant(70)),
    "hot_ff50": ("HOT DDL, fillfactor 50", _variant(50)),
    "hot_ff40": ("HOT DDL, fillfactor 40", _variant(40)),
    "hot_ff30": ("HOT DDL, fillfactor 30", _variant(30)),
    "hot_ff70_nohist": ("HOT DDL, fillfactor 70, no history entries (comparison)", _variant(70, history=False)),
    "hot_ff50_nohist": ("HOT DDL, fillfactor 50, no history entries (comparison)", _variant(50, history=False)),
    "hot_nohist": ("HOT DDL, fillfactor 100, no history entries (comparison)", _variant(None, history=False)),
}
ROUNDS = "main,hot,hot_ff70,hot_ff50,hot_ff30"
PROBES = "main,hot,hot_ff70,hot_ff50,hot_ff30,hot_nohist,hot_ff70_nohist,hot_ff50_nohist"

HOLDS = (
    "SELECT to_regclass('delivery_claimed_lease_idx') IS NULL AND NOT EXISTS (SELECT 1 FROM pg_proc"
    " WHERE proname LIKE 'buzz\\_delivery\\_claim\\_%%' AND prosrc NOT LIKE '%%d.finished_at IS NULL%%')"
    " AND coalesce((SELECT reloptions FROM pg_class WHERE oid = %s::regclass), '{}') = %s"
)


def _holds(conn: psycopg.Connection, name: str) -> bool:
    if name == "main":
        return _one(conn, "SELECT to_regclass('delivery_claimed_lease_idx') IS NOT NULL")[0]
    found = re.search(r"ff(\d+)", name)
    options = [f"fillfactor={found.group(1)}"] if found else []
    return _one(conn, HOLDS, [D, options])[0]


def _counters(conn: psycopg.Connection) -> tuple[int, int, int]:
    """The record's updates and HOT updates, and the poll index's scans (the claim's plan uses it)."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    upd, hot = _one(conn, "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = %s::regclass", [D])
    (scans,) = _one(conn, "SELECT idx_scan FROM pg_stat_user_indexes WHERE indexrelid = %s::regclass", [POLL])
    return upd, hot, scans


# --- the probe: one K=1 and one K=4 drain read back from the WAL (run in a child, on one copy) ----


def _probe(url: str, deliveries: int) -> dict[str, Any]:
    env.setup_django(url)
    from bench.peers import PeerPool
    from bench.queue_design import _marked_queues, wal_counts
    from bench.scenarios import peers as peers_scenario

    conn = env.connect(url)
    conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    bench: Any = SimpleNamespace(url=url, conn=conn)
    queues = _marked_queues()(bench)
    queues.prepare(["worker"])
    heap = f"SELECT pg_relation_size('{D}'), pg_total_relation_size('{D}')"
    found: dict[str, Any] = {}
    with PeerPool(url, max(KS)) as pool:
        peers_scenario.drain_once(bench, queues, pool, "worker", 1, 2_000)  # warm the processes
        for k in KS:
            marks: dict[str, Any] = {}

            def loaded(marks: dict[str, Any] = marks) -> None:
                marks["size"] = _one(conn, heap)
                marks["counters"] = _counters(conn)
                # A temporary slot keeps the drain's WAL from being recycled by a checkpoint (the
                # next load's, or another session's) before it is read back.
                conn.execute("SELECT pg_create_physical_replication_slot('bench_hot_claim_ab', true, true)")
                marks["lsn"] = _one(conn, "SELECT pg_current_wal_insert_lsn()::text")[0]

            queues.loaded = loaded
            m = peers_scenario.drain_once(bench, queues, pool, "worker", k, deliveries)  # checks exactly once
            time.sleep(1.0)  # the drainers' statistics are flushed (at most once a second)
            (end,) = _one(conn, "SELECT pg_current_wal_flush_lsn()::text")
            (wal_bytes,) = _one(conn, "SELECT pg_wal_lsn_diff(%s, %s)", [end, marks["lsn"]])
            counts = wal_counts(conn, marks["lsn"], end, [D])
            conn.execute("SELECT pg_drop_replication_slot('bench_hot_claim_ab')")
            indexes = {
                r[0]
                for r in conn.execute(
                    "SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = %s::regclass", [D]
                )
            }
            upd, hot, scans = _counters(conn)
            size = _one(conn, heap)
            found[str(k)] = {
                "server_us": m["server_us"],
                "client_us": m["client_us"],
                "rate": m["rate"],
                "index_inserts": sum(v for key, v in counts.items() if key in indexes) / deliveries,
                "by_index": {key: v / deliveries for key, v in counts.items() if key in indexes},
                "heap": {key.split(" ", 1)[1]: v / deliveries for key, v in counts.items() if key not in indexes},
                "wal_bytes": float(wal_bytes) / deliveries,
                "updates": (upd - marks["counters"][0]) / deliveries,
                "hot_updates": (hot - marks["counters"][1]) / deliveries,
                "poll_index_scans": scans - marks["counters"][2],
                "heap_bytes_loaded": marks["size"][0] / deliveries,
                "heap_bytes_drained": size[0] / deliveries,
                "total_bytes_drained": size[1] / deliveries,
            }
    queues.loaded = None
    conn.close()
    return found


# --- main -----------------------------------------------------------------------------------------


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hot_claim_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=ROUNDS, help=f"variants of the rounds (known: {', '.join(VARIANTS)})")
    parser.add_argument("--probe-variants", default=PROBES, help="variants of the WAL/size probe ('' for none)")
    parser.add_argument("--probe-deliveries", type=int, default=12_000)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the child's side
    args = parser.parse_args(argv)
    if args.probe:
        os.environ["PGOPTIONS"] = f"{os.environ.get('PGOPTIONS', '')} -c synchronous_commit=off"
        print("PROBE " + json.dumps(_probe(env.database_url(), args.probe_deliveries)), flush=True)
        return 0
    names = [n for n in args.variants.split(",") if n]
    probes = [n for n in args.probe_variants.split(",") if n]
    unknown = set(names + probes) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")

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
    copies = {name: f"{base}_{name}" for name in dict.fromkeys(names + probes)}
    for name, copy in copies.items():
        admin.execute(f'DROP DATABASE IF EXISTS "{copy}"')
        admin.execute(f'CREATE DATABASE "{copy}" TEMPLATE "{base}"')
        apply = VARIANTS[name][1]
        if apply:
            with env.connect(_url(url, copy)) as conn:
                apply(conn)
    figures: dict[tuple[str, str, int], list[tuple[float, float, float]]] = {}
    hot_share: dict[str, list[float]] = {name: [] for name in names}
    loads: list[float] = [_load()]
    probed: dict[str, dict[str, Any]] = {}
    try:
        for repeat in range(args.repeats):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                copy_url = _url(url, copies[name])
                print(f"repeat {repeat + 1} {name}: {VARIANTS[name][0]} (load {_load()})", flush=True)
                with env.connect(copy_url) as conn:
                    before = _counters(conn)
                found = _run_peers(copy_url, 1, SYSTEMS, SYNC_OFF)
                loads.append(_load())
                time.sleep(1.0)
                with env.connect(copy_url) as conn:
                    upd, hot, scans = (a - b for a, b in zip(_counters(conn), before, strict=True))
                    if not _holds(conn, name):
                        raise SystemExit(f"variant {name} no longer holds on its copy after the run")
                hot_share[name].append(hot / upd if upd else float("nan"))
                print(f"    HOT {hot:,} of {upd:,} updates of the record; {scans:,} poll index scans", flush=True)
                for (system, k), runs in found.items():
                    figures.setdefault((name, system, k), []).extend(runs)
        for name in probes:
            print(f"probe {name}: {VARIANTS[name][0]} (load {_load()})", flush=True)
            command = [sys.executable, "-m", "bench.hot_claim_ab", "--probe"]
            command += ["--probe-deliveries", str(args.probe_deliveries)]
            environ = {**os.environ, "BENCH_DATABASE_URL": _url(url, copies[name]), "PYTHONPATH": str(env.ROOT)}
            out = subprocess.run(command, cwd=env.ROOT, env=environ, stdout=subprocess.PIPE, text=True, check=True)
            line = next(x for x in out.stdout.splitlines() if x.startswith("PROBE "))
            probed[name] = json.loads(line.removeprefix("PROBE "))
            print("   ", json.dumps(probed[name]), flush=True)
            loads.append(_load())
    finally:
        for copy in copies.values():
            admin.execute(f'DROP DATABASE IF EXISTS "{copy}"')
        admin.close()

    def med(name: str, system: str, k: int, index: int) -> float:
        return statistics.median(f[index] for f in figures[(name, system, k)])

    print(f"\nload average (1 min) at each child's start/end: {min(loads)}-{max(loads)}; medians of {args.repeats}")
    if not figures:
        names = []
    print(
        "\n| variant | worker K=1 /s | ÷ PgQueuer tuned | worker K=4 /s | ÷ PgQueuer tuned "
        "| server µs ours / PgQueuer K=1 | K=4 | client µs ours / PgQueuer K=1 | K=4 | HOT share of updates |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        cells = []
        for k in KS:
            ours = med(name, "worker", k, 0)
            cells += [f"{ours:,.0f}", f"{ours / med(name, 'pgqueuer_tuned', k, 0):.2f}x"]
        for index in (1, 2):
            cells += [" / ".join(f"{med(name, s, k, index):.0f}" for s in SYSTEMS) for k in KS]
        cells.append(f"{statistics.median(hot_share[name]):.2f}")
        print(f"| {VARIANTS[name][0]} | {' | '.join(cells)} |")
    if probed:
        print(
            "\n| variant (probe) | K | server µs | client µs | index inserts | heap UPDATE / HOT_UPDATE "
            "| HOT share | WAL bytes | heap bytes loaded / drained | total bytes drained | poll index scans |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, by_k in probed.items():
            for k_text, p in by_k.items():
                heap = p["heap"]
                share = p["hot_updates"] / p["updates"] if p["updates"] else float("nan")
                print(
                    f"| {VARIANTS[name][0]} | {k_text} | {p['server_us']:.0f} | {p['client_us']:.0f} "
                    f"| {p['index_inserts']:.2f} | {heap.get('UPDATE', 0):.2f} / {heap.get('HOT_UPDATE', 0):.2f} "
                    f"| {share:.2f} | {p['wal_bytes']:,.0f} | {p['heap_bytes_loaded']:,.0f} / "
                    f"{p['heap_bytes_drained']:,.0f} | {p['total_bytes_drained']:,.0f} | {p['poll_index_scans']:,} |"
                )
        for name, by_k in probed.items():
            detail = ", ".join(f"{key} {v:.2f}" for key, v in sorted(by_k["1"]["by_index"].items()))
            print(f"{name} K=1 index inserts: {detail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
