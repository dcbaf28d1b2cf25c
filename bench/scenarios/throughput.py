"""Figures 1 and 2: claim -> finish throughput through the services, single row and batched,
with 1, 4 and 16 worker processes on one community and target, next to the raw baseline.

Every run starts from empty tables and a fresh load of pending rows, sized from the previous
run of the same case so the queue about outlasts the run (a queue that drains early ends the
run early: the rate is still settled deliveries over elapsed time). ``ours`` and ``raw`` runs
alternate within each repeat. At 4 workers the write-fence trigger's cost is measured by one
comparison with it disabled.
"""

from __future__ import annotations

from bench import data
from bench.baseline import TABLE as RAW_TABLE
from bench.context import Bench, write_fence_disabled
from bench.pool import Task, WorkerPool
from bench.report import Figure

SHAPES = (("single row", 1), ("batch of 10", 10), ("batch of 50", 50))
# Deliveries/s of the last run of each case (first guesses below), to size the next load.
_expected: dict[str, float] = {}
FIRST_GUESS = {"ours_single": 1_000, "raw_single": 2_000, "raw_batch": 20_000}


def measure(bench: Bench, pool: WorkerPool, tenant: data.Tenant, mode: str, batch: int) -> float:
    """Load a fresh queue for ``mode`` and return the settled deliveries per second."""
    key = f"{mode}/{batch}/{pool.n}"
    guess = _expected.get(key, FIRST_GUESS.get(mode, 4_000))
    rows = int(guess * bench.duration * 1.2) + 2 * pool.n * batch + 100
    data.clear_deliveries(bench.conn)
    table = RAW_TABLE if mode.startswith("raw") else data.OURS
    data.load(bench.conn, tenant, rows, table=table)
    data.analyze(bench.conn)
    bench.conn.execute("CHECKPOINT")
    result = pool.run(Task(mode, tenant.community_id, data.target(0), bench.duration, batch=batch))
    drained_early = result.elapsed < bench.duration * 0.9
    _expected[key] = result.rate * (1.5 if drained_early else 1.0)
    return result.rate


def _tenant(bench: Bench) -> data.Tenant:
    data.reset(bench.conn)
    (tenant,) = data.create_tenants(1)
    return tenant


def run(bench: Bench) -> None:
    for workers in bench.workers:
        with WorkerPool(bench.url, workers) as pool:
            for label, batch in SHAPES:
                if batch == 1:
                    modes = ["ours_single", "raw_single"]
                else:
                    modes = ["ours_batch", "raw_batch"]
                    if workers == 4:  # the target's case: add the settle-each-claim reference
                        modes += ["ours_batch_each", "raw_batch_each"]
                rates: dict[str, list[float]] = {m: [] for m in modes}
                for repeat in range(bench.repeats):
                    for mode in modes if repeat % 2 == 0 else reversed(modes):
                        tenant = _tenant(bench)
                        rates[mode].append(measure(bench, pool, tenant, mode, batch))
                case = f"{workers} proc"
                target = 0.6 if batch > 1 else 0.7
                if batch == 1:
                    bench.report.add(
                        Figure(
                            f"1. claim -> finish, {label}",
                            case,
                            "deliveries/s",
                            rates["ours_single"],
                            rates["raw_single"],
                            target_ratio=0.7 if workers == 4 else None,
                        )
                    )
                    continue
                bench.report.add(
                    Figure(
                        f"2. claim_deliveries({batch}) -> finish_deliveries",
                        case,
                        "deliveries/s",
                        rates["ours_batch"],
                        rates["raw_batch"],
                        target_ratio=target if workers == 4 else None,
                        note="both settle the batch in one UPDATE ... FROM unnest",
                    )
                )
                if "raw_batch_each" in rates:
                    bench.report.add(
                        Figure(
                            f"2b. claim_deliveries({batch}) -> finish_delivery each",
                            case,
                            "deliveries/s",
                            rates["ours_batch_each"],
                            rates["raw_batch_each"],
                            note="reference: both settle each claim with its own UPDATE",
                        )
                    )
            if workers == 4:
                trigger_comparison(bench, pool)


def trigger_comparison(bench: Bench, pool: WorkerPool) -> None:
    """COMPARISON ONLY: ours with the write-fence trigger on vs. disabled, same pool, interleaved."""
    for label, batch in (("single row", 1), ("batch of 50", 50)):
        mode = "ours_single" if batch == 1 else "ours_batch"
        on: list[float] = []
        off: list[float] = []
        for repeat in range(bench.repeats):
            for enabled in (True, False) if repeat % 2 == 0 else (False, True):
                tenant = _tenant(bench)
                if enabled:
                    on.append(measure(bench, pool, tenant, mode, batch))
                else:
                    with write_fence_disabled(bench.conn):
                        off.append(measure(bench, pool, tenant, mode, batch))
        bench.report.add(
            Figure(
                f"trigger cost: {label}",
                f"{pool.n} proc",
                "deliveries/s",
                on,
                off,
                note="'raw' column = OURS WITH THE WRITE-FENCE TRIGGER DISABLED (comparison only)",
            )
        )
