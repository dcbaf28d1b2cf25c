"""I/O-bound workflow function steps (issue 29): every step waits 0.5 s (a model call, a
webhook), with 64, 256 and 1,000 in flight in one orchestrator; steps/s and the peak number of
database connections, for ``run_workflow_worker``'s engine with an ``async def`` function
(tasks on the one event loop, ``--async-concurrency`` = the in-flight figure, 4 step threads)
and, the baseline in the same run, the same wait in a plain function on step threads
(``--concurrency`` = the in-flight figure, at most 256), on the same PostgreSQL.

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5433/bench_fsteps_io /work/venv/bin/python -m bench.steps_io
    ... -m bench.steps_io --in-flight 64,256 --step-seconds 0.5 --per-slot 2

Each figure runs ``per-slot x in-flight`` steps (at least 128) as runs of one ``map`` step of
100 items (the map step's own two turns are not counted). Rate: element steps / seconds from the
start to the last element step's end (database clock; the idle exit is not counted). Peak
connections: the most client sessions on the bench database seen every 20 ms (the sampler
connects to ``postgres``). Prints a Markdown table and writes ``bench/results/steps_io.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from typing import Any
from urllib.parse import urlsplit

from bench.env import ROOT, database_url, ensure_database

URL = database_url()
os.environ["DATABASE_URL"] = URL
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection, connections  # noqa: E402

from bench.agents_io import Peak  # noqa: E402
from buzz_delivery.services import Cause  # noqa: E402
from buzz_delivery.testing import CommunityFactory, WorkflowFactory  # noqa: E402
from buzz_delivery.workflows import workflow_function  # noqa: E402
from buzz_delivery.workflows.orchestrator import OrchestratorConfig, run_orchestrator  # noqa: E402
from buzz_delivery.workflows.services import publish_definition, start_run  # noqa: E402

STEP_SECONDS = 0.5
IDLE_EXIT = 0.5
MAP_ITEMS = 100
BATCH_SIZE: int | None = None  # claims and completions per statement (None: the engine's default)
STEP_THREADS = 4  # beside the loop: the map steps' own turns
DB_NAME = urlsplit(URL).path.lstrip("/")


@workflow_function("bench.io.async_wait")
async def async_wait(input: dict, context: Any) -> None:  # the step measured
    await asyncio.sleep(STEP_SECONDS)


@workflow_function("bench.io.thread_wait")
def thread_wait(input: dict, context: Any) -> None:  # the same wait on a step thread
    time.sleep(STEP_SECONDS)


def _runs(n: int, function: str) -> Any:
    community = CommunityFactory()
    workflow = WorkflowFactory(community=community)
    each = {"kind": "function", "function": function, "input": {"i": {"$ref": "item"}}}
    definition = {"steps": [{"key": "each", "kind": "map", "over": {"$ref": "input.items"}, "do": each}]}
    publish_definition(community.id, workflow.id, definition)
    for start in range(0, n, MAP_ITEMS):
        items = list(range(min(MAP_ITEMS, n - start)))
        start_run(community.id, workflow.id, {"items": items}, cause=Cause.event(os.urandom(32)))
    return community


def _clock() -> Any:
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


def ours(n: int, in_flight: int, asynchronous: bool) -> tuple[float, int]:
    community = _runs(n, "bench.io.async_wait" if asynchronous else "bench.io.thread_wait")
    started = _clock()
    connections.close_all()  # the measured orchestrator's connections only, from here on
    config = OrchestratorConfig(
        community_id=community.id,
        concurrency=STEP_THREADS if asynchronous else in_flight,
        async_concurrency=in_flight,
        lease_seconds=60,
        batch_size=BATCH_SIZE,
        idle_exit=IDLE_EXIT,
        poll_interval=1.0,  # ready steps wake it by NOTIFY; the poll is the fallback
    )
    with Peak(URL, DB_NAME) as peak:
        summary = run_orchestrator(config, handle_signals=False)
    logging.getLogger("bench").info("summary %s", summary)
    assert summary["errors"] == 0 and summary["awaited"] == (n if asynchronous else 0), summary
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*), max(finished_at) FROM buzz_workflows_step"
            " WHERE community_id = %s AND map_key IS NOT NULL AND state = 'succeeded'",
            [community.id],
        )
        done, ended = cursor.fetchone()
    assert done == n, (done, n)
    return n / (ended - started).total_seconds(), peak.peak


def main() -> None:
    global STEP_SECONDS, BATCH_SIZE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-flight", default="64,256,1000")
    parser.add_argument("--step-seconds", type=float, default=0.5)
    parser.add_argument("--per-slot", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=None)
    args = parser.parse_args()
    STEP_SECONDS, BATCH_SIZE = args.step_seconds, args.batch_size
    logging.getLogger("buzz_delivery.workflows").setLevel(logging.WARNING)
    ensure_database(URL)
    call_command("migrate", verbosity=0)
    connections.close_all()
    rows = []
    for in_flight in [int(x) for x in args.in_flight.split(",")]:
        n = max(128, args.per_slot * in_flight)
        aio = ours(n, in_flight, True)
        print(f"async steps in_flight={in_flight} n={n}: {aio[0]:.1f}/s, peak {aio[1]} connections", flush=True)
        threads = ours(n, in_flight, False) if in_flight <= 256 else None
        if threads:
            print(f"plain steps threads={in_flight}: {threads[0]:.1f}/s, peak {threads[1]} connections", flush=True)
        rows.append((in_flight, n, aio, threads))

    def cell(x: tuple[float, int] | None) -> str:
        return "—" if x is None else f"{x[0]:.1f} / {x[1]}"

    lines = [
        f"I/O-bound workflow function steps: each waits {STEP_SECONDS} s ({os.cpu_count()} cores, same run, same "
        "PostgreSQL); steps per second / peak DB connections (ideal rate: in flight / step seconds)",
        "",
        "| in flight | steps | async def steps on the loop (4 step threads) | plain steps on step threads "
        "| async / plain |",
        "|---|---|---|---|---|",
        *[f"| {f} | {n} | {cell(a)} | {cell(t)} | {'—' if not t else f'{a[0] / t[0]:.2f}x'} |" for f, n, a, t in rows],
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "bench" / "results" / "steps_io.md").write_text(text)


if __name__ == "__main__":
    main()
