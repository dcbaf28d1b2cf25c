"""I/O-bound agent runs (issue 29): each run makes 3 journaled calls that each wait 0.5 s (a
model or tool call), with 64, 256 and 1,000 runs in flight; runs/s and the peak number of
database connections, for the event-loop worker (``run_agent_worker --async``, 4 connections),
optionally the threaded ``AgentWorker`` (``--threaded``: one handler thread and connection per
run) and DBOS Transact's async workflow of 3 async steps on the same shape
(``bench/dbos_agents_io.py``, run by ``--dbos-python``, which must have ``dbos``), in the same
run on the same PostgreSQL.

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5433/bench_fio /work/venv/bin/python -m bench.agents_io
    ... -m bench.agents_io --call-seconds 0 --in-flight 64 --processes 1,4 --runs-per-slot 16

``--processes 1,4``: each figure with K worker processes a side. Ours: K ``multiprocessing``
(spawn) processes, each an ``AsyncAgentWorker`` at in-flight/K on connections/K, on one
community and agent; DBOS: K processes of ``dbos_agents_io.py``, each n/K workflows at
in-flight/K. The same work is inside every timed window (issue 31): DBOS starts its workflows
inside it, so our runs are created inside it too, by ``--producers`` intake threads in all
(split among the worker processes; one ``intake_event``, one transaction, per run) released
with the workers; the workers stop when the database counts all n runs completed. Ours: runs / (first run's
``created_at`` .. last ``finished_at``, the database clock); DBOS: runs / (earliest start ..
latest end its processes report, released together after launch and warm-up).
``--precreate`` creates our runs before the window (the old measure; span from the start
signal, read on the database clock).

Each figure drains ``runs-per-slot x in-flight`` runs (at least 128). Peak connections: the most
sessions on the figure's database seen by a sampler every 20 ms (the sampler connects to
``postgres``; ours include the producers' and the completion watcher's). Our databases: the
bench's (created, name must start with ``bench_f``); DBOS's: its name + ``_dbos``. Prints a
Markdown table (K a column, ours / DBOS) and writes ``bench/results/agents_io.md``
(``agents_io_noop.md`` with ``--call-seconds 0``: no-op calls, the runtime's own cost).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

from bench.env import ROOT, database_url, ensure_database

URL = database_url()
os.environ["DATABASE_URL"] = URL
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402

from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig  # noqa: E402
from buzz_delivery.agents.models import AgentRun  # noqa: E402
from buzz_delivery.agents.services import intake_event  # noqa: E402
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig  # noqa: E402
from buzz_delivery.testing import CommunityFactory  # noqa: E402

CALL_SECONDS = 0.5


async def _wait(args: Any, key: str) -> Any:
    await asyncio.sleep(CALL_SECONDS)
    return args


async def async_three(ctx: Any) -> dict[str, bool]:  # the handler measured: 3 journaled 0.5 s calls
    for n in (1, 2, 3):
        await ctx.call("model", _wait, {"n": n})
    return {"ok": True}


def _sleep_call(args: Any, key: str) -> Any:
    time.sleep(CALL_SECONDS)
    return args


def sync_three(ctx: Any) -> dict[str, bool]:  # the same shape for the threaded worker
    for n in (1, 2, 3):
        ctx.call("model", _sleep_call, {"n": n})
    return {"ok": True}


def _with_db(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


class Peak:
    """Samples the sessions on database ``name`` every 20 ms (from the ``postgres`` database)."""

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name, self.peak = _with_db(url, "postgres"), name, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.is_set():
                n = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend'",
                    [self.name],
                ).fetchone()
                self.peak = max(self.peak, n[0] if n else 0)
                time.sleep(0.02)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()


def _community() -> tuple[Any, bytes]:
    community = CommunityFactory()
    connections.close_all()  # the measured workers' and producers' connections only, from here on
    return community, os.urandom(32)


def _produce(community_id: Any, agent: bytes, n: int) -> None:
    """Create ``n`` runs, one ``intake_event`` (one transaction) each, as a channel would."""
    try:
        for _ in range(n):
            intake_event(community_id, "bench", uuid.uuid4().hex, {}, agent, timeout_seconds=3600)
    finally:
        connections.close_all()


def _split(n: int, k: int) -> list[int]:
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _child(
    kind: str, community_id: Any, agent: bytes, produce: int, producers: int, in_flight: int, conns: int,
    call_seconds: float, ready: Any, go: Any, done: Any, results: Any,
) -> None:  # fmt: skip
    """One worker process (``multiprocessing`` spawn): its worker runs from ``go`` until ``done``
    (all n runs completed, read from the database by the parent); its ``producers`` threads
    create its ``produce`` runs from ``go`` on, inside the timed window."""
    global CALL_SECONDS
    CALL_SECONDS = call_seconds
    logging.getLogger("buzz_delivery.agents").setLevel(logging.WARNING)
    worker: AsyncAgentWorker | AgentWorker
    if kind == "async":
        worker = AsyncAgentWorker(
            AsyncWorkerConfig(
                handler=async_three,
                agents=[agent],
                communities=[community_id],
                in_flight=in_flight,
                connections=conns,
                lease_seconds=60,
                poll_seconds=0.05,
                listen=False,
                worker_id=f"bench-aio-{os.getpid()}",
            )
        )
    else:
        worker = AgentWorker(
            WorkerConfig(
                handler=sync_three,
                agents=[agent],
                communities=[community_id],
                concurrency=in_flight,
                lease_seconds=60,
                poll_seconds=0.05,
                listen=False,
                worker_id=f"bench-threads-{os.getpid()}",
            )
        )
    threads = [
        threading.Thread(target=_produce, args=(community_id, agent, part), daemon=True)
        for part in _split(produce, producers)
        if part
    ]

    def stopper() -> None:
        done.wait()
        worker.stop()

    threading.Thread(target=stopper, daemon=True).start()
    ready.put(os.getpid())
    go.wait()
    for t in threads:
        t.start()
    counts = worker.run()
    for t in threads:
        t.join()
    results.put(counts)


def _completed(conn: psycopg.Connection[Any], community_id: Any) -> int:
    row = conn.execute(
        f"SELECT count(*) FROM {AgentRun._meta.db_table} WHERE community_id = %s AND state = 'completed'",
        [community_id],
    ).fetchone()
    return int(row[0]) if row else 0


def ours(kind: str, n: int, in_flight: int, conns: int, k: int, producers: int, precreate: bool) -> tuple[float, int]:
    """``k`` worker processes drain ``n`` runs; runs/s over the database clock's span from the
    first run's creation (``--precreate``: the start signal) to the last run's finish."""
    community, agent = _community()
    if precreate:
        _produce(community.id, agent, n)
    ctx = multiprocessing.get_context("spawn")
    ready, results, go, done = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    procs = [
        ctx.Process(
            target=_child,
            args=(
                kind,
                community.id,
                agent,
                0 if precreate else part,
                max(1, producers // k),
                max(1, in_flight // k),
                max(1, conns // k),
                CALL_SECONDS,
                ready,
                go,
                done,
                results,
            ),
        )
        for part in _split(n, k)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    with psycopg.connect(URL, autocommit=True) as watch, Peak(URL, urlsplit(URL).path.lstrip("/")) as peak:
        row = watch.execute("SELECT clock_timestamp()").fetchone()
        go_at = row[0] if row else None
        go.set()
        deadline = time.monotonic() + 900
        while _completed(watch, community.id) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        done.set()
        counts = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    assert sum(c.get("completed", 0) for c in counts) == n, counts
    with psycopg.connect(URL, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*), extract(epoch FROM max(finished_at) - "
            f"CASE WHEN %s THEN %s ELSE min(created_at) END)::float8, "
            "extract(epoch FROM max(created_at) - min(created_at))::float8 "
            f"FROM {AgentRun._meta.db_table} WHERE community_id = %s AND state = 'completed'",
            [precreate, go_at, community.id],
        ).fetchone()
    assert row is not None and row[0] == n, row
    if not precreate:  # how long creating the runs took, inside the window
        print(
            f"  ours K={k}: {n} runs created in {row[2]:.2f} s, all finished {row[1]:.2f} s after the first", flush=True
        )
    return n / row[1], peak.peak


def dbos(python: str, url: str, n: int, in_flight: int, k: int) -> tuple[float, int] | None:
    """``k`` processes of ``bench/dbos_agents_io.py``, each n/k workflows at in_flight/k, started
    together once all have launched and warmed up; runs/s over the earliest start to the latest
    end they report."""
    name = urlsplit(url).path.lstrip("/")
    procs: list[subprocess.Popen[str]] = []
    try:
        for part in _split(n, k):
            procs.append(
                subprocess.Popen(
                    [
                        python,
                        str(ROOT / "bench" / "dbos_agents_io.py"),
                        url.replace("postgres://", "postgresql://"),
                        str(part),
                        str(max(1, in_flight // k)),
                        str(CALL_SECONDS),
                        "--wait",
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise subprocess.SubprocessError(f"no ready line: {line!r} {p.stderr.read() if p.stderr else ''}")
        with Peak(URL, name) as peak:
            outs = [p.communicate("go\n", timeout=900) for p in procs]
    except (OSError, subprocess.SubprocessError, AssertionError) as exc:
        for p in procs:
            p.kill()
        print(f"DBOS skipped: {exc}", file=sys.stderr)
        return None
    reports = []
    for p, (out, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            print(f"DBOS skipped: exit {p.returncode} {err[-2000:]}", file=sys.stderr)
            return None
        reports.append(json.loads(out.strip().splitlines()[-1]))
    span = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    return sum(r["runs"] for r in reports) / span, peak.peak


def main() -> None:
    global CALL_SECONDS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-flight", default="64,256,1000")
    parser.add_argument("--processes", default="1", help="worker processes K, comma-separated (both sides)")
    parser.add_argument("--connections", type=int, default=4, help="our connections in all (each process: /K)")
    parser.add_argument("--producers", type=int, default=4, help="intake threads in all (each process: /K, at least 1)")
    parser.add_argument("--precreate", action="store_true", help="create our runs before the timed window")
    parser.add_argument("--threaded", action="store_true", help="also the threaded AgentWorker (in flight <= 64)")
    parser.add_argument("--call-seconds", type=float, default=0.5)
    parser.add_argument("--runs-per-slot", type=int, default=2)
    parser.add_argument("--dbos-python", default=os.environ.get("DBOS_PYTHON", sys.executable))
    args = parser.parse_args()
    CALL_SECONDS = args.call_seconds
    logging.getLogger("buzz_delivery.agents").setLevel(logging.WARNING)
    ensure_database(URL)
    dbos_url = _with_db(URL, urlsplit(URL).path.lstrip("/") + "_dbos")
    ensure_database(dbos_url)
    call_command("migrate", verbosity=0)
    connections.close_all()
    rows = []
    load = [os.getloadavg()[0]]
    for in_flight in [int(x) for x in args.in_flight.split(",")]:
        n = max(128, args.runs_per_slot * in_flight)
        for k in [int(x) for x in args.processes.split(",")]:
            aio = ours("async", n, in_flight, args.connections, k, args.producers, args.precreate)
            print(
                f"ours --async K={k} in_flight={in_flight} runs={n}: {aio[0]:.1f} runs/s, peak {aio[1]} conns",
                flush=True,
            )
            threads = None
            if args.threaded and in_flight <= 64:
                threads = ours("threads", n, in_flight, args.connections, k, args.producers, args.precreate)
                print(
                    f"ours threads K={k} in_flight={in_flight}: {threads[0]:.1f} runs/s, peak {threads[1]} conns",
                    flush=True,
                )
            peer = dbos(args.dbos_python, dbos_url, n, in_flight, k)
            if peer:
                print(f"DBOS K={k} in_flight={in_flight}: {peer[0]:.1f} runs/s, peak {peer[1]} conns", flush=True)
            rows.append((k, in_flight, n, aio, threads, peer))
            load.append(os.getloadavg()[0])

    def cell(x: tuple[float, int] | None) -> str:
        return "—" if x is None else f"{x[0]:.1f} / {x[1]}"

    window = (
        "created before the window (--precreate)"
        if args.precreate
        else (f"created inside the window by {args.producers} intake threads (/K a process)")
    )
    lines = [
        f"I/O-bound agent runs: 3 journaled calls of {CALL_SECONDS} s each ({os.cpu_count()} cores, same run, "
        f"same PostgreSQL, load average {min(load):.1f} to {max(load):.1f}); runs/s / peak DB connections. "
        f"K worker processes a side, in flight and connections split among them; our runs {window}; "
        "runs/s = runs / (first start .. last finish)",
        "",
        f"| K | in flight | runs | ours --async ({args.connections} conns / K) | ours threaded AgentWorker "
        "| DBOS async workflow, 3 async steps | ours / DBOS |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {k} | {f} | {n} | {cell(a)} | {cell(t)} | {cell(p)} | {'—' if not p else f'{a[0] / p[0]:.2f}x'} |"
            for k, f, n, a, t, p in rows
        ],
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    # No-op calls (--call-seconds 0: the runtime's own cost, issue 29) keep a file of their own.
    name = "agents_io_noop.md" if CALL_SECONDS == 0 else "agents_io.md"
    (ROOT / "bench" / "results" / name).write_text(text)


if __name__ == "__main__":
    main()
