"""Figure 5: claim latency (p50/p99, milliseconds, one process, claims interleaved ours/raw) as
terminal rows pile up: 0, 100k and 1M ``finished`` rows of the same community and target, then
100 communities x 10 targets. The polling index is partial (``status = 'pending'``), so the
claim should not slow down as terminal rows grow. Prints ``EXPLAIN (ANALYZE, BUFFERS)`` of
our claim statement on an empty table and at 1M terminal rows.

At the largest step (1M terminal rows) it also takes the priority figure (issue 32): claims on
a target whose pending deliveries are spread over every priority (-10..10, scattered in age)
interleaved with claims on a target whose pending deliveries all have the default priority,
same community, same count, same table; the p50 with priorities over the p50 without (target
at most 1.2x). The polling index is ordered ``priority DESC, created_at``, so both read only
the rows they take; each claim with priorities is checked to take the highest pending priority.

Rows are added with set-based inserts, then ``VACUUM ANALYZE``. Each timed claim is settled
(untimed) so the queue stays in its steady shape.
"""

from __future__ import annotations

import random
import time

import psycopg

from bench import baseline, data
from bench.context import Bench
from bench.report import Figure, percentile

LEASE_SECONDS = 60.0


def _explain(bench: Bench, tenant: data.Tenant, target: int = 0) -> str:
    from buzz_delivery.services import sql

    statement = sql.claim_oldest_pending(by_id=False, by_binding=False)
    params = {
        "community_id": tenant.community_id,
        "target_pubkey": data.target(target),
        "limit": 1,
        "lease_seconds": LEASE_SECONDS,
        "delivery_id": None,
        "holder": "bench",
    }
    with psycopg.connect(bench.url) as conn:  # a transaction, rolled back: the claims are not kept
        conn.execute(statement, params)  # warm this session's plan and PL/pgSQL caches first
        rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + statement, params).fetchall()
        conn.rollback()
    return "\n".join(r[0] for r in rows)


def _measure(
    bench: Bench, raw: baseline.RawClient, pairs: list[tuple[object, bytes]], claims: int
) -> tuple[list[float], list[float]]:
    """``claims`` timed claims on each side, alternating, each on a random (community, target)."""
    from buzz_delivery import services

    ours: list[float] = []
    theirs: list[float] = []
    rng = random.Random(7)
    for _ in range(claims):
        community, target = rng.choice(pairs)
        started = time.perf_counter()
        claim = services.claim_delivery(community, target, lease_seconds=LEASE_SECONDS)
        ours.append((time.perf_counter() - started) * 1000)
        services.finish_delivery(claim.lease, "finished")
        raw.community_id, raw.target_pubkey = community, target
        started = time.perf_counter()
        (row,) = raw.claim(1, LEASE_SECONDS)
        theirs.append((time.perf_counter() - started) * 1000)
        raw.finish(*row)
    return ours, theirs


def _measure_priorities(
    bench: Bench, community: object, with_priorities: bytes, without: bytes, claims: int
) -> tuple[list[float], list[float]]:
    """``claims`` timed claims on each target, alternating: (with priorities, without)."""
    from buzz_delivery import services

    timed: dict[bytes, list[float]] = {with_priorities: [], without: []}
    for _ in range(claims):
        for target in (with_priorities, without):
            started = time.perf_counter()
            claim = services.claim_delivery(community, target, lease_seconds=LEASE_SECONDS)
            timed[target].append((time.perf_counter() - started) * 1000)
            services.finish_delivery(claim.lease, "finished")
            if target == with_priorities:
                _check_highest(bench, claim)
    return timed[with_priorities], timed[without]


def _check_highest(bench: Bench, claim: object) -> None:
    """The claim took the highest priority still pending for its target (untimed)."""
    delivery = claim.delivery  # type: ignore[attr-defined]
    (higher,) = bench.conn.execute(
        f"SELECT EXISTS (SELECT 1 FROM {data.OURS} WHERE community_id = %s AND target_pubkey = %s"
        " AND status = 'pending' AND priority > %s)",
        [delivery.community_id, bytes(delivery.target_pubkey), delivery.priority],
    ).fetchone()
    if higher:
        raise AssertionError(f"a claim took priority {delivery.priority} while a higher one was pending")


def _priorities(bench: Bench, tenant: data.Tenant, claims: int, terminal: int) -> None:
    """The priority figure at ``terminal`` terminal rows (see the module's docstring)."""
    with_target, without_target = 1, 2
    count = claims * bench.repeats + 50
    data.load(bench.conn, tenant, count, first_target=with_target, priorities=True)
    data.load(bench.conn, tenant, count, first_target=without_target)
    data.analyze(bench.conn, vacuum=True)
    bench.conn.execute("CHECKPOINT")
    bench.report.section(
        f"EXPLAIN (ANALYZE, BUFFERS) of our claim, pending spread over priorities -10..10, {terminal:,} terminal rows",
        "```\n" + _explain(bench, tenant, with_target) + "\n```",
    )
    runs = [
        _measure_priorities(bench, tenant.community_id, data.target(with_target), data.target(without_target), claims)
        for _ in range(bench.repeats)
    ]
    bench.report.add(
        Figure(
            "5. claim p50 with priorities vs without",
            f"{terminal:,} terminal rows, {count:,} pending per target",
            "ms",
            [percentile(w, 0.5) for w, _ in runs],
            [percentile(o, 0.5) for _, o in runs],
            target_ratio=1.2,
            lower_is_better=True,
            note="'raw' column = OUR p50 on a target whose pending rows all have priority 0, interleaved",
        )
    )


def _figures(bench: Bench, case: str, runs: list[tuple[list[float], list[float]]], **target: float) -> list[float]:
    p50 = [percentile(o, 0.5) for o, _ in runs]
    bench.report.add(Figure("5. claim latency p50", case, "ms", p50, [percentile(r, 0.5) for _, r in runs], **target))
    bench.report.add(
        Figure(
            "5. claim latency p99",
            case,
            "ms",
            [percentile(o, 0.99) for o, _ in runs],
            [percentile(r, 0.99) for _, r in runs],
        )
    )
    return p50


def run(bench: Bench) -> None:
    claims = bench.scaled(400, 100)
    steps = (0, 100_000, 1_000_000) if not bench.quick else (0, 10_000, 100_000)
    data.reset(bench.conn)
    (tenant,) = data.create_tenants(1)
    raw = baseline.RawClient(bench.url, tenant.community_id, data.target(0))
    pairs = [(tenant.community_id, data.target(0))]
    loaded = 0
    empty_p50: list[float] = []
    empty_raw_p50: list[float] = []
    for terminal in steps:
        if terminal > loaded:
            data.load_both(bench.conn, tenant, terminal - loaded, status="finished")
            loaded = terminal
        data.load_both(bench.conn, tenant, claims * bench.repeats + 50)
        data.analyze(bench.conn, vacuum=True)
        bench.conn.execute("CHECKPOINT")
        if terminal in (0, steps[-1]):  # right after VACUUM, before the timed claims
            bench.report.section(
                f"EXPLAIN (ANALYZE, BUFFERS) of our claim, {terminal:,} terminal rows",
                "```\n" + _explain(bench, tenant) + "\n```",
            )
        runs = [_measure(bench, raw, pairs, claims) for _ in range(bench.repeats)]
        case = f"{terminal:,} terminal rows"
        p50 = _figures(bench, case, runs)
        if terminal == steps[-1]:
            _priorities(bench, tenant, claims, terminal)
        raw_p50 = [percentile(r, 0.5) for _, r in runs]
        if terminal == 0:
            empty_p50, empty_raw_p50 = p50, raw_p50
            continue
        bench.report.add(
            Figure(
                "5. claim p50 vs empty table",
                case,
                "ms",
                p50,
                empty_p50,
                target_ratio=1.2,
                lower_is_better=True,
                note="'raw' column = OUR p50 on the empty table",
            )
        )
        bench.report.add(
            Figure(
                "5. control: raw claim p50 vs empty table",
                case,
                "ms",
                raw_p50,
                empty_raw_p50,
                note="baseline against itself: drift common to both (machine, dead index entries)",
            )
        )

    # 100 communities x 10 targets, on top of the terminal rows above.
    communities, targets, per_pair = 100, 10, bench.scaled(20, 5)
    tenants = [tenant, *data.create_tenants(communities - 1)]
    for t in tenants:
        data.load_both(bench.conn, t, targets * per_pair, first_target=100, targets=targets)
    data.analyze(bench.conn, vacuum=True)
    bench.conn.execute("CHECKPOINT")
    pairs = [(t.community_id, data.target(100 + k)) for t in tenants for k in range(targets)]
    per_run = min(claims, communities * targets * per_pair // (bench.repeats * 2))
    runs = [_measure(bench, raw, pairs, per_run) for _ in range(bench.repeats)]
    _figures(bench, f"{communities} communities x {targets} targets (+{loaded:,} terminal)", runs)
    raw.close()
