"""A wake hint's claim before and after it became a plan-cached function (issue 31, core
migration 0027), in one run on the benchmark database:

    python -m bench.hinted_claim_ab [--claims 2000] [--rounds 6]

Before: the by-id claim statement (``sql.claim_oldest_pending(by_id=True)``) sent as the
services sent it, server-side binding, unprepared, so parsed and planned on every call. After:
``buzz_delivery_claim_hinted`` (``services.cached.CLAIM_HINTED.call``), planned once per backend.
Each round loads ``--claims`` pending deliveries and claims them one id at a time, as the worker
does for a hint, with one form and then the other (the order alternates), on one autocommit
connection with ``synchronous_commit = off`` (the WAL flush, the same for both, would hide the
difference on a shared disk). Prints the median microseconds per claim of each, wall time and
CPU (client + the server backend, from ``/proc``), and the ratios after/before.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench import data, env
from bench.scenarios.overhead import _backend_cpu


def _claim_ids(conn, tenant: data.Tenant, statement: str, n: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(wall, CPU) seconds per claim of ``n`` pending deliveries, each named by its id."""
    ids = [
        r[0]
        for r in conn.execute(
            f"SELECT id FROM {data.OURS} WHERE community_id = %s AND status = 'pending' ORDER BY created_at LIMIT %s",
            [tenant.community_id, n],
        ).fetchall()
    ]
    params = {
        "community_id": tenant.community_id,
        "target_pubkey": data.target(0),
        "limit": 1,
        "lease_seconds": 30.0,
        "holder": "ab",
    }
    pid = conn.info.backend_pid
    server, client, started = _backend_cpu(pid), time.process_time(), time.perf_counter()
    for delivery_id in ids:
        (row,) = conn.execute(statement, {**params, "delivery_id": delivery_id}).fetchall()
    elapsed = time.perf_counter() - started
    cpu = _backend_cpu(pid) - server + time.process_time() - client  # type: ignore[operator]
    assert row is not None
    return elapsed / len(ids), cpu / len(ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hinted_claim_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    url = env.database_url()
    env.ensure_database(url)
    env.setup_django(url)
    env.migrate()
    from buzz_delivery.services import cached, sql

    # As the services send them: never prepared. No WAL flush wait.
    conn = env.connect(url, prepare_threshold=None, options="-c synchronous_commit=off")
    data.reset(conn)
    (tenant,) = data.create_tenants(1)
    variants = {
        "before": sql.claim_oldest_pending(by_id=True, by_binding=False),
        "after": cached.CLAIM_HINTED.call,
    }
    runs: dict[str, list[float]] = {"before": [], "after": []}
    cpu: dict[str, list[float]] = {"before": [], "after": []}
    for round_ in range(args.rounds):
        order = ["before", "after"] if round_ % 2 == 0 else ["after", "before"]
        for name in order:
            data.clear_deliveries(conn)
            data.load(conn, tenant, args.claims + 10)
            data.analyze(conn)
            wall, used = _claim_ids(conn, tenant, variants[name], args.claims)
            runs[name].append(wall * 1e6)
            cpu[name].append(used * 1e6)
            print(f"round {round_ + 1} {name}: wall {runs[name][-1]:.0f} cpu {cpu[name][-1]:.0f} us/claim", flush=True)
    before, after = statistics.median(runs["before"]), statistics.median(runs["after"])
    cpu_before, cpu_after = statistics.median(cpu["before"]), statistics.median(cpu["after"])
    print(f"\nhinted claim, one id at a time (medians of {args.rounds}): wall before {before:.0f} us, "
          f"after {after:.0f} us ({after / before:.3f}x); CPU (client + server) before {cpu_before:.0f} us, "
          f"after {cpu_after:.0f} us ({cpu_after / cpu_before:.3f}x)")  # fmt: skip
    conn.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
