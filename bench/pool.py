"""A pool of worker processes, each with Django set up on the benchmark database and its own
connections, that run one timed claim/settle loop per task.

Processes are started once (``spawn``) and reused for every measurement of a scenario, so
Django's start-up is never timed. All processes start a task at the same ``time.monotonic()``
instant (the clock is system-wide on Linux) and stop at a deadline or when the queue is empty.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

START_DELAY = 0.3  # seconds between sending a task and its common start instant


@dataclass(frozen=True)
class Task:
    """One timed loop. ``mode``: ours_single | ours_batch (claim_deliveries + finish_deliveries) |
    ours_batch_each (claim_deliveries + finish_delivery per claim) | raw_single | raw_batch |
    raw_batch_each.

    ``batch``: claims per round trip (batched modes). ``duration``: seconds. ``stop_on_empty``:
    end the loop at the first empty claim (the queue drained). ``record``: keep each claim's
    (start instant, latency) pairs in seconds."""

    mode: str
    community_id: uuid.UUID
    target_pubkey: bytes
    duration: float
    batch: int = 1
    stop_on_empty: bool = True
    record: bool = False


@dataclass
class Result:
    """What one process did: settled deliveries, round trips, and when it ended."""

    settled: int = 0
    claims: int = 0
    empty: int = 0
    ended: float = 0.0
    samples: list[tuple[float, float]] = field(default_factory=list)


def _loop(task: Task, start_at: float, url: str, stop: Any) -> Result:
    from bench.baseline import RawClient

    # A raw connection lives for one task only (16 processes x 2 connections is already a lot).
    raw = RawClient(url, task.community_id, task.target_pubkey) if task.mode.startswith("raw") else None
    try:
        return _timed(task, start_at, raw, stop)
    finally:
        if raw is not None:
            raw.close()


def _timed(task: Task, start_at: float, raw: Any, stop: Any) -> Result:
    from buzz_delivery import services

    result = Result()
    deadline = start_at + task.duration
    while time.monotonic() < start_at:
        time.sleep(0.001)
    now = time.monotonic()
    while now < deadline and not stop.is_set():
        if task.mode == "ours_single":
            claim = services.claim_delivery(task.community_id, task.target_pubkey)
            done = time.monotonic()
            claims = [claim] if claim is not None else []
            for c in claims:
                services.finish_delivery(c.lease, "finished")
        elif task.mode == "ours_batch":
            claims = services.claim_deliveries(task.community_id, task.target_pubkey, limit=task.batch)
            done = time.monotonic()
            if claims:
                services.finish_deliveries([c.lease for c in claims])
        elif task.mode == "ours_batch_each":
            claims = services.claim_deliveries(task.community_id, task.target_pubkey, limit=task.batch)
            done = time.monotonic()
            for c in claims:
                services.finish_delivery(c.lease, "finished")
        elif task.mode == "raw_single":
            claims = raw.claim(1)
            done = time.monotonic()
            for c in claims:
                raw.finish(*c)
        elif task.mode == "raw_batch":
            claims = raw.claim(task.batch)
            done = time.monotonic()
            if claims:
                raw.finish_batch(claims)
        elif task.mode == "raw_batch_each":
            claims = raw.claim(task.batch)
            done = time.monotonic()
            for c in claims:
                raw.finish(*c)
        else:
            raise ValueError(f"unknown mode {task.mode!r}")
        if task.record:
            result.samples.append((now, done - now))
        result.claims += 1
        result.settled += len(claims)
        if not claims:
            result.empty += 1
            if task.stop_on_empty:
                break
            time.sleep(0.001)
        now = time.monotonic()
    result.ended = time.monotonic()
    return result


def _worker_main(url: str, tasks: Any, results: Any, stop: Any) -> None:
    from bench import env

    env.setup_django(url)
    from django.db import connection

    connection.ensure_connection()
    results.put("ready")
    while True:
        item = tasks.get()
        if item is None:
            break
        task, start_at = item
        try:
            results.put(_loop(task, start_at, url, stop))
        except Exception as exc:  # reported to the controller, which raises it
            results.put(exc)
    connection.close()


@dataclass(frozen=True)
class Measurement:
    """A task's outcome over all processes. ``elapsed``: seconds from the common start to the
    last process's end; ``rate``: settled deliveries per second."""

    settled: int
    claims: int
    elapsed: float
    results: tuple[Result, ...]

    @property
    def rate(self) -> float:
        return self.settled / self.elapsed if self.elapsed > 0 else 0.0


class WorkerPool:
    """``n`` worker processes; use as a context manager, then :meth:`run` tasks on all of them."""

    def __init__(self, url: str, n: int):
        ctx = mp.get_context("spawn")
        self.n = n
        self._tasks = [ctx.Queue() for _ in range(n)]
        self._results = ctx.Queue()
        self._stop = ctx.Event()
        self._procs = [
            ctx.Process(target=_worker_main, args=(url, q, self._results, self._stop), daemon=True) for q in self._tasks
        ]
        self._pending: tuple[Task, int, float] | None = None

    def __enter__(self) -> WorkerPool:
        for proc in self._procs:
            proc.start()
        for _ in self._procs:
            msg = self._results.get(timeout=120)
            if msg != "ready":
                raise RuntimeError(f"worker failed to start: {msg!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        for q in self._tasks:
            q.put(None)
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()

    def run(self, task: Task, *, processes: int | None = None) -> Measurement:
        """Run ``task`` on ``processes`` (default all) workers at once and gather the results."""
        self.submit(task, processes=processes)
        return self.gather()

    def submit(self, task: Task, *, processes: int | None = None) -> float:
        """Start ``task`` without waiting; returns the common start instant (``time.monotonic()``)."""
        count = processes or self.n
        start_at = time.monotonic() + START_DELAY
        self._stop.clear()
        for q in self._tasks[:count]:
            q.put((task, start_at))
        self._pending = (task, count, start_at)
        return start_at

    def run_each(self, tasks: list[Task]) -> Measurement:
        """Run ``tasks[i]`` on worker ``i``, all at once (e.g. one community per process)."""
        if len(tasks) > self.n:
            raise ValueError(f"{len(tasks)} tasks for {self.n} workers")
        start_at = time.monotonic() + START_DELAY
        self._stop.clear()
        for q, task in zip(self._tasks, tasks, strict=False):
            q.put((task, start_at))
        self._pending = (max(tasks, key=lambda t: t.duration), len(tasks), start_at)
        return self.gather()

    def stop(self) -> None:
        """Ask the running task to end now."""
        self._stop.set()

    def gather(self) -> Measurement:
        """Wait for the submitted task's results."""
        assert self._pending is not None, "nothing submitted"
        task, count, start_at = self._pending
        self._pending = None
        results = []
        for _ in range(count):
            item = self._results.get(timeout=task.duration + 120)
            if isinstance(item, Exception):
                raise item
            results.append(item)
        return Measurement(
            settled=sum(r.settled for r in results),
            claims=sum(r.claims for r in results),
            elapsed=max(r.ended for r in results) - start_at,
            results=tuple(results),
        )
