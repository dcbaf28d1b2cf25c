"""I/O-bound delivery handlers (issues 29 and 31): every handler waits 0.5 s (a model call, a
webhook), with 64, 256 and 1,000 in flight in one worker process; jobs/s and the peak number of
database connections, for ``run_delivery_worker`` with an ``async def`` handler (tasks on one
event loop), the same worker with a plain handler on threads (at most 256 in flight), and
PgQueuer with an async entrypoint, in the same run on the same PostgreSQL.

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_fio \\
        /work/venv/bin/python -m bench.deliveries_io --output /tmp/io.md
    ... -m bench.deliveries_io --in-flight 64,256,1000 --per-slot 8 --repeats 3 --timeout 120

Fair by construction:

- PgQueuer is configured as its performance guide (docs/guides/performance-tuning.md) advises
  for many concurrent short (< 1 s) async jobs: one direct asyncpg connection for the
  ``QueueManager`` ("always use a direct asyncpg connection ... for the QueueManager"),
  ``max_concurrent_tasks`` = the in-flight figure, ``batch_size`` = min(100, in flight / 2)
  (it must be at most half of ``max_concurrent_tasks``; larger batches for short jobs), drain
  mode, ``pgq autovac``'s settings applied once after install. Its psycopg driver is not used:
  its NOTIFY watcher holds the connection for up to 1 s between notifications
  (``notifies(timeout=1.0)``), so every dequeue waits for it and the budget never fills (about
  20 jobs at a time, 10-19 jobs/s; this is what the previous version of this bench measured).
  The configuration is printed beside the figures.
- Ours: ``WorkerConfig(concurrency=in flight)``, its defaults otherwise (claim batch =
  min(max(in flight, 50), 1000)).
- The same work in every timed window: each run drains ``per-slot x in flight`` jobs loaded
  before it starts (at least 128), the same count for every system.
- Two rates per run, both from the instants the handlers return (``time.monotonic()`` taken in
  the handler, the same code for every system): **steady** = (jobs - in flight) / (time of the
  last completion - time of the in-flight-th completion), i.e. after the first wave is done,
  so start-up, readiness and the first claim ramp are outside it (a perfect worker gives
  in flight / 0.5 s); **drain** = jobs / (last completion - the call that starts the worker),
  start-up included.
- Every scenario repeated (``--repeats``, default 3) and interleaved: each repetition runs every
  in-flight figure, and within it the systems in an order rotated every repetition; the table
  gives the median (and the range) over repetitions; ratios are of medians of the same run.
- Every wait bounded: a run is stopped after ``--timeout`` seconds (ours by its stop event,
  PgQueuer by cancelling ``run``) and reported as failed, not waited for.
- Connections counted: the most client sessions on the bench database, sampled every 20 ms
  (the sampler connects to ``postgres``).

Prints load averages before and after (other jobs may share the machine), a Markdown table, and
writes it to ``--output`` (default ``bench/results/deliveries_io.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.env import ROOT, database_url, ensure_database

URL = database_url()
os.environ["DATABASE_URL"] = URL
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402

from bench.agents_io import Peak  # noqa: E402
from buzz_delivery import services  # noqa: E402
from buzz_delivery.testing import BindingFactory, CommunityFactory, EventFactory, WorkflowRunFactory  # noqa: E402
from buzz_delivery.worker import WorkerConfig, run_worker  # noqa: E402

HANDLER_SECONDS = 0.5
IDLE_EXIT = 0.5
DB_NAME = urlsplit(URL).path.lstrip("/")
SYSTEMS = ("ours_async", "ours_threads", "pgqueuer")
LABELS = {
    "ours_async": "ours, async def handler",
    "ours_threads": "ours, plain handler on threads",
    "pgqueuer": "PgQueuer, async entrypoint",
}

Result = tuple[float, float, int] | None  # steady jobs/s, drain jobs/s, peak connections


class Done:
    """The instants handlers returned (monotonic), appended from any thread."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._lock = threading.Lock()

    def mark(self) -> None:
        t = time.monotonic()
        with self._lock:
            self.times.append(t)

    def rates(self, n: int, in_flight: int, started: float) -> tuple[float, float]:
        times = sorted(self.times)
        assert len(times) == n, (len(times), n)
        steady = (n - in_flight) / (times[-1] - times[in_flight - 1]) if n > in_flight else float("nan")
        return steady, n / (times[-1] - started)


def pgqueuer_batch(in_flight: int) -> int:
    return max(1, min(100, in_flight // 2))


def _deliveries(n: int) -> tuple[Any, bytes]:
    community: Any = CommunityFactory()
    target = os.urandom(32)
    run: Any = WorkflowRunFactory(community=community)
    event: Any = EventFactory(community=community)
    for start in range(0, n, 500):
        bindings = [
            BindingFactory.build(run=run, message_event=event, target_pubkey=target) for _ in range(min(500, n - start))
        ]
        services.commit_deliveries(community.id, event, bindings)
    return community, target


def ours(n: int, in_flight: int, threads: bool, timeout: float) -> Result:
    community, target = _deliveries(n)
    connections.close_all()  # the measured worker's connections only, from here on
    done = Done()

    async def async_wait(delivery: Any) -> None:
        await asyncio.sleep(HANDLER_SECONDS)
        done.mark()

    def thread_wait(delivery: Any) -> None:
        time.sleep(HANDLER_SECONDS)
        done.mark()

    config = WorkerConfig(
        community_id=community.id, target_pubkey=target, handler=thread_wait if threads else async_wait,
        concurrency=in_flight, lease_seconds=60, idle_exit=IDLE_EXIT, poll_interval=0.05,
    )  # fmt: skip
    stop = threading.Event()
    guard = threading.Timer(timeout, stop.set)  # the bound: a run past it is stopped and reported
    with Peak(URL, DB_NAME) as peak:
        guard.start()
        started = time.monotonic()
        summary = run_worker(config, stop=stop, handle_signals=False)
        guard.cancel()
    connections.close_all()
    if summary["finished"] != n or len(done.times) != n:
        print(f"  ours {'threads' if threads else 'async'}: stopped after {timeout}s or short: {dict(summary)}")
        return None
    return (*done.rates(n, in_flight, started), peak.peak)


async def _pgqueuer_connect() -> Any:
    import asyncpg

    return await asyncio.wait_for(asyncpg.connect(URL.replace("postgres://", "postgresql://", 1)), 30)


async def _pgqueuer_install() -> None:
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conn = await _pgqueuer_connect()
    try:
        queries = Queries(AsyncpgDriver(conn))
        if await conn.fetchval("SELECT to_regclass('pgqueuer')") is None:
            await queries.install()
        await queries.optimize_autovacuum()  # what `pgq autovac` sets: its checklist's first item
    finally:
        await conn.close()


def pgqueuer(n: int, in_flight: int, timeout: float) -> Result:
    from pgqueuer import QueueManager
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries
    from pgqueuer.types import QueueExecutionMode

    done = Done()

    async def load() -> None:
        conn = await _pgqueuer_connect()
        try:
            await conn.execute("TRUNCATE pgqueuer, pgqueuer_log")
            queries = Queries(AsyncpgDriver(conn))
            for start in range(0, n, 1000):
                size = min(1000, n - start)
                await queries.enqueue(["io"] * size, [None] * size, [0] * size)
        finally:
            await conn.close()

    async def drain() -> tuple[float, bool]:
        started = time.monotonic()
        conn = await _pgqueuer_connect()
        try:
            qm = QueueManager(Queries(AsyncpgDriver(conn)))

            @qm.entrypoint("io")
            async def wait(job: Any) -> None:
                await asyncio.sleep(HANDLER_SECONDS)
                done.mark()

            try:
                await asyncio.wait_for(
                    qm.run(
                        batch_size=pgqueuer_batch(in_flight),
                        mode=QueueExecutionMode.drain,
                        max_concurrent_tasks=in_flight,
                        dequeue_timeout=timedelta(seconds=0.3),
                    ),
                    timeout,
                )
            except TimeoutError:
                return started, False
            return started, True
        finally:
            await conn.close()

    asyncio.run(load())
    with Peak(URL, DB_NAME) as peak:
        started, finished = asyncio.run(drain())
    if not finished or len(done.times) != n:
        print(f"  PgQueuer: stopped after {timeout}s or short: {len(done.times)} of {n}")
        return None
    return (*done.rates(n, in_flight, started), peak.peak)


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    global HANDLER_SECONDS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-flight", default="64,256,1000")
    parser.add_argument("--handler-seconds", type=float, default=0.5)
    parser.add_argument("--per-slot", type=int, default=8, help="jobs per run = per-slot x in flight (at least 128)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a run may take before it is stopped")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "deliveries_io.md")
    args = parser.parse_args()
    HANDLER_SECONDS = args.handler_seconds
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; choose from {SYSTEMS}")
    logging.getLogger("buzz_delivery.worker").setLevel(logging.WARNING)
    ensure_database(URL)
    call_command("migrate", verbosity=0)
    connections.close_all()
    if "pgqueuer" in systems:
        asyncio.run(_pgqueuer_install())
    figures = [int(x) for x in args.in_flight.split(",")]
    load_before = _loadavg()
    print(f"load average before: {load_before}", flush=True)
    results: dict[tuple[str, int], list[Result]] = {}
    for rep in range(args.repeats):
        order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
        for in_flight in figures:
            n = max(128, args.per_slot * in_flight)
            for system in order:
                if system == "ours_threads" and in_flight > 256:
                    continue
                if system == "pgqueuer":
                    r = pgqueuer(n, in_flight, args.timeout)
                else:
                    r = ours(n, in_flight, system == "ours_threads", args.timeout)
                results.setdefault((system, in_flight), []).append(r)
                line = "failed" if r is None else f"steady {r[0]:.1f}/s, drain {r[1]:.1f}/s, peak {r[2]} conns"
                print(f"rep {rep + 1} in_flight={in_flight} jobs={n} {system}: {line}", flush=True)
    load_after = _loadavg()
    print(f"load average after: {load_after}", flush=True)

    def med(system: str, in_flight: int, i: int) -> float | None:
        rs = results.get((system, in_flight), [])
        vals = [r[i] for r in rs if r is not None]
        return statistics.median(vals) if vals and len(vals) == len(rs) else None

    def cell(system: str, in_flight: int) -> str:
        rs = results.get((system, in_flight))
        if not rs:
            return "—"
        if any(r is None for r in rs):
            return f"failed {sum(r is None for r in rs)} of {len(rs)}"
        steady = [r[0] for r in rs if r is not None]
        drain = [r[1] for r in rs if r is not None]
        conns = max(r[2] for r in rs if r is not None)
        return (
            f"{statistics.median(steady):.1f} ({min(steady):.0f}-{max(steady):.0f}) / "
            f"{statistics.median(drain):.1f} / {conns}"
        )

    def ratio(in_flight: int) -> str:
        a, p = med("ours_async", in_flight, 0), med("pgqueuer", in_flight, 0)
        return "—" if a is None or p is None else f"{a / p:.2f}x"

    shown = [s for s in SYSTEMS if s in systems]
    command = "python -m bench.deliveries_io " + " ".join(sys.argv[1:])
    lines = [
        f"I/O-bound delivery handlers: each waits {HANDLER_SECONDS} s; {os.cpu_count()} cores, one worker "
        "process a side, same run, same PostgreSQL; jobs/s (ideal: in flight / "
        f"{HANDLER_SECONDS} s).",
        "",
        f"Command: `{command}` ({args.repeats} repetitions, systems interleaved, order rotated every "
        f"repetition; every run bounded by {args.timeout:g} s). Load average before / after: "
        f"{load_before} / {load_after}.",
        "",
        "Cells: **steady** jobs/s, median (range) over repetitions, from the in-flight-th completion to "
        "the last (the first wave done: start-up, readiness and the first claim ramp outside it) / "
        "**drain** jobs/s, median, jobs over the whole run from the call that starts the worker / peak "
        "DB connections.",
        "",
        "Configuration: ours `WorkerConfig(concurrency=<in flight>, lease_seconds=60, idle_exit=0.5, "
        "poll_interval=0.05)`, claim batch its default min(max(in flight, 50), 1000). PgQueuer "
        "as its performance guide advises: one direct asyncpg connection for the QueueManager, "
        "`run(mode=drain, max_concurrent_tasks=<in flight>, batch_size=min(100, in flight / 2), "
        "dequeue_timeout=0.3 s)`, `pgq autovac` settings.",
        "",
        "| in flight | jobs | PgQueuer batch_size | "
        + " | ".join(LABELS[s] for s in shown)
        + " | ideal | ours async / PgQueuer (steady) |",
        "|---|---|---|" + "---|" * len(shown) + "---|---|",
    ]
    for f in figures:
        n = max(128, args.per_slot * f)
        lines.append(
            f"| {f} | {n} | {pgqueuer_batch(f)} | "
            + " | ".join(cell(s, f) for s in shown)
            + f" | {f / HANDLER_SECONDS:.0f} | {ratio(f)} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    args.output.write_text(text)


if __name__ == "__main__":
    main()
