"""The systems of the ``peers`` scenario and the process pool that drains a queue with them.

Each system drains one queue of no-op jobs from ``K`` processes at once, until the queue is
empty. Processes are started once (``spawn``, Django set up with :mod:`bench.settings`) and
reused, so no start-up is timed; each drain opens its connections and closes them all at its
end (so the server's statistics of those sessions are flushed and counted).

Systems (``SYSTEMS``):

- ``raw_single``: the raw psycopg one-row floor (claim 1 + fenced finish, :mod:`bench.baseline`);
- ``raw_batch``: the raw psycopg batch floor (claim 16, settle 16 in one statement);
- ``raw_batch50``: the same at our worker's batch (claim 50, settle 50), the floor issue 31
  compares the worker with;
- ``ours_single``: ``services.claim_delivery -> finish_delivery``;
- ``ours_batch``: ``services.claim_deliveries(50) -> finish_deliveries``;
- ``worker``: ``run_worker`` (what ``run_delivery_worker`` runs), no-op handler, concurrency 16,
  the default batch size (50; ``worker_batch16``: batch 16, the default before issue 16's second
  pass; ``worker_pairs50``: each process serves 50 targets, the queue spread over them);
  ``worker_before``: the same from another source tree (``BENCH_BEFORE_ROOT``);
- ``pgqueuer``: PgQueuer's ``QueueManager.run(mode=drain, batch_size=10)``, psycopg driver;
- ``pgqueuer_tuned``: PgQueuer as its performance guide advises for short jobs: batch 50 on the
  asyncpg driver (its faster one);
- ``procrastinate``: procrastinate's ``run_worker(wait=False)``, concurrency 16;
- ``django_tasks_db``: django-tasks-db's ``db_worker`` loop in batch mode.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

START_DELAY = 0.3  # seconds between sending a drain and its common start instant
WORKER_CONCURRENCY = 16
WORKER_ASYNC_CONCURRENCY = 50  # worker_async: tasks in flight on the loop, as many as a claim holds
WORKER_BATCH: int | None = None  # the worker's default (buzz_delivery.worker.runtime.DEFAULT_BATCH_SIZE)
RAW_BATCH = 16
RAW_BATCH50 = 50  # raw_batch50: the worker's default batch (issue 31)
OURS_BATCH = 50
PGQUEUER_BATCH = 10
PGQUEUER_TUNED_BATCH = 50
PAIRS = 50  # worker_pairs50: (community, target) pairs served by each process
PROCRASTINATE_CONCURRENCY = 16
IDLE_EXIT = 0.3  # seconds our worker waits on an empty queue before it stops


@dataclass(frozen=True)
class Drain:
    """One drain in one process: ``system``, the tenant's ids, and the common start instant."""

    system: str
    community_id: uuid.UUID
    target_pubkey: bytes
    start_at: float


@dataclass
class DrainResult:
    """What one process did: ``cpu`` seconds (user + system, all threads), ``statements`` sent
    (None when the system does not say), when it ``ended`` (monotonic)."""

    cpu: float = 0.0
    statements: int | None = None
    ended: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --- the systems (each runs inside a pool process) ---------------------------------------------


def _raw(drain: Drain, url: str, batch: int) -> int:
    from bench.baseline import RawClient

    raw = RawClient(url, drain.community_id, drain.target_pubkey)
    statements = 0
    try:
        while True:
            claims = raw.claim(batch)
            statements += 1
            if not claims:
                return statements
            if batch == 1:
                for c in claims:
                    raw.finish(*c)
                    statements += 1
            else:
                raw.finish_batch(claims)
                statements += 1
    finally:
        raw.close()


def _ours(drain: Drain, batch: int) -> int:
    from buzz_delivery import services

    statements = 0
    while True:
        if batch == 1:
            claim = services.claim_delivery(drain.community_id, drain.target_pubkey)
            claims = [claim] if claim is not None else []
        else:
            claims = services.claim_deliveries(drain.community_id, drain.target_pubkey, limit=batch)
        statements += 1
        if not claims:
            return statements
        if batch == 1:
            services.finish_delivery(claims[0].lease, "finished")
        else:
            services.finish_deliveries([c.lease for c in claims])
        statements += 1


def _worker(
    drain: Drain, batch: int | None = WORKER_BATCH, pairs: int = 1, is_async: bool = False
) -> tuple[int, dict[str, Any]]:
    from bench import data
    from bench.handlers import anoop, noop
    from buzz_delivery.worker import WorkerConfig, run_worker

    summary = run_worker(
        WorkerConfig(
            community_id=drain.community_id,
            target_pubkey=drain.target_pubkey,
            handler=anoop if is_async else noop,
            concurrency=WORKER_ASYNC_CONCURRENCY if is_async else WORKER_CONCURRENCY,
            batch_size=batch,
            poll_interval=0.5,
            idle_exit=IDLE_EXIT,
            extra_pairs=tuple((drain.community_id, data.target(i)) for i in range(1, pairs)),
        ),
        handle_signals=False,
    )
    counts = dict(summary)
    statements = counts.get("claim_statements", 0) + counts.get("settle_statements", 0)
    return statements, counts


def _pgqueuer(url: str, batch: int = PGQUEUER_BATCH, driver: str = "psycopg") -> None:
    import asyncio
    from datetime import timedelta

    import psycopg
    from pgqueuer import QueueManager
    from pgqueuer.db import PsycopgDriver
    from pgqueuer.queries import Queries
    from pgqueuer.types import QueueExecutionMode

    async def main() -> None:
        if driver == "asyncpg":
            import asyncpg
            from pgqueuer.db import AsyncpgDriver

            conn: Any = await asyncpg.connect(url.replace("postgres://", "postgresql://").split("?")[0])
            qm = QueueManager(Queries(AsyncpgDriver(conn)))
        else:
            conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
            qm = QueueManager(Queries(PsycopgDriver(conn)))
        try:

            @qm.entrypoint("bench")
            async def noop(job: Any) -> None:
                return None

            await qm.run(
                batch_size=batch,
                mode=QueueExecutionMode.drain,
                dequeue_timeout=timedelta(seconds=0.3),
            )
        finally:
            await conn.close()

    asyncio.run(main())


def _procrastinate(url: str) -> None:
    from bench.peer_tasks import procrastinate_app

    app = procrastinate_app(url)
    app.run_worker(queues=["bench"], concurrency=PROCRASTINATE_CONCURRENCY, wait=False, install_signal_handlers=False)


def _django_tasks_db() -> None:
    from django_tasks_db.management.commands.db_worker import Worker

    Worker(
        queue_names=["default"],
        interval=0,
        batch=True,
        backend_name="default",
        startup_delay=False,
        max_tasks=None,
        worker_id=f"bench-{os.getpid()}",
        excluded_queue_names=[],
    ).run()


def run_drain(drain: Drain, url: str) -> DrainResult:
    """Wait for the common start, drain with ``drain.system``, close every connection."""
    from django.db import connections

    while time.monotonic() < drain.start_at:
        time.sleep(0.001)
    result = DrainResult()
    started = _cpu()
    try:
        system = drain.system
        if system == "raw_single":
            result.statements = _raw(drain, url, 1)
        elif system == "raw_batch":
            result.statements = _raw(drain, url, RAW_BATCH)
        elif system == "raw_batch50":
            result.statements = _raw(drain, url, RAW_BATCH50)
        elif system == "ours_single":
            result.statements = _ours(drain, 1)
        elif system == "ours_batch":
            result.statements = _ours(drain, OURS_BATCH)
        elif system in ("worker", "worker_before"):
            result.statements, result.extra = _worker(drain)
            if not result.statements:
                result.statements = None  # an older worker does not count its statements
        elif system == "worker_async":
            result.statements, result.extra = _worker(drain, is_async=True)
        elif system == "worker_batch16":
            result.statements, result.extra = _worker(drain, 16)
        elif system == "worker_pairs50":
            result.statements, result.extra = _worker(drain, pairs=PAIRS)
        elif system == "pgqueuer":
            _pgqueuer(url)
        elif system == "pgqueuer_tuned":
            _pgqueuer(url, PGQUEUER_TUNED_BATCH, "asyncpg")
        elif system == "procrastinate":
            _procrastinate(url)
        elif system == "django_tasks_db":
            _django_tasks_db()
        else:
            raise ValueError(f"unknown system {system!r}")
    finally:
        result.ended = time.monotonic()
        connections.close_all()
        result.cpu = _cpu() - started
    return result


# --- the pool ----------------------------------------------------------------------------------


def _main(url: str, source_root: str | None, tasks: Any, results: Any) -> None:
    if source_root:  # another tree's buzz_delivery (the "before" of a comparison) comes first
        sys.path.insert(0, source_root)
    from bench import env

    env.setup_django(url)
    import buzz_delivery

    results.put(("ready", str(Path(buzz_delivery.__file__).resolve().parent)))
    while (drain := tasks.get()) is not None:
        try:
            results.put(run_drain(drain, url))
        except BaseException as exc:  # reported to the controller, which raises it
            results.put(RuntimeError(f"{drain.system}: {type(exc).__name__}: {exc}"))


class PeerPool:
    """``n`` processes; ``source_root``: a folder holding another ``buzz_delivery`` package to
    import instead of this tree's. Use as a context manager."""

    def __init__(self, url: str, n: int, source_root: str | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.n = n
        self.package = ""
        self._tasks = [ctx.Queue() for _ in range(n)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_main, args=(url, source_root, q, self._results), daemon=True) for q in self._tasks
        ]

    def __enter__(self) -> PeerPool:
        for proc in self._procs:
            proc.start()
        for _ in self._procs:
            msg = self._results.get(timeout=120)
            if not (isinstance(msg, tuple) and msg[0] == "ready"):
                raise RuntimeError(f"peer process failed to start: {msg!r}")
            self.package = msg[1]
        return self

    def __exit__(self, *exc: object) -> None:
        for q in self._tasks:
            q.put(None)
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()

    def submit(self, system: str, community_id: uuid.UUID, target: bytes, processes: int) -> float:
        """Start a drain on ``processes`` of the pool; returns the common start instant."""
        start_at = time.monotonic() + START_DELAY
        for q in self._tasks[:processes]:
            q.put(Drain(system, community_id, target, start_at))
        return start_at

    def gather(self, processes: int, timeout: float = 600) -> list[DrainResult]:
        results = []
        for _ in range(processes):
            item = self._results.get(timeout=timeout)
            if isinstance(item, Exception):
                raise item
            results.append(item)
        return results
