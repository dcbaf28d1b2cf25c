"""Figure 7: 16 claimers across 16 communities on a Citus cluster next to plain PostgreSQL, in
the same run (SPEC section 15, docs/scale-out.md).

Sixteen processes, each claiming and finishing the deliveries of its own community one at a
time (``claim_delivery`` -> ``finish_delivery``, the agents' path), on the benchmark database
(plain PostgreSQL) and on a Citus coordinator with two workers (``bench_fcitus``, migrated and
distributed afresh for the run), interleaved. On one machine the cluster's three servers share
its cores with the claimers: the ratio says what Citus costs per claim (the coordinator's routing,
the hop to the worker, the delegated function), not how it scales.

The cluster: ``BUZZ_CITUS_COORDINATOR_URL`` (a superuser URL of a coordinator's ``postgres``
database), or, with the Citus extension installed for the local PostgreSQL, a coordinator and two
workers started under ``BUZZ_CITUS_DIR`` (default ``/tmp/buzz-citus``) as the suite's Citus mode
starts them (``tests/citus_support.py``). Without either the scenario says so and measures nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg

from bench import data, env
from bench.context import Bench
from bench.pool import Task, WorkerPool
from bench.report import Figure

CLAIMERS = 16
DATABASE = "bench_fcitus"
# Rows the tenants' deliveries need, copied from the benchmark database to the cluster.
TENANT_TABLES = ("buzz_delivery_community", "buzz_delivery_workflow", "buzz_delivery_workflow_run")


def _cluster() -> tuple[str, list[int] | None] | None:
    """(coordinator URL, the local workers' ports or None), or None without a cluster."""
    from tests import citus_support

    given = os.environ.get(citus_support.COORDINATOR_ENV)
    if given:
        return given, None
    if not citus_support.citus_installed():
        return None
    cluster = citus_support.start_local_cluster(Path(os.environ.get("BUZZ_CITUS_DIR", "/tmp/buzz-citus")))
    return cluster.coordinator_url, cluster.ports[1:]


def _prepare_cluster(coordinator: str, ports: list[int] | None) -> str:
    """``bench_fcitus`` afresh on every node, migrated and distributed; returns its URL."""
    from tests import citus_support

    url = citus_support.create_database(coordinator, DATABASE, ports)
    child = {**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "bench.settings"}
    for command in (["migrate", "-v0"], ["distribute_tables"]):
        subprocess.run(
            [sys.executable, "manage.py", *command], env=child, cwd=env.ROOT, check=True, stdout=subprocess.DEVNULL
        )
    return url


def _copy_tenants(source: psycopg.Connection, target: psycopg.Connection, tenants: list[data.Tenant]) -> None:
    """The tenants' community, workflow, run and message event rows, as they are, on ``target``."""
    ids = [t.community_id for t in tenants]
    for table in (*TENANT_TABLES, "buzz_delivery_event"):
        column = "id" if table == "buzz_delivery_community" else "community_id"
        cursor = source.execute(f"SELECT * FROM {table} WHERE {column} = ANY(%s)", [ids])
        names = [d.name for d in cursor.description or []]
        rows = cursor.fetchall()
        columns = ", ".join(f'"{n}"' for n in names)
        values = ", ".join(["%s"] * len(names))
        with target.cursor() as out:
            out.executemany(f"INSERT INTO {table} ({columns}) VALUES ({values})", rows)


def _load(conn: psycopg.Connection, tenants: list[data.Tenant], rows: int) -> None:
    conn.execute(f"DELETE FROM {data.OURS} WHERE community_id = ANY(%s)", [[t.community_id for t in tenants]])
    for tenant in tenants:
        data.load(conn, tenant, rows)
    conn.execute(f"ANALYZE {data.OURS}")


def run(bench: Bench) -> None:
    found = _cluster()
    if found is None:
        print("no Citus cluster (set BUZZ_CITUS_COORDINATOR_URL or install the citus extension): skipped")
        return
    citus_url = _prepare_cluster(*found)
    citus = env.connect(citus_url)
    data.reset(bench.conn)
    tenants = data.create_tenants(CLAIMERS)
    _copy_tenants(bench.conn, citus, tenants)
    duration = bench.duration
    rows = bench.scaled(3_000, 600)
    tasks = [Task("ours_single", t.community_id, data.target(0), duration) for t in tenants]
    rates: dict[str, list[float]] = {"citus": [], "postgres": []}
    with WorkerPool(bench.url, CLAIMERS) as plain, WorkerPool(citus_url, CLAIMERS) as cluster:
        for repeat in range(bench.repeats):
            order = [("postgres", plain, bench.conn), ("citus", cluster, citus)]
            for name, pool, conn in order if repeat % 2 == 0 else reversed(order):
                _load(conn, tenants, rows)
                result = pool.run_each(tasks)
                rates[name].append(result.rate)
                print(f"  {name}: {result.rate:,.0f} claims/s ({result.settled} in {result.elapsed:.1f} s)", flush=True)
    citus.close()
    bench.report.add(
        Figure(
            "7. 16 claimers x 16 communities, claim_delivery -> finish_delivery",
            f"{CLAIMERS} proc, Citus (coordinator + 2 workers, one machine)",
            "claims/s",
            rates["citus"],
            rates["postgres"],
            note="raw = the same on plain PostgreSQL; ours/raw is what Citus costs on one machine, not its scaling",
        )
    )
