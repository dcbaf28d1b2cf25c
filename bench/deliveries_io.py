"""I/O-bound delivery handlers (issue 29): every handler waits 0.5 s (a model call, a webhook),
with 64, 256 and 1,000 in flight in one worker process; deliveries/s and the peak number of
database connections, for ``run_delivery_worker`` with an ``async def`` handler (tasks on one
event loop), the same worker with a plain handler on threads (at most 256), and PgQueuer 1.6
(an async entrypoint, ``max_concurrent_tasks`` = the in-flight figure, its default batch of 10,
drain mode), in the same run on the same PostgreSQL.

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5433/bench_fdio /work/venv/bin/python -m bench.deliveries_io
    ... -m bench.deliveries_io --in-flight 64,256 --handler-seconds 0.5 --per-slot 2

PgQueuer's figure is provisional: with a queue loaded before it starts, its loop fetches one batch
per dequeue cycle and then waits for a NOTIFY or its dequeue timeout (0.3 s here), and neither a
batch of half the in-flight budget nor no cap at all filled the budget in our tries (about 10/s
at 64 in flight either way); we have not found the configuration its docs would advise for
this shape, so read the ratio as "ours against PgQueuer as configured here".

Each figure drains ``per-slot x in-flight`` jobs (at least 128). Rate: jobs / seconds from the
start to the last one done (our idle exit is not counted). Peak connections: the most client
sessions on the bench database seen every 20 ms (the sampler connects to ``postgres``). Prints a
Markdown table and writes ``bench/results/deliveries_io.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import psycopg

from bench.env import ROOT, database_url, ensure_database

URL = database_url()
os.environ["DATABASE_URL"] = URL
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection, connections  # noqa: E402

from bench.agents_io import Peak  # noqa: E402
from buzz_delivery import services  # noqa: E402
from buzz_delivery.testing import BindingFactory, CommunityFactory, EventFactory, WorkflowRunFactory  # noqa: E402
from buzz_delivery.worker import WorkerConfig, run_worker  # noqa: E402

HANDLER_SECONDS = 0.5
IDLE_EXIT = 0.5
DB_NAME = urlsplit(URL).path.lstrip("/")


async def async_wait(delivery: Any) -> None:  # the handler measured
    await asyncio.sleep(HANDLER_SECONDS)


def thread_wait(delivery: Any) -> None:  # the same wait on a handler thread
    time.sleep(HANDLER_SECONDS)


def _deliveries(n: int) -> tuple[Any, bytes]:
    community = CommunityFactory()
    target = os.urandom(32)
    run, event = WorkflowRunFactory(community=community), EventFactory(community=community)
    for start in range(0, n, 500):
        bindings = [
            BindingFactory.build(run=run, message_event=event, target_pubkey=target) for _ in range(min(500, n - start))
        ]
        services.commit_deliveries(community.id, event, bindings)
    return community, target


def _clock() -> Any:
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


def ours(n: int, in_flight: int, handler: Any) -> tuple[float, int]:
    community, target = _deliveries(n)
    started = _clock()
    connections.close_all()  # the measured worker's connections only, from here on
    config = WorkerConfig(
        community_id=community.id, target_pubkey=target, handler=handler, concurrency=in_flight,
        lease_seconds=60, idle_exit=IDLE_EXIT, poll_interval=0.05,
    )  # fmt: skip
    with Peak(URL, DB_NAME) as peak:
        summary = run_worker(config, handle_signals=False)
    assert summary["finished"] == n, dict(summary)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT max(finished_at) FROM buzz_delivery_delivery_record WHERE community_id = %s", [community.id]
        )
        ended = cursor.fetchone()[0]
    return n / (ended - started).total_seconds(), peak.peak


def pgqueuer(n: int, in_flight: int, batch_size: int = 10, cap: bool = True) -> tuple[float, int]:
    from pgqueuer import QueueManager
    from pgqueuer.db import PsycopgDriver
    from pgqueuer.queries import Queries
    from pgqueuer.types import QueueExecutionMode

    async def load() -> None:
        aconn = await psycopg.AsyncConnection.connect(URL, autocommit=True)
        try:
            queries = Queries(PsycopgDriver(aconn))
            if (await (await aconn.execute("SELECT to_regclass('pgqueuer')")).fetchone())[0] is None:
                await queries.install()
            await aconn.execute("TRUNCATE pgqueuer, pgqueuer_log")
            for start in range(0, n, 1000):
                size = min(1000, n - start)
                await queries.enqueue(["io"] * size, [None] * size, [0] * size)
        finally:
            await aconn.close()

    async def drain() -> float:
        aconn = await psycopg.AsyncConnection.connect(URL, autocommit=True)
        try:
            qm = QueueManager(Queries(PsycopgDriver(aconn)))

            @qm.entrypoint("io")
            async def wait(job: Any) -> None:
                await asyncio.sleep(HANDLER_SECONDS)

            started = time.perf_counter()
            await qm.run(
                batch_size=batch_size,
                mode=QueueExecutionMode.drain,
                max_concurrent_tasks=in_flight if cap else None,
                dequeue_timeout=timedelta(seconds=0.3),
            )
            return time.perf_counter() - started
        finally:
            await aconn.close()

    asyncio.run(load())
    with Peak(URL, DB_NAME) as peak:
        elapsed = asyncio.run(drain())
    return n / elapsed, peak.peak


def main() -> None:
    global HANDLER_SECONDS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-flight", default="64,256,1000")
    parser.add_argument("--handler-seconds", type=float, default=0.5)
    parser.add_argument("--per-slot", type=int, default=3)
    parser.add_argument("--no-pgqueuer", action="store_true")
    args = parser.parse_args()
    HANDLER_SECONDS = args.handler_seconds
    logging.getLogger("buzz_delivery.worker").setLevel(logging.WARNING)
    ensure_database(URL)
    call_command("migrate", verbosity=0)
    connections.close_all()
    rows = []
    for in_flight in [int(x) for x in args.in_flight.split(",")]:
        n = max(128, args.per_slot * in_flight)
        aio = ours(n, in_flight, async_wait)
        print(f"ours async in_flight={in_flight} n={n}: {aio[0]:.1f}/s, peak {aio[1]} connections", flush=True)
        threads = ours(n, in_flight, thread_wait) if in_flight <= 256 else None
        if threads:
            print(f"ours threads={in_flight}: {threads[0]:.1f}/s, peak {threads[1]} connections", flush=True)
        peer = None if args.no_pgqueuer else pgqueuer(n, in_flight)
        if peer:
            print(f"PgQueuer in_flight={in_flight}: {peer[0]:.1f}/s, peak {peer[1]} connections", flush=True)
        rows.append((in_flight, n, aio, threads, peer))

    def cell(x: tuple[float, int] | None) -> str:
        return "—" if x is None else f"{x[0]:.1f} / {x[1]}"

    lines = [
        f"I/O-bound delivery handlers: each waits {HANDLER_SECONDS} s ({os.cpu_count()} cores, same run, same "
        "PostgreSQL); deliveries (jobs) per second / peak DB connections",
        "",
        "| in flight | jobs | ours, async def handler | ours, plain handler on threads | PgQueuer, async entrypoint "
        "| ours async / PgQueuer |",
        "|---|---|---|---|---|---|",
        *[
            f"| {f} | {n} | {cell(a)} | {cell(t)} | {cell(p)} | {'—' if not p else f'{a[0] / p[0]:.2f}x'} |"
            for f, n, a, t, p in rows
        ],
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "bench" / "results" / "deliveries_io.md").write_text(text)


if __name__ == "__main__":
    main()
