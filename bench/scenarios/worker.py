"""Figure 3: ``manage.py run_delivery_worker`` draining a queue with a no-op handler, 4 processes,
next to 4 raw psycopg worker loops (claim a batch, settle the batch in one statement).

The command runs as real subprocesses. Its rate is the deliveries settled divided by the span
of their ``finished_at`` (database clock), which leaves out Django's start-up and the
``--idle-exit`` wait; the wall time from launch to the last exit is printed too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import data, env
from bench.context import Bench
from bench.pool import Task, WorkerPool
from bench.report import Figure

PROCESSES = 4
CONCURRENCY = 16  # handler threads per process; --batch-size is capped by the idle threads
BATCH_SIZE = 16
IDLE_EXIT = 1.0
POLL_INTERVAL = 0.5  # polls are immediate while a backlog remains; this is the idle pace
COMMAND = Path(env.ROOT) / "buzz_delivery" / "management" / "commands" / "run_delivery_worker.py"


def command(tenant: data.Tenant, *, quiet: bool = False) -> list[str]:
    """The exact command line each worker process runs (``quiet``: ``-v 0``, no transition logs)."""
    return [
        sys.executable, str(env.ROOT / "manage.py"), "run_delivery_worker",
        "--community", str(tenant.community_id),
        "--target", data.target(0).hex(),
        "--handler", "bench.handlers:noop",
        "--concurrency", str(CONCURRENCY),
        "--batch-size", str(BATCH_SIZE),
        "--poll-interval", str(POLL_INTERVAL),
        "--idle-exit", str(IDLE_EXIT),
        *(["-v", "0"] if quiet else []),
    ]  # fmt: skip


def _drain_with_command(
    bench: Bench, tenant: data.Tenant, count: int, *, quiet: bool = False
) -> tuple[float, float, int]:
    """Returns (rate by finished_at span, wall seconds, settled)."""
    data.clear_deliveries(bench.conn)
    data.load(bench.conn, tenant, count)
    data.analyze(bench.conn)
    bench.conn.execute("CHECKPOINT")
    environ = {**os.environ, "DATABASE_URL": bench.url, "DJANGO_SETTINGS_MODULE": "project.settings"}
    with tempfile.TemporaryDirectory(prefix="bench_worker_") as tmp:
        started = time.monotonic()
        procs = []
        for i in range(PROCESSES):
            out = open(Path(tmp) / f"{i}.out", "w+")  # noqa: SIM115
            err = open(Path(tmp) / f"{i}.log", "w+")  # noqa: SIM115
            procs.append(
                (
                    subprocess.Popen(command(tenant, quiet=quiet), cwd=env.ROOT, env=environ, stdout=out, stderr=err),
                    out,
                    err,
                )
            )
        settled = 0
        for proc, out, err in procs:
            code = proc.wait(timeout=300)
            out.seek(0)
            lines = out.read().strip().splitlines()
            if code != 0 or not lines:
                err.seek(0)
                raise RuntimeError(f"run_delivery_worker exited {code}: {err.read()[-2000:]}")
            settled += json.loads(lines[-1])["finished"]
            out.close()
            err.close()
        wall = time.monotonic() - started
    span, finished = bench.conn.execute(
        "SELECT extract(epoch FROM max(finished_at) - min(finished_at)), count(*)"
        f" FROM {data.OURS} WHERE status = 'finished'"
    ).fetchone()
    if finished != count or settled != count:
        raise RuntimeError(f"worker settled {settled} (table says {finished}) of {count}")
    return count / float(span), wall, settled


def _drain_raw(bench: Bench, pool: WorkerPool, tenant: data.Tenant, count: int) -> float:
    data.clear_deliveries(bench.conn)
    data.load(bench.conn, tenant, count, table="bench_raw_delivery")
    data.analyze(bench.conn)
    bench.conn.execute("CHECKPOINT")
    result = pool.run(Task("raw_batch", tenant.community_id, data.target(0), 600.0, batch=BATCH_SIZE))
    if result.settled != count:
        raise RuntimeError(f"raw workers settled {result.settled} of {count}")
    return result.rate


def run(bench: Bench) -> None:
    if not COMMAND.exists():
        print("run_delivery_worker is not there yet; skipping figure 3", flush=True)
        return
    count = bench.scaled(20_000, 4_000)
    data.reset(bench.conn)
    (tenant,) = data.create_tenants(1)
    ours: list[float] = []
    walls: list[float] = []
    raw: list[float] = []
    with WorkerPool(bench.url, PROCESSES) as pool:
        for repeat in range(bench.repeats):
            order = ("ours", "raw") if repeat % 2 == 0 else ("raw", "ours")
            for which in order:
                if which == "ours":
                    rate, wall, _ = _drain_with_command(bench, tenant, count)
                    ours.append(rate)
                    walls.append(wall)
                else:
                    raw.append(_drain_raw(bench, pool, tenant, count))
    bench.report.add(
        Figure(
            f"3. run_delivery_worker, no-op handler, drain {count:,}",
            f"{PROCESSES} proc",
            "deliveries/s",
            ours,
            raw,
            target_value=1000,
            note=f"--concurrency {CONCURRENCY} --batch-size {BATCH_SIZE}; wall incl. start-up and "
            f"{IDLE_EXIT:g} s idle-exit: {', '.join(f'{w:.1f}' for w in walls)} s; raw: batch claim + batch settle",
        )
    )
    quiet, _, _ = _drain_with_command(bench, tenant, count, quiet=True)
    bench.report.add(
        Figure(
            "3b. the same with -v 0 (no per-transition log lines)",
            f"{PROCESSES} proc",
            "deliveries/s",
            [quiet],
            raw,
            note="1 run; shows what the INFO line per claim and per settle costs",
        )
    )
    bench.report.section(
        "Figure 3 command (one of the 4 processes)",
        "```\n" + " ".join(command(tenant)) + "\n```",
    )
