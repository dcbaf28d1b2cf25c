"""Where the batch gap goes (issue 31): one process, claim 50 -> settle 50 at a time, through a
ladder of variants that each add one of our guarantees to the raw batch-50 floor, in one run:

    python -m bench.batch_ladder [--batches 60] [--rounds 3]

1. raw SQL, raw table, prepared after 5 runs (``raw_batch50`` of the peers bench: the floor)
2. raw SQL, raw table, unprepared (the services never prepare unless told to)
3. raw SQL on our table, write-fence trigger DISABLED: our indexes, CHECK constraints and the
   workflow fan-in trigger, nothing else of ours (the claim ordered as ours, by priority first)
4. the same, write fence on
5. our statements (the plan-cached claim and batch settle of ``services.cached``), through
   psycopg: the community's lifecycle checked in each statement, attempts/TTL/retry-gate
   guards, the holder, two history entries per delivery
6. the services (``claim_deliveries(50)`` -> ``finish_deliveries``, Django): validation, the
   tenant scope, claimed rows built as model instances, typed outcomes (6': the same with the
   settle's arrays passed as lists, dumped by psycopg, as before issue 31; compared with 6)

Each variant drains ``--batches`` batches of 50 with ``synchronous_commit = off`` on its sessions
(the WAL flush waits, the same two per batch on every step, would otherwise hide the CPU costs),
the order of the variants reversed every other round. Prints CPU µs per delivery (client +
the server backend, from ``/proc``), the median of the rounds, and each step's difference.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import psycopg

from bench import baseline, data, env
from bench.context import write_fence_disabled
from bench.scenarios.overhead import _backend_cpu

BATCH = 50
LEASE_SECONDS = 60.0


def _psycopg_batch(conn: psycopg.Connection, claim_sql: str, settle_sql: str, tenant: data.Tenant) -> Callable:
    target = data.target(0)
    claim_params = {
        "community_id": tenant.community_id,
        "target_pubkey": target,
        "limit": BATCH,
        "lease_seconds": LEASE_SECONDS,
        "holder": "ladder",
    }

    def batch() -> None:
        rows = conn.execute(claim_sql, claim_params).fetchall()
        assert len(rows) == BATCH
        settled = conn.execute(
            settle_sql,
            {
                "community_id": tenant.community_id,
                "target_pubkey": target,
                "ids": [r[0] for r in rows],
                "delivery_ids": [r[0] for r in rows],
                "generations": [r[1] for r in rows],
                "lease_generations": [r[1] for r in rows],
                "target_pubkeys": [target] * len(rows),
                "status": "finished",
                "failure_code": None,
                "failure_message": None,
            },
        )
        assert settled.rowcount == BATCH

    return batch


def _services_batch(tenant: data.Tenant) -> Callable:
    from buzz_delivery import services

    target = data.target(0)

    def batch() -> None:
        claims = services.claim_deliveries(tenant.community_id, target, limit=BATCH)
        assert len(claims) == BATCH
        outcomes = services.finish_deliveries([c.lease for c in claims])
        assert all(isinstance(o, services.Settled) for o in outcomes)

    return batch


def _services_batch_list_arrays(tenant: data.Tenant) -> Callable:
    """The services as before issue 31: the batch settle's arrays as lists, dumped by psycopg."""
    from buzz_delivery.services import batch as settle

    services_batch = _services_batch(tenant)
    arrays = {name: getattr(settle, name) for name in ("uuid_array", "int_array", "bytea_array")}

    def batch() -> None:
        for name in arrays:
            setattr(settle, name, list)
        try:
            services_batch()
        finally:
            for name, fn in arrays.items():
                setattr(settle, name, fn)

    return batch


def _cpu_per_delivery(conn, tenant, table: str, batch: Callable, pid: int, batches: int) -> float:  # type: ignore[no-untyped-def]
    data.clear_deliveries(conn)
    data.load(conn, tenant, (batches + 3) * BATCH, table=table)
    data.analyze(conn)
    conn.execute("CHECKPOINT")
    for _ in range(3):  # warm up: plans cached, psycopg prepared
        batch()
    server, client = _backend_cpu(pid), time.process_time()
    for _ in range(batches):
        batch()
    server = _backend_cpu(pid) - server  # type: ignore[operator]
    return (server + time.process_time() - client) / (batches * BATCH) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_ladder", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    url = env.database_url()
    env.ensure_database(url)
    env.setup_django(url)
    env.migrate()
    from django.db import connection

    from buzz_delivery.services import cached

    control = env.connect(url)
    baseline.create_table(control)
    data.reset(control)
    (tenant,) = data.create_tenants(1)
    no_flush = "-c synchronous_commit=off"
    prepared = psycopg.connect(url, autocommit=True, options=no_flush)
    unprepared = psycopg.connect(url, autocommit=True, prepare_threshold=None, options=no_flush)
    with connection.cursor() as cursor:
        cursor.execute("SET synchronous_commit = off")
        django_pid = connection.connection.info.backend_pid
    raw_claim_ours = baseline.CLAIM.replace(baseline.TABLE, data.OURS).replace(
        "ORDER BY c.created_at, c.id", "ORDER BY c.priority DESC, c.created_at, c.id"
    )
    raw_settle_ours = baseline.FINISH_BATCH.replace(baseline.TABLE, data.OURS)
    claim_ours = cached.CLAIM.call.replace("SELECT ", "SELECT d.id, d.lease_generation, ", 1)
    ladder = [
        ("1. raw SQL, raw table, prepared (the raw batch-50 floor)", baseline.TABLE, False,
         _psycopg_batch(prepared, baseline.CLAIM, baseline.FINISH_BATCH, tenant), prepared.info.backend_pid),
        ("2. raw SQL, raw table, unprepared", baseline.TABLE, False,
         _psycopg_batch(unprepared, baseline.CLAIM, baseline.FINISH_BATCH, tenant), unprepared.info.backend_pid),
        ("3. raw SQL, our table (indexes, CHECKs, fan-in trigger), write fence off", data.OURS, True,
         _psycopg_batch(unprepared, raw_claim_ours, raw_settle_ours, tenant), unprepared.info.backend_pid),
        ("4. raw SQL, our table, write fence on", data.OURS, False,
         _psycopg_batch(unprepared, raw_claim_ours, raw_settle_ours, tenant), unprepared.info.backend_pid),
        ("5. our statements (lifecycle in the statement, guards, holder, history)", data.OURS, False,
         _psycopg_batch(unprepared, claim_ours, cached.FINISH_MANY.call, tenant), unprepared.info.backend_pid),
        ("6. the services (Django: validation, tenant scope, model rows, outcomes)", data.OURS, False,
         _services_batch(tenant), django_pid),
        ("6'. the same, the settle's arrays dumped by psycopg (before issue 31)", data.OURS, False,
         _services_batch_list_arrays(tenant), django_pid),
    ]  # fmt: skip
    cpu: dict[str, list[float]] = {name: [] for name, *_ in ladder}
    for round_ in range(args.rounds):
        for name, table, no_fence, batch, pid in ladder if round_ % 2 == 0 else reversed(ladder):
            with write_fence_disabled(control) if no_fence else nullcontext():
                cpu[name].append(_cpu_per_delivery(control, tenant, table, batch, pid, args.batches))
            print(f"round {round_ + 1} {name}: {cpu[name][-1]:.1f} µs/delivery", flush=True)
    print("\n| step | CPU µs per delivery (client + server) | vs the step before |\n|---|---|---|")
    previous = None
    for name, *_ in ladder:
        value = statistics.median(cpu[name])
        step = f"{value - previous:+.0f}" if previous is not None else ""
        print(f"| {name} | {value:.0f} | {step} |")
        if not name.startswith("6'"):
            previous = value
    for conn in (prepared, unprepared, control):
        conn.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
