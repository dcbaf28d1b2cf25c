"""Figure 6: reaping 100,000 lapsed leases with ``services.reap`` (batches of ``BATCH_SIZE``,
default 1,000) next to the same batches of the raw reap statement; and, while ours reaps, a
claimer in another process claiming and settling another target's deliveries: its latency
inside the reap window against its latency outside it (1 s before, 1 s after) shows whether
the reaper blocks claims.
"""

from __future__ import annotations

import time

from bench import baseline, data
from bench.context import Bench
from bench.pool import Task, WorkerPool
from bench.report import Figure, percentile

BATCH_SIZE = 1000
QUIET = 1.0  # seconds of claimer-only time before and after the reap


def _load(bench: Bench, tenant: data.Tenant, lapsed: int, table: str) -> None:
    data.clear_deliveries(bench.conn)
    data.load(bench.conn, tenant, lapsed, status="lapsed", table=table, first_target=1, targets=10)
    data.load(bench.conn, tenant, 20_000, table=table)  # target 0: the claimer's queue
    data.analyze(bench.conn, vacuum=True)
    bench.conn.execute("CHECKPOINT")


def _ours(bench: Bench, pool: WorkerPool, tenant: data.Tenant, lapsed: int) -> dict[str, float]:
    from buzz_delivery import services

    _load(bench, tenant, lapsed, data.OURS)
    task = Task("ours_single", tenant.community_id, data.target(0), 600.0, stop_on_empty=False, record=True)
    start_at = pool.submit(task, processes=1)
    time.sleep(max(0.0, start_at - time.monotonic()) + QUIET)
    began = time.monotonic()
    result = services.reap(batch_size=BATCH_SIZE)
    ended = time.monotonic()
    time.sleep(QUIET)
    pool.stop()
    claimer = pool.gather()
    if result.reclaimed != lapsed:
        raise RuntimeError(f"reap reclaimed {result.reclaimed} of {lapsed}")
    samples = [s for r in claimer.results for s in r.samples]
    during = [lat * 1000 for t, lat in samples if began <= t <= ended]
    outside = [lat * 1000 for t, lat in samples if t < began or t > ended]
    return {
        "seconds": ended - began,
        "batches": result.batches,
        "during_p50": percentile(during, 0.5),
        "during_p99": percentile(during, 0.99),
        "during_max": max(during, default=float("nan")),
        "during_n": len(during),
        "outside_p50": percentile(outside, 0.5),
        "outside_p99": percentile(outside, 0.99),
        "outside_max": max(outside, default=float("nan")),
    }


def _raw(bench: Bench, tenant: data.Tenant, lapsed: int) -> tuple[float, int]:
    _load(bench, tenant, lapsed, baseline.TABLE)
    raw = baseline.RawClient(bench.url, tenant.community_id, data.target(0))
    began = time.monotonic()
    total = batches = 0
    while True:
        moved = raw.reap(BATCH_SIZE)
        total += moved
        batches += 1
        if moved < BATCH_SIZE:
            break
    seconds = time.monotonic() - began
    raw.close()
    if total != lapsed:
        raise RuntimeError(f"raw reap moved {total} of {lapsed}")
    return seconds, batches


def run(bench: Bench) -> None:
    lapsed = bench.scaled(100_000, 20_000)
    data.reset(bench.conn)
    (tenant,) = data.create_tenants(1)
    ours: list[dict[str, float]] = []
    raw: list[tuple[float, int]] = []
    with WorkerPool(bench.url, 1) as pool:
        for repeat in range(bench.repeats):
            if repeat % 2 == 0:
                ours.append(_ours(bench, pool, tenant, lapsed))
                raw.append(_raw(bench, tenant, lapsed))
            else:
                raw.append(_raw(bench, tenant, lapsed))
                ours.append(_ours(bench, pool, tenant, lapsed))
    bench.report.add(
        Figure(
            f"6. reap {lapsed:,} lapsed leases",
            f"batch {BATCH_SIZE}",
            "seconds",
            [o["seconds"] for o in ours],
            [r[0] for r in raw],
            note=f"batches: ours {ours[0]['batches']}, raw {raw[0][1]}; "
            f"ours {lapsed / min(o['seconds'] for o in ours):,.0f} rows/s at best",
        )
    )
    for q in ("p50", "p99", "max"):
        bench.report.add(
            Figure(
                f"6. claimer latency {q} during reap",
                "1 proc",
                "ms",
                [o[f"during_{q}"] for o in ours],
                [o[f"outside_{q}"] for o in ours],
                note="'raw' column = THE SAME CLAIMER OUTSIDE THE REAP WINDOW"
                + (f"; claims inside the window: {', '.join(str(o['during_n']) for o in ours)}" if q == "p50" else ""),
            )
        )
