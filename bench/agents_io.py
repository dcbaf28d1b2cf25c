"""I/O-bound agent runs (issue 29): each run makes 3 journaled calls that each wait 0.5 s (a
model or tool call), with 64, 256 and 1,000 runs in flight; runs/s and the peak number of
database connections, for the event-loop worker (``run_agent_worker --async``: one process,
4 connections), the threaded ``AgentWorker`` (64 handler threads, one connection each) and DBOS
Transact's async workflow of 3 async steps on the same shape (``bench/dbos_agents_io.py``, run
by ``--dbos-python``, which must have ``dbos``), in the same run on the same PostgreSQL.

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5433/bench_fio /work/venv/bin/python -m bench.agents_io
    ... -m bench.agents_io --in-flight 64,256 --call-seconds 0.5 --runs-per-slot 2

Each figure drains ``runs-per-slot x in-flight`` runs (at least 128). Peak connections: the most
sessions on the figure's database seen by a sampler every 20 ms (the sampler connects to
``postgres``). Our databases: the bench's (created, name must start with ``bench_f``); DBOS's:
its name + ``_dbos``. Prints a Markdown table and writes ``bench/results/agents_io.md``
(``agents_io_noop.md`` with ``--call-seconds 0``: no-op calls, the runtime's own cost).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
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


def _runs(n: int) -> tuple[Any, bytes]:
    community = CommunityFactory()
    agent = os.urandom(32)
    for _ in range(n):
        intake_event(community.id, "bench", uuid.uuid4().hex, {}, agent, timeout_seconds=3600)
    connections.close_all()  # the measured worker's connections only, from here on
    return community, agent


def ours_async(n: int, in_flight: int, conns: int) -> tuple[float, int]:
    community, agent = _runs(n)
    worker = AsyncAgentWorker(
        AsyncWorkerConfig(
            handler=async_three, agents=[agent], communities=[community.id], in_flight=in_flight,
            connections=conns, lease_seconds=60, poll_seconds=0.05, exit_when_idle=True, listen=False,
            worker_id="bench-aio",
        )
    )  # fmt: skip
    with Peak(URL, urlsplit(URL).path.lstrip("/")) as peak:
        started = time.perf_counter()
        counts = worker.run()
        elapsed = time.perf_counter() - started
    assert counts.get("completed") == n, counts
    return n / elapsed, peak.peak


def ours_threads(n: int, k: int) -> tuple[float, int]:
    community, agent = _runs(n)
    worker = AgentWorker(
        WorkerConfig(
            handler=sync_three, agents=[agent], communities=[community.id], concurrency=k, lease_seconds=60,
            poll_seconds=0.05, exit_when_idle=True, listen=False, worker_id="bench-threads",
        )
    )  # fmt: skip
    with Peak(URL, urlsplit(URL).path.lstrip("/")) as peak:
        started = time.perf_counter()
        counts = worker.run()
        elapsed = time.perf_counter() - started
    assert counts.get("completed") == n, counts
    return n / elapsed, peak.peak


def dbos(python: str, url: str, n: int, in_flight: int) -> tuple[float, int] | None:
    name = urlsplit(url).path.lstrip("/")
    try:
        with Peak(URL, name) as peak:
            out = subprocess.run(
                [python, str(ROOT / "bench" / "dbos_agents_io.py"), url.replace("postgres://", "postgresql://"),
                 str(n), str(in_flight), str(CALL_SECONDS)],
                capture_output=True, text=True, timeout=900, check=True,
            )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"DBOS skipped: {exc} {getattr(exc, 'stderr', '')[-2000:]}", file=sys.stderr)
        return None
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["runs"] / r["seconds"], peak.peak


def main() -> None:
    global CALL_SECONDS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-flight", default="64,256,1000")
    parser.add_argument("--connections", type=int, default=4)
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
    for in_flight in [int(x) for x in args.in_flight.split(",")]:
        n = max(128, args.runs_per_slot * in_flight)
        aio = ours_async(n, in_flight, args.connections)
        print(
            f"ours --async in_flight={in_flight} runs={n}: {aio[0]:.1f} runs/s, peak {aio[1]} connections", flush=True
        )
        threads = ours_threads(n, in_flight) if in_flight <= 64 else None
        if threads:
            print(f"ours threads={in_flight}: {threads[0]:.1f} runs/s, peak {threads[1]} connections", flush=True)
        peer = dbos(args.dbos_python, dbos_url, n, in_flight)
        if peer:
            print(f"DBOS in_flight={in_flight}: {peer[0]:.1f} runs/s, peak {peer[1]} connections", flush=True)
        rows.append((in_flight, n, aio, threads, peer))

    def cell(x: tuple[float, int] | None) -> str:
        return "—" if x is None else f"{x[0]:.1f} / {x[1]}"

    lines = [
        f"I/O-bound agent runs: 3 journaled calls of {CALL_SECONDS} s each ({os.cpu_count()} cores, same run, "
        f"same PostgreSQL); runs/s / peak DB connections",
        "",
        f"| in flight | runs | ours --async ({args.connections} conns) | ours threaded AgentWorker "
        "| DBOS async workflow, 3 async steps | ours / DBOS |",
        "|---|---|---|---|---|---|",
        *[
            f"| {f} | {n} | {cell(a)} | {cell(t)} | {cell(p)} | {'—' if not p else f'{a[0] / p[0]:.2f}x'} |"
            for f, n, a, t, p in rows
        ],
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    # No-op calls (--call-seconds 0: the runtime's own cost, issue 29) keep a file of their own.
    name = "agents_io_noop.md" if CALL_SECONDS == 0 else "agents_io.md"
    (ROOT / "bench" / "results" / name).write_text(text)


if __name__ == "__main__":
    main()
