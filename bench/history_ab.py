"""The lease statements before and after their history entries became IMMUTABLE over the row's
columns (issue 30: ``jsonb_build_object`` over columns, which Citus refuses, replaced by
``buzz_delivery.services.sql.history_object``), in one run on the benchmark database:

    python -m bench.history_ab [--pairs 2000] [--rounds 6]

The claim and finish functions of core migration 0017 (before) are created next to today's
(0019) under other names; each round drains ``--pairs`` claim -> finish pairs of one community
through one and then the other (the order alternates), one pair at a time in autocommit, as an
agent calls them. Prints the median microseconds per pair of each and the ratio after/before.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

from bench import baseline, data, env

_0017 = importlib.import_module("buzz_delivery.migrations.0017_lease_statements_as_functions")
BEFORE = {"buzz_delivery_claim_pending": "buzz_ab_claim_before", "buzz_delivery_finish_lease": "buzz_ab_finish_before"}


def _install_before(conn) -> None:  # type: ignore[no-untyped-def]
    for sql in (_0017.CLAIM_PENDING, _0017.FINISH_LEASE):
        for name, renamed in BEFORE.items():
            sql = sql.replace(f"FUNCTION {name}(", f"FUNCTION {renamed}(")
        conn.execute(sql)


def _drain(conn, tenant: data.Tenant, pairs: int, claim: str, finish: str) -> float:  # type: ignore[no-untyped-def]
    """Seconds per claim -> finish pair over ``pairs`` pairs."""
    target = data.target(0)
    started = time.perf_counter()
    for _ in range(pairs):
        row = conn.execute(
            f"SELECT d.id, d.lease_generation FROM {claim}(%s::uuid, %s::bytea, 1::bigint, 30::float8, 'ab'::text) d",
            [tenant.community_id, target],
        ).fetchone()
        conn.execute(
            f"SELECT d.status FROM {finish}(%s::uuid, %s::uuid, %s::bytea, %s::bigint, 'finished', NULL, NULL) AS d",
            [tenant.community_id, row[0], target, row[1]],
        )
    return (time.perf_counter() - started) / pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.history_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    url = env.database_url()
    env.ensure_database(url)
    env.setup_django(url)
    env.migrate()
    conn = env.connect(url)
    baseline.create_table(conn)  # (data.reset empties it too)
    _install_before(conn)
    data.reset(conn)
    (tenant,) = data.create_tenants(1)
    runs: dict[str, list[float]] = {"before": [], "after": []}
    variants = {
        "before": (BEFORE["buzz_delivery_claim_pending"], BEFORE["buzz_delivery_finish_lease"]),
        "after": ("buzz_delivery_claim_pending", "buzz_delivery_finish_lease"),
    }
    for round_ in range(args.rounds):
        order = ["before", "after"] if round_ % 2 == 0 else ["after", "before"]
        for name in order:
            data.clear_deliveries(conn)
            data.load(conn, tenant, args.pairs + 10)
            data.analyze(conn)
            runs[name].append(_drain(conn, tenant, args.pairs, *variants[name]) * 1e6)
            print(f"round {round_ + 1} {name}: {runs[name][-1]:.0f} us/pair", flush=True)
    before, after = statistics.median(runs["before"]), statistics.median(runs["after"])
    print(f"\nclaim -> finish, one pair at a time: before {before:.0f} us/pair, after {after:.0f} us/pair, "
          f"after/before {after / before:.3f} (medians of {args.rounds})")  # fmt: skip
    for renamed in BEFORE.values():
        conn.execute(f"DROP FUNCTION IF EXISTS {renamed}")
    conn.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
