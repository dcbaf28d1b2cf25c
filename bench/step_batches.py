"""An orchestrator's renewal round and its async steps' failures, batched (issue 29) against the
one-statement-per-step path they replace, measured in the same run on the same PostgreSQL.

For each size N (the steps an orchestrator holds, or the failures one completer batch carries),
in rounds that alternate which path goes first:

- renewal: N held leases of one community renewed one ``renew_step`` each (before) vs one
  ``renew_steps`` statement (after);
- failures: N claimed steps failing with attempts left, ``fail_step`` each (before: a
  transaction of three statements per step) vs one ``fail_steps`` transaction (after).

Prints milliseconds per round (median of the rounds), statements sent, and the ratio; writes
``bench/results/step_batches.md``.

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_fstepbatch \\
        /work/venv/bin/python -m bench.step_batches --sizes 64,256,1000 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from bench.env import ROOT, database_url, ensure_database

URL = database_url()
os.environ["DATABASE_URL"] = URL
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection, connections  # noqa: E402

from buzz_delivery.services import Cause  # noqa: E402
from buzz_delivery.testing import CommunityFactory, WorkflowFactory  # noqa: E402
from buzz_delivery.workflows.services import (  # noqa: E402
    StepFailure,
    claim_steps,
    fail_step,
    fail_steps,
    publish_definition,
    renew_step,
    renew_steps,
    start_run,
)

DEFINITION = {
    "steps": [{"key": "a", "kind": "function", "function": "noop", "retry": {"max_attempts": 5, "base_seconds": 60}}]
}


class Count:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        self.n += 1
        return execute(sql, params, many, context)


def _claimed(n: int) -> list[Any]:
    community = CommunityFactory()
    workflow = WorkflowFactory(community=community)
    version = publish_definition(community.id, workflow.id, DEFINITION)
    for _ in range(n):
        start_run(community.id, workflow.id, {}, cause=Cause.event(os.urandom(32)), version=version.version)
    claims: list[Any] = []
    while len(claims) < n:
        claims += claim_steps(community.id, limit=min(1000, n - len(claims)), lease_seconds=60, holder="bench:1:b")
    return claims


def _timed(fn: Any) -> tuple[float, int]:
    count = Count()
    with connection.execute_wrapper(count):
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1000, count.n


def renewal(n: int, rounds: int) -> dict[str, list[tuple[float, int]]]:
    leases = [c.lease for c in _claimed(n)]
    community = leases[0].community_id
    out: dict[str, list[tuple[float, int]]] = {"before": [], "after": []}

    def before() -> None:
        for lease in leases:
            renew_step(lease, 60)

    def after() -> None:
        for start in range(0, n, 1000):
            renew_steps(community, leases[start : start + 1000], 60)

    for r in range(rounds):
        order = [("before", before), ("after", after)] if r % 2 == 0 else [("after", after), ("before", before)]
        for name, fn in order:
            out[name].append(_timed(fn))
    return out


def failures(n: int, rounds: int) -> dict[str, list[tuple[float, int]]]:
    out: dict[str, list[tuple[float, int]]] = {"before": [], "after": []}
    for r in range(rounds):
        names = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for name in names:
            claims = _claimed(n)
            if name == "before":

                def fn(claims: list[Any] = claims) -> None:
                    for c in claims:
                        fail_step(c.lease, "function_error", failure_message="RuntimeError: bench")

            else:

                def fn(claims: list[Any] = claims) -> None:
                    community = claims[0].lease.community_id
                    for start in range(0, n, 1000):
                        chunk = claims[start : start + 1000]
                        fail_steps(community, [StepFailure(c.lease, "function_error", "bench") for c in chunk])

            out[name].append(_timed(fn))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,256,1000")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ensure_database(URL)
    call_command("migrate", verbosity=0)
    connections.close_all()
    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
        for what, measure in (("renewal round", renewal), ("async failures", failures)):
            got = measure(n, args.rounds)
            ms = {k: statistics.median(t for t, _ in v) for k, v in got.items()}
            sent = {k: v[0][1] for k, v in got.items()}
            ratio = ms["before"] / ms["after"]
            print(
                f"{what} n={n}: one per step {ms['before']:.1f} ms ({sent['before']} statements), "
                f"batched {ms['after']:.1f} ms ({sent['after']} statements): {ratio:.1f}x",
                flush=True,
            )
            rows.append((what, n, ms, sent, ratio))
    load = os.getloadavg()
    lines = [
        f"Renewal rounds and async-step failures, one statement per step vs batched ({os.cpu_count()} cores, "
        f"same run, same PostgreSQL, median of {args.rounds} alternating rounds; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f})",
        "",
        "| what | steps | one per step: ms (statements) | batched: ms (statements) | ratio |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {what} | {n} | {ms['before']:.1f} ({sent['before']}) | {ms['after']:.1f} ({sent['after']}) "
            f"| {ratio:.1f}x |"
            for what, n, ms, sent, ratio in rows
        ),
        "",
        "Command: `BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_fstepbatch "
        f"python -m bench.step_batches --sizes {args.sizes} --rounds {args.rounds}`",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "bench" / "results" / "step_batches.md").write_text(text)


if __name__ == "__main__":
    main()
