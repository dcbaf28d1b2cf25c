"""Committed transactions per delivery and per run of the in-process workers on their failure
paths (issue 29), this checkout against an older one, A/B interleaved: ``run_delivery_worker``
whose handler always raises (half the deliveries settle ``failed``, half ``retry``; each claimed
once: ``--max-deliveries`` stops the worker before a retry comes back), and ``run_agent_worker
--async`` whose runs fail after three journaled calls with compensations (so each run fails,
undoes its three calls last first and ends failed).

Run: ``BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_fX python -m bench.inproc_failures
--before-root DIR [--rounds 3] [--deliveries 400] [--runs 100]``. Each worker runs from its
checkout (its ``manage.py``, its package on ``PYTHONPATH``) on the same database. Transactions
are ``pg_stat_database.xact_commit`` of the database across the worker's life (every backend
flushes its counters when it exits; the bench's own session is closed around each read), so
they include the claims and renewals, the same for both trees. Also prints the worker's own
counts (the settler's statements; the agent batcher's batches and items). Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.gateway import commit, setup_django

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/bench_finprocbatch"

HANDLERS = """
from buzz_delivery.agents.compensations import compensation


class Poison(Exception):
    permanent = True  # settled failed


def failing(delivery):
    if delivery.id.int % 2:
        raise Poison("cannot parse")
    raise RuntimeError("try again")  # settled retry


async def _noop(args, key):
    return {"ok": True}


@compensation
async def undo(args, output, key):
    return None


async def fail_after_three(ctx):
    for i in range(3):
        await ctx.call("noop", _noop, {"i": i}, compensate=undo)
    raise RuntimeError("the fourth step is broken")
"""


def xact_commit(name: str) -> int:
    """The database's committed transactions; the session closed after (its own counters flush)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s", [name])
        value = int(cursor.fetchone()[0])
    connection.close()
    return value


def settle_quiet() -> None:
    """Let exited backends finish flushing their counters."""
    from django.db import connection

    connection.close()
    time.sleep(1.0)


def measured(name: str, root: Path, extra: Path, argv: list[str]) -> tuple[int, float, dict]:
    """Run ``manage.py argv`` from ``root``; (transactions it committed, wall seconds, summary)."""
    settle_quiet()
    before = xact_commit(name)
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{extra}", "LOG_LEVEL": "WARNING"}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "manage.py", *argv], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    wall = time.monotonic() - began
    if done.returncode != 0:
        raise SystemExit(f"{argv[0]} in {root} exited {done.returncode}: {done.stderr[-2000:]}")
    settle_quiet()
    transactions = xact_commit(name) - before - 1  # the first read's own
    summary: dict = {}
    for line in reversed(done.stdout.splitlines()):
        try:
            summary = json.loads(line)
            break
        except ValueError:
            continue
    return transactions, wall, summary


def deliveries_case(name: str, root: Path, extra: Path, community, target: bytes, n: int) -> tuple[float, str]:
    from bench.gateway import clear

    clear(community.id)
    commit(community, target, n)
    argv = ["run_delivery_worker", "--community", str(community.id), "--target", target.hex(),
            "--handler", "bench_inproc_handlers:failing", "--concurrency", "50", "--max-deliveries", str(n),
            "--poll-interval", "0.2", "--idle-exit", "2", "-v", "0"]  # fmt: skip
    transactions, wall, summary = measured(name, root, extra, argv)
    detail = f"wall={wall:5.1f}s settle_statements/delivery={summary.get('settle_statements', 0) / n:.3f}"
    return transactions / n, detail


def runs_case(name: str, root: Path, extra: Path, community, agent: bytes, n: int) -> tuple[float, str]:
    from bench.gateway import clear_runs
    from buzz_delivery.agents.services import intake_event

    clear_runs(community.id)
    for _ in range(n):
        intake_event(community.id, "bench", uuid.uuid4().hex, {}, agent, timeout_seconds=3600)
    argv = ["run_agent_worker", "--async", "--community", str(community.id), "--agent", agent.hex(),
            "--handler", "bench_inproc_handlers:fail_after_three", "--in-flight", "100", "--connections", "2",
            "--poll-seconds", "0.2", "--exit-when-idle", "--no-listen", "--no-accept", "-v", "0"]  # fmt: skip
    transactions, wall, summary = measured(name, root, extra, argv)
    batches, items = summary.get("batches", 0), summary.get("batched_items", 0)
    detail = f"wall={wall:5.1f}s batches/run={batches / n:.2f} items/batch={items / max(batches, 1):.1f}"
    return transactions / n, detail


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before-root", default=os.environ.get("BENCH_BEFORE_ROOT"), required=False)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--deliveries", type=int, default=400)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--only", choices=("deliveries", "runs"))
    args = parser.parse_args()
    if not args.before_root:
        raise SystemExit("--before-root DIR (or BENCH_BEFORE_ROOT) is required: the checkout to compare with")
    roots = {"ours": ROOT, "before": Path(args.before_root).resolve()}
    url = os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL)
    name = url.rsplit("/", 1)[1]
    setup_django(url)
    from buzz_delivery.testing import CommunityFactory, random32

    community, target, agent = CommunityFactory(), random32(), random32()
    cases = {"deliveries": deliveries_case, "runs": runs_case}
    sizes = {"deliveries": args.deliveries, "runs": args.runs}
    keys = {"deliveries": target, "runs": agent}
    results: dict[tuple[str, str], list[float]] = {}
    print(f"ours {roots['ours']} before {roots['before']}; load average {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_inproc_") as tmp_name:
        extra = Path(tmp_name)
        (extra / "bench_inproc_handlers.py").write_text(HANDLERS)
        for r in range(args.rounds):
            order = ["ours", "before"] if r % 2 == 0 else ["before", "ours"]  # interleaved, alternating
            for case, fn in cases.items():
                if args.only not in (None, case):
                    continue
                for label in order:
                    per_item, detail = fn(name, roots[label], extra, community, keys[case], sizes[case])
                    results.setdefault((case, label), []).append(per_item)
                    print(f"round {r} {case:10s} {label:6s} transactions/item={per_item:6.3f} {detail}", flush=True)
    for case in cases:
        if (case, "ours") not in results:
            continue
        ours, before = results[(case, "ours")], results[(case, "before")]
        ratios = [o / b for o, b in zip(ours, before, strict=True) if b]
        print(
            f"{case:10s} transactions/item ours {min(ours):.3f}-{max(ours):.3f} (median {statistics.median(ours):.3f})"
            f" before {min(before):.3f}-{max(before):.3f} (median {statistics.median(before):.3f})"
            f" ratio ours/before {min(ratios):.2f}-{max(ratios):.2f}",
            flush=True,
        )
    print(f"load average {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
