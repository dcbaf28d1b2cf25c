"""The event-loop worker's batched statements before and after they lock their runs in id order
(review of issue 29), in one run on the benchmark database:

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_fNAME \\
        python -m bench.batch_lock_order_ab --before-root DIR [--runs 100] [--rounds 20]

``DIR``: a tree of the code before (``git archive main | tar -x -C DIR``); its
``buzz_delivery/agents/services/sql.py`` gives the "before" statements (an ``UPDATE ... FROM
unnest`` locking in its plan's order), this tree's the "after" ones (a CTE locking the fenced
runs ``ORDER BY r.id ... FOR NO KEY UPDATE``, then the write). Each round claims ``--runs`` fresh
runs of one community and sends them, as one batch each, through ``heartbeat_runs`` (3 times),
``journal_calls``, ``record_results`` and ``complete_runs``, with one variant and then the other
(the order alternates), so load on a shared machine falls on both alike. Prints the median
milliseconds of each batch of each variant and after/before. Figures only, never asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
import uuid
from pathlib import Path

from bench import env

SWAPPED = (
    "HEARTBEAT_MANY_IF_CURRENT",
    "JOURNAL_MANY_IF_CURRENT_AND_WITHIN_BUDGET",
    "RECORD_MANY_IF_CURRENT",
    "COMPLETE_MANY_IF_CURRENT",
)
OPS = ("heartbeat", "journal", "record", "complete")


def _statements(path: Path) -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("before_agent_sql", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: getattr(module, name) for name in SWAPPED}


def _round(community_id: uuid.UUID, agent: bytes, n: int) -> dict[str, list[float]]:
    """Milliseconds of each batch of ``n`` fresh claimed runs."""
    from buzz_delivery.agents.services import batch, claim_agent_runs, intake_event

    for _ in range(n):
        intake_event(community_id, "bench", uuid.uuid4().hex, {}, agent)
    claims = claim_agent_runs(community_id, [agent], worker_id="bench", limit=n, lease_seconds=300)
    leases = [c.lease for c in claims]
    out: dict[str, list[float]] = {op: [] for op in OPS}

    def timed(op: str, fn, *args) -> list:  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        result = fn(community_id, *args)
        out[op].append((time.perf_counter() - started) * 1000)
        return result

    for _ in range(3):
        timed("heartbeat", batch.heartbeat_runs, leases, 300)
    journaled = timed("journal", batch.journal_calls, [batch.prepare_call(x, "t", {"n": 1}) for x in leases])
    assert all(isinstance(j, batch.Journaled) for j in journaled), journaled[:3]
    timed("record", batch.record_results, [batch.prepare_result(x, 1, ok=True, output={"n": 1}) for x in leases])
    done = timed("complete", batch.complete_runs, [batch.prepare_completion(x, {"ok": True}) for x in leases])
    assert all(isinstance(d, batch.Finished) for d in done), done[:3]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_lock_order_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--before-root", required=True, type=Path)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    url = env.database_url()
    env.ensure_database(url)
    env.setup_django(url)
    env.migrate()

    from buzz_delivery.agents.services import sql
    from buzz_delivery.testing import CommunityFactory, random32

    variants = {
        "before": _statements(args.before_root / "buzz_delivery/agents/services/sql.py"),
        "after": {name: getattr(sql, name) for name in SWAPPED},
    }
    community, agent = CommunityFactory(), random32()
    times: dict[str, dict[str, list[float]]] = {v: {op: [] for op in OPS} for v in variants}
    try:
        for round_ in range(args.rounds):
            for name in ["before", "after"] if round_ % 2 == 0 else ["after", "before"]:
                for attr, statement in variants[name].items():
                    setattr(sql, attr, statement)
                for op, ms in _round(community.id, agent, args.runs).items():
                    times[name][op] += ms
    finally:
        for attr, statement in variants["after"].items():
            setattr(sql, attr, statement)
    print(f"{args.runs} runs a batch, {args.rounds} rounds (median ms of one batch):")
    for op in OPS:
        before, after = statistics.median(times["before"][op]), statistics.median(times["after"][op])
        print(f"  {op:9s} before {before:7.2f}  after {after:7.2f}  after/before {after / before:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
