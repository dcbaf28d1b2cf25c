"""A wake hint's claim before and after it became a plan-cached function (issue 31, core
migration 0027), in one run on the benchmark database:

    python -m bench.hinted_claim_ab [--claims 2000] [--rounds 6]

Before: the by-id claim statement (``sql.claim_oldest_pending(by_id=True)``) sent as the
services sent it, server-side binding, unprepared, so parsed and planned on every call. After:
``buzz_delivery_claim_hinted`` (``services.cached.CLAIM_HINTED.call``), planned once per backend.
Each round loads ``--claims`` pending deliveries and claims them one id at a time, as the worker
does for a hint, with one form and then the other (the order alternates), on one autocommit
connection. Prints the median microseconds per claim (client wall time: round trip and server
work) of each and the ratio after/before.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench import data, env


def _claim_ids(conn, tenant: data.Tenant, statement: str, n: int) -> float:  # type: ignore[no-untyped-def]
    """Seconds per claim of ``n`` pending deliveries, each named by its id."""
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
    started = time.perf_counter()
    for delivery_id in ids:
        (row,) = conn.execute(statement, {**params, "delivery_id": delivery_id}).fetchall()
    elapsed = time.perf_counter() - started
    assert row is not None
    return elapsed / len(ids)


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

    conn = env.connect(url, prepare_threshold=None)  # as the services send them: never prepared
    data.reset(conn)
    (tenant,) = data.create_tenants(1)
    variants = {
        "before": sql.claim_oldest_pending(by_id=True, by_binding=False),
        "after": cached.CLAIM_HINTED.call,
    }
    runs: dict[str, list[float]] = {"before": [], "after": []}
    for round_ in range(args.rounds):
        order = ["before", "after"] if round_ % 2 == 0 else ["after", "before"]
        for name in order:
            data.clear_deliveries(conn)
            data.load(conn, tenant, args.claims + 10)
            data.analyze(conn)
            runs[name].append(_claim_ids(conn, tenant, variants[name], args.claims) * 1e6)
            print(f"round {round_ + 1} {name}: {runs[name][-1]:.0f} us/claim", flush=True)
    before, after = statistics.median(runs["before"]), statistics.median(runs["after"])
    print(f"\nhinted claim, one id at a time: before {before:.0f} us/claim, after {after:.0f} us/claim, "
          f"after/before {after / before:.3f} (medians of {args.rounds})")  # fmt: skip
    conn.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
