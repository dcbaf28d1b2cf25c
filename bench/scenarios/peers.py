"""Peers: our worker next to PgQueuer, procrastinate, django-tasks-db and the raw psycopg floors,
each draining a queue of no-op jobs with K = 1 and K = 4 processes, in one run, interleaved (the
order of the systems rotates every repetition), several repetitions.

For every drain it measures, over the window from the common start to the instant the queue is
empty (polled every 10 ms by the controller on its own connection):

- deliveries/s: the jobs of the queue divided by that window;
- server CPU per delivery: user + system CPU of the bench database's backends (every session of
  that database but the controller's, read from ``/proc/<pid>/stat`` every 50 ms; a backend
  that exits is counted up to its last sample), divided by the jobs;
- client CPU per delivery: user + system CPU of the draining processes (``getrusage``, all their
  threads), divided by the jobs; it includes a system's own stop (our worker's 0.3 s idle exit,
  PgQueuer's last empty dequeue) but not process start-up;
- commits per delivery (``pg_stat_database``, less the controller's own) and statements per
  delivery where the system counts them (ours and the raw floors; autocommit: one round trip
  each).

``worker_before`` runs the worker of another source tree (``BENCH_BEFORE_ROOT``: a folder holding
a ``buzz_delivery`` package, e.g. ``git archive`` of an older commit) in its own processes, so a
change is judged before/after within one run; ``worker_async_before`` runs that tree's worker
with the ``async def`` handler (``worker_async``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import psycopg
from tabulate import tabulate

from bench import data, env
from bench.baseline import TABLE as RAW_TABLE
from bench.context import Bench
from bench.peers import PAIRS, PeerPool

KS = (1, 4)
SAMPLE_SECONDS = 0.05
POLL_SECONDS = 0.01
NA = "\u2013"  # an en dash: no figure
CLK_TCK = os.sysconf("SC_CLK_TCK")
# Jobs per drain (full, quick): the slow peers get smaller queues so a run stays short; the
# rate is per system, so sizes may differ. ``worker_before`` drains as many as ``worker``: the
# A/B compares client CPU per delivery, and a drain's fixed costs (start, idle exit) are divided
# by its jobs.
SIZES = {
    "django_tasks_db": (1_000, 200),
    "procrastinate": (2_000, 400),
    "raw_single": (4_000, 1_000),
    "ours_single": (3_000, 800),
    "ours_single_prepared": (3_000, 800),
}
DEFAULT_SIZE = (12_000, 2_500)


def jobs_per_drain(bench: Bench, system: str) -> int:
    """The queue one drain of ``system`` empties: ``--peer-jobs`` for the systems of the default
    size (a fast machine drains 12,000 in about a second, where process start jitter weighs), else
    its size in this form of the run."""
    if bench.peer_jobs and system not in SIZES:
        return bench.peer_jobs
    return SIZES.get(system, DEFAULT_SIZE)[1 if bench.quick else 0]


# The systems run by the pool of another source tree (BENCH_BEFORE_ROOT), and what each runs there.
BEFORE_SYSTEMS = {"worker_before": "worker", "worker_async_before": "worker_async"}
PREPARED = "_prepared"  # a system name ending so runs on a URL with ?prepare_threshold=5
# --quick without --peers: the headline systems only (about a minute on 2 cores).
QUICK_SYSTEMS = (
    "raw_batch",
    "raw_batch50",
    "raw_single",
    "worker",
    "pgqueuer",
    "pgqueuer_tuned",
    "procrastinate",
    "django_tasks_db",
)
ALL_SYSTEMS = (
    "raw_batch",
    "raw_batch50",
    "raw_single",
    "ours_batch",
    "ours_single",
    "worker",
    "worker_before",
    "worker_async",
    "worker_async_before",
    "worker_prepared",
    "ours_batch_prepared",
    "ours_single_prepared",
    "pgqueuer",
    "pgqueuer_tuned",
    "procrastinate",
    "django_tasks_db",
)
LABELS = {
    "raw_batch": "raw psycopg batch floor (claim 16, settle 16)",
    "raw_batch50": "raw psycopg batch floor (claim 50, settle 50, the worker's batch)",
    "raw_single": "raw psycopg one-row floor (claim + fenced finish)",
    "ours_batch": "claim_deliveries(50) -> finish_deliveries",
    "ours_single": "claim_delivery -> finish_delivery",
    "worker": "**run_worker** (run_delivery_worker defaults; concurrency 16, batch 50)",
    "worker_before": "run_worker before (BENCH_BEFORE_ROOT)",
    "worker_prepared": "run_worker, prepare_threshold=5",
    "worker_async": "run_worker, `async def` no-op handler (50 tasks on its loop, batch 50)",
    "worker_async_before": "run_worker before (BENCH_BEFORE_ROOT), `async def` no-op handler",
    "worker_batch16": "run_worker, batch 16",
    "worker_pairs50": "run_worker, 50 (community, target) pairs per process",
    "ours_batch_prepared": "claim_deliveries(50) -> finish_deliveries, prepare_threshold=5",
    "ours_single_prepared": "claim_delivery -> finish_delivery, prepare_threshold=5",
    "pgqueuer": "PgQueuer (batch 10, psycopg, drain mode)",
    "pgqueuer_tuned": "PgQueuer tuned as its guide advises (batch 50, asyncpg, drain mode)",
    "procrastinate": "procrastinate (concurrency 16)",
    "django_tasks_db": "django-tasks-db (db_worker --batch)",
}


@dataclass
class Runs:
    """The drains of one system at one K."""

    rates: list[float] = field(default_factory=list)
    server_us: list[float] = field(default_factory=list)
    client_us: list[float] = field(default_factory=list)
    commits: list[float] = field(default_factory=list)
    statements: list[float] = field(default_factory=list)


def _available(system: str) -> bool:
    module = {
        "pgqueuer": "pgqueuer",
        "pgqueuer_tuned": "asyncpg",
        "procrastinate": "procrastinate",
        "django_tasks_db": "django_tasks_db",
    }.get(system)
    if system in BEFORE_SYSTEMS:
        return bool(os.environ.get("BENCH_BEFORE_ROOT"))
    return module is None or find_spec(module) is not None


# --- queues of each system -----------------------------------------------------------------------


class Queues:
    """Creates, empties and fills each system's queue; says whether it still holds work."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.conn = bench.conn
        self.tenant: data.Tenant | None = None
        self._procrastinate: Any = None
        self._tasks_table = ""

    def prepare(self, systems: list[str]) -> None:
        data.reset(self.conn)
        (self.tenant,) = data.create_tenants(1)
        if any(s.startswith("pgqueuer") for s in systems) and self._regclass("pgqueuer") is None:
            asyncio.run(self._pgqueuer_install())
        if "procrastinate" in systems:
            from bench.peer_tasks import procrastinate_app

            self._procrastinate = procrastinate_app(self.bench.url)
            if self._regclass("procrastinate_jobs") is None:
                with self._procrastinate.open():
                    self._procrastinate.schema_manager.apply_schema()
        if "django_tasks_db" in systems:
            from django_tasks_db.models import DBTaskResult

            self._tasks_table = DBTaskResult._meta.db_table

    def _regclass(self, name: str) -> Any:
        return self.conn.execute("SELECT to_regclass(%s)", [name]).fetchone()[0]

    async def _pgqueuer_install(self) -> None:
        from pgqueuer.db import PsycopgDriver
        from pgqueuer.queries import Queries

        aconn = await psycopg.AsyncConnection.connect(self.bench.url, autocommit=True)
        try:
            await Queries(PsycopgDriver(aconn)).install()
        finally:
            await aconn.close()

    async def _pgqueuer_load(self, n: int) -> None:
        from pgqueuer.db import PsycopgDriver
        from pgqueuer.queries import Queries

        aconn = await psycopg.AsyncConnection.connect(self.bench.url, autocommit=True)
        try:
            queries = Queries(PsycopgDriver(aconn))
            for start in range(0, n, 1000):
                size = min(1000, n - start)
                await queries.enqueue(["bench"] * size, [None] * size, [0] * size)
        finally:
            await aconn.close()

    def load(self, system: str, n: int) -> None:
        conn = self.conn
        assert self.tenant is not None
        data.clear_deliveries(conn)
        if system.startswith("pgqueuer"):
            conn.execute("TRUNCATE pgqueuer, pgqueuer_log")
            asyncio.run(self._pgqueuer_load(n))
            conn.execute("VACUUM ANALYZE pgqueuer")
        elif system == "procrastinate":
            conn.execute("TRUNCATE procrastinate_jobs CASCADE")
            task = self._procrastinate.tasks["bench_noop"]
            with self._procrastinate.open():
                for start in range(0, n, 1000):
                    task.batch_defer(*({} for _ in range(min(1000, n - start))))
            conn.execute("VACUUM ANALYZE procrastinate_jobs")
        elif system == "django_tasks_db":
            from bench.peer_tasks import noop_task

            conn.execute(f"TRUNCATE {self._tasks_table}")
            noop_task.enqueue()
            columns = [
                r[0]
                for r in conn.execute(
                    "SELECT column_name FROM information_schema.columns WHERE table_name = %s AND column_name <> 'id'",
                    [self._tasks_table],
                )
            ]
            cols = ", ".join(columns)
            conn.execute(
                f"INSERT INTO {self._tasks_table} (id, {cols}) SELECT gen_random_uuid(), {cols}"
                f" FROM {self._tasks_table}, generate_series(1, %s)",
                [n - 1],
            )
            conn.execute(f"VACUUM ANALYZE {self._tasks_table}")
        else:
            table = RAW_TABLE if system.startswith("raw") else data.OURS
            targets = PAIRS if system == "worker_pairs50" else 1
            data.load(conn, self.tenant, n, table=table, targets=targets)
            data.analyze(conn)
        conn.execute("CHECKPOINT")

    def busy_sql(self, system: str) -> str:
        """A query that says whether the queue still holds work that is not done."""
        if system.startswith("pgqueuer"):
            return "SELECT EXISTS (SELECT 1 FROM pgqueuer)"
        if system == "procrastinate":
            return "SELECT EXISTS (SELECT 1 FROM procrastinate_jobs WHERE status IN ('todo', 'doing'))"
        if system == "django_tasks_db":
            return f"SELECT EXISTS (SELECT 1 FROM {self._tasks_table} WHERE status IN ('READY', 'RUNNING'))"
        table = RAW_TABLE if system.startswith("raw") else data.OURS
        return f"SELECT EXISTS (SELECT 1 FROM {table} WHERE status IN ('pending', 'claimed'))"

    def check_done(self, system: str, n: int) -> None:
        """Every job done exactly once (ours: each row finished at generation 1)."""
        if system in ("pgqueuer", "pgqueuer_tuned", "procrastinate", "django_tasks_db"):
            return
        table = RAW_TABLE if system.startswith("raw") else data.OURS
        done, once = self.conn.execute(
            f"SELECT count(*) FILTER (WHERE status = 'finished'), count(*) FILTER (WHERE lease_generation = 1)"
            f" FROM {table}"
        ).fetchone()
        if done != n or once != n:
            raise RuntimeError(f"{system}: {done} of {n} finished, {once} claimed exactly once")


# --- measuring one drain -------------------------------------------------------------------------


def _ticks(pid: int) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)


class Watcher(threading.Thread):
    """Polls until the queue is empty (``done_at``) and samples the backends' CPU of the bench
    database, on a connection of its own whose backend is left out."""

    def __init__(self, url: str, busy_sql: str) -> None:
        super().__init__(daemon=True)
        self.conn = env.connect(url)
        self.own = self.conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        self.busy_sql = busy_sql
        self.queries = 1
        self.first: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.done_at: float | None = None
        self.halt = threading.Event()
        self.sample(initial=True)

    def sample(self, initial: bool = False) -> None:
        pids = [
            r[0]
            for r in self.conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        ]
        self.queries += 1
        for pid in pids:
            ticks = _ticks(pid)
            if ticks is None:
                continue
            self.first.setdefault(pid, ticks if initial else 0)
            self.last[pid] = ticks

    def run(self) -> None:
        next_sample = time.monotonic()
        while not self.halt.is_set():
            now = time.monotonic()
            if now >= next_sample:
                self.sample()
                next_sample = now + SAMPLE_SECONDS
            if self.done_at is None:
                busy = self.conn.execute(self.busy_sql).fetchone()[0]
                self.queries += 1
                if not busy:
                    self.done_at = time.monotonic()
            time.sleep(POLL_SECONDS)

    def server_seconds(self, exclude: set[int]) -> float:
        return sum(self.last[p] - self.first[p] for p in self.last if p not in exclude) / CLK_TCK

    def close(self) -> None:
        self.halt.set()
        self.join()
        self.sample()
        self.conn.close()


def _commits(url: str) -> int:
    with env.connect(url) as conn:
        return conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()[0]


def drain_once(bench: Bench, queues: Queues, pool: PeerPool, system: str, k: int, n: int) -> dict[str, float]:
    queues.load(system, n)
    assert queues.tenant is not None
    controller = bench.conn.execute("SELECT pg_backend_pid()").fetchone()[0]
    before = _commits(bench.url)
    watcher = Watcher(bench.url, queues.busy_sql(system))
    watcher.start()
    start_at = pool.submit(system, queues.tenant.community_id, data.target(0), k)
    results = pool.gather(k)
    give_up_at = time.monotonic() + 5
    while watcher.done_at is None and time.monotonic() < give_up_at:
        time.sleep(POLL_SECONDS)
    watcher.close()
    if watcher.done_at is None:
        raise RuntimeError(f"{system}: the queue was not empty when its workers stopped")
    time.sleep(0.3)  # the backends of the drain have exited: their statistics are flushed
    commits = _commits(bench.url) - before - watcher.queries - 1
    queues.check_done(system, n)
    statements = [r.statements for r in results]
    return {
        "rate": n / (watcher.done_at - start_at),
        "server_us": watcher.server_seconds({controller}) / n * 1e6,
        "client_us": sum(r.cpu for r in results) / n * 1e6,
        "commits": commits / n,
        "statements": sum(statements) / n if all(s is not None for s in statements) else float("nan"),  # type: ignore[misc]
    }


# --- the scenario ----------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    values = [v for v in values if v == v]  # drop NaN
    return statistics.median(values) if values else float("nan")


def _fmt(value: float, digits: int = 0) -> str:
    if value != value:
        return NA
    return f"{value:,.{digits}f}"


def table(runs: dict[tuple[str, int], Runs], systems: list[str]) -> str:
    """The results table: rate per K with min-max, ratios and the per-delivery profile."""
    med = {key: _median(r.rates) for key, r in runs.items()}

    def ratio(system: str, k: int, ref: str) -> str:
        a, b = med.get((system, k), float("nan")), med.get((ref, k), float("nan"))
        return f"{a / b:.2f}x" if a == a and b == b and b else NA

    rows = []
    for system in systems:
        row: list[str] = [LABELS[system]]
        for k in KS:
            r = runs.get((system, k))
            row.append(f"{_fmt(med[(system, k)])} ({_fmt(min(r.rates))}-{_fmt(max(r.rates))})" if r and r.rates else NA)
        for ref in ("pgqueuer", "pgqueuer_tuned", "raw_batch", "raw_batch50", "raw_single"):
            row.append(" / ".join(ratio(system, k, ref) for k in KS))
        for attr, digits in (("server_us", 0), ("client_us", 0), ("statements", 2), ("commits", 2)):
            row.append(" / ".join(_fmt(_median(getattr(runs[(system, k)], attr)), digits) for k in KS))
        rows.append(row)
    headers = [
        "system",
        *(f"K={k} /s (min-max)" for k in KS),
        "vs PgQueuer (K=1 / K=4)",
        "vs PgQueuer tuned",
        "vs raw batch floor",
        "vs raw batch-50 floor",
        "vs raw one-row floor",
        "server CPU µs/delivery (K=1 / K=4)",
        "client CPU µs/delivery",
        "statements/delivery",
        "commits/delivery",
    ]
    return tabulate(rows, headers=headers, tablefmt="github")


def _base(system: str) -> str:
    """What the pool process runs: ``worker_before`` and ``*_prepared`` run the plain system,
    ``worker_async_before`` runs ``worker_async``."""
    if system in BEFORE_SYSTEMS:
        return BEFORE_SYSTEMS[system]
    return system.removesuffix(PREPARED)


def _pool_of(system: str) -> str:
    if system in BEFORE_SYSTEMS:
        return "before"
    return "prepared" if system.endswith(PREPARED) else "main"


def _with_prepare(url: str) -> str:
    return url + ("&" if "?" in url else "?") + "prepare_threshold=5"


def run(bench: Bench) -> None:
    wanted = list(bench.peers or (QUICK_SYSTEMS if bench.quick else ALL_SYSTEMS))
    systems = [s for s in wanted if _available(s)]
    for s in sorted(set(wanted) - set(systems)):
        print(f"peers: {s} is not installed (pip install -e '.[bench]') or not configured; left out", flush=True)
    queues = Queues(bench)
    queues.prepare(systems)
    runs: dict[tuple[str, int], Runs] = {(s, k): Runs() for s in systems for k in KS}
    with contextlib.ExitStack() as stack:
        pools: dict[str, PeerPool] = {"main": stack.enter_context(PeerPool(bench.url, max(KS)))}
        if any(s in BEFORE_SYSTEMS for s in systems):
            pools["before"] = stack.enter_context(PeerPool(bench.url, max(KS), os.environ["BENCH_BEFORE_ROOT"]))
            print(f"peers: worker_before imports {pools['before'].package}", flush=True)
        if any(s.endswith(PREPARED) for s in systems):
            pools["prepared"] = stack.enter_context(PeerPool(_with_prepare(bench.url), max(KS)))
        for repeat in range(bench.repeats):
            shift = repeat % len(systems)
            order = systems[shift:] + systems[:shift]
            for k in KS if repeat % 2 == 0 else tuple(reversed(KS)):
                for system in order:
                    n = jobs_per_drain(bench, system)
                    m = drain_once(bench, queues, pools[_pool_of(system)], _base(system), k, n)
                    r = runs[(system, k)]
                    for key, value in m.items():
                        getattr(r, key if key != "rate" else "rates").append(value)
                    print(
                        f"peers: {system} K={k} n={n}: {m['rate']:,.0f}/s server {m['server_us']:,.0f} µs "
                        f"client {m['client_us']:,.0f} µs statements {m['statements']:.2f} "
                        f"commits {m['commits']:.2f} per delivery",
                        flush=True,
                    )
    text = table(runs, systems)
    sizes = ", ".join(f"{s} {jobs_per_drain(bench, s):,}" for s in systems)
    bench.report.section(
        "Peers: no-op drain, K processes, interleaved",
        text + f"\n\nMedian of {bench.repeats} drain(s) per cell; jobs per drain: {sizes}. "
        "Server CPU: the bench database's backends (from /proc); client CPU: the draining processes.",
    )
