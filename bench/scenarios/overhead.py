"""Where the single-row gap goes: one process, claim -> finish one delivery at a time, through a
ladder of variants that each add one difference between the baseline and the services.

1. raw SQL, raw table, psycopg (prepared after 5 runs) - the baseline
2. raw SQL, raw table, unprepared (Django's psycopg cursors never prepare)
3. raw SQL on our table, write-fence trigger DISABLED (our 9 indexes, constraints)
4. raw SQL on our table, trigger on
5. our SQL (services/sql.py) through psycopg, prepared, trigger on
6. our SQL through psycopg, unprepared
7. the services (Django), trigger on
8. the services, trigger DISABLED
9. the services with Django's ``OPTIONS`` ``server_side_binding`` and ``prepare_threshold`` set
plus the floors: one durable one-row commit, and ``SELECT 1`` through psycopg and through
Django's cursor.

The ladder runs with ``synchronous_commit = off`` on its own sessions, so that WAL flush waits
(the same two per delivery on every step, and very noisy on a shared disk) do not hide the CPU
costs it is there to show; the durable-commit floor says what a flush adds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg

from bench import baseline, data
from bench.context import Bench, write_fence_disabled
from bench.report import Figure, median

LEASE_SECONDS = 60.0


def _psycopg_pair(conn: psycopg.Connection, claim_sql: str, finish_sql: str, tenant: data.Tenant) -> Callable:
    params = {
        "community_id": tenant.community_id,
        "target_pubkey": data.target(0),
        "limit": 1,
        "lease_seconds": LEASE_SECONDS,
        "delivery_id": None,
        "holder": "bench",
    }

    def pair() -> None:
        (row,) = conn.execute(claim_sql, params).fetchall()
        finish = {
            "id": row[0],
            "delivery_id": row[0],
            "generation": row[1],
            "lease_generation": row[1],
            "community_id": tenant.community_id,
            "target_pubkey": data.target(0),
            "status": "finished",
            "failure_code": None,
            "failure_message": None,
        }
        assert conn.execute(finish_sql, finish).rowcount == 1

    return pair


def _services_pair(tenant: data.Tenant) -> Callable:
    from buzz_delivery import services

    target = data.target(0)

    def pair() -> None:
        claim = services.claim_delivery(tenant.community_id, target)
        assert isinstance(services.finish_delivery(claim.lease, "finished"), services.Settled)

    return pair


def _our_sql() -> tuple[str, str]:
    """Our claim statement, rewritten to return (id, lease_generation) first, and our finish."""
    from buzz_delivery.services import sql

    claim = sql.claim_oldest_pending(by_id=False, by_binding=False)
    claim = claim.replace(
        f"RETURNING {sql.RETURNING_CLAIM_COLUMNS}", f"RETURNING d.id, d.lease_generation, {sql.RETURNING_CLAIM_COLUMNS}"
    )
    return claim, sql.FINISH_IF_CURRENT_GENERATION


def _backend_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) the server process ``pid`` has used, if this machine can see it."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _django_backend_pid() -> int:
    from django.db import connection

    connection.ensure_connection()
    return connection.connection.info.backend_pid


def _time(bench: Bench, tenant: data.Tenant, step: Step, n: int) -> tuple[float, float | None]:
    """(wall µs, client + server CPU µs) per claim+finish; CPU is None if the server is remote."""
    data.clear_deliveries(bench.conn)
    data.load(bench.conn, tenant, n + 10, table=step.table)
    data.analyze(bench.conn)
    bench.conn.execute("CHECKPOINT")
    for _ in range(5):  # warm up (psycopg prepares on the 5th run)
        step.pair()
    pid = step.backend_pid()
    server_before, client_before = _backend_cpu(pid), time.process_time()
    started = time.perf_counter()
    for _ in range(n - 5):
        step.pair()
    wall = (time.perf_counter() - started) / (n - 5) * 1e6
    server_after, client_after = _backend_cpu(pid), time.process_time()
    if server_before is None or server_after is None:
        return wall, None
    return wall, (server_after - server_before + client_after - client_before) / (n - 5) * 1e6


@dataclass(frozen=True)
class Step:
    name: str
    table: str
    pair: Callable[[], None]
    variant: str
    backend_pid: Callable[[], int]


NO_TRIGGER = "no-trigger"
PREPARED_DJANGO = "prepared-django"


@contextmanager
def django_prepared_statements() -> Iterator[None]:
    """Reconnect Django's default connection with ``OPTIONS = {"server_side_binding": True,
    "prepare_threshold": 5}`` for the block (what a project could set in ``DATABASES``)."""
    from django.db import connection

    options = connection.settings_dict.setdefault("OPTIONS", {})
    saved = dict(options)
    connection.close()
    options.update(server_side_binding=True, prepare_threshold=5)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SET synchronous_commit = off")
        yield
    finally:
        connection.close()
        options.clear()
        options.update(saved)
        with connection.cursor() as cursor:
            cursor.execute("SET synchronous_commit = off")


@contextmanager
def _variant(bench: Bench, variant: str) -> Iterator[None]:
    if variant == NO_TRIGGER:
        with write_fence_disabled(bench.conn):
            yield
    elif variant == PREPARED_DJANGO:
        with django_prepared_statements():
            yield
    else:
        yield


def _floor(fn: Callable, n: int) -> float:
    for _ in range(5):
        fn()
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


def run(bench: Bench) -> None:
    from django.db import connection

    n = bench.scaled(1000, 300)
    data.reset(bench.conn)
    (tenant,) = data.create_tenants(1)
    no_flush = "-c synchronous_commit=off"
    prepared = psycopg.connect(bench.url, autocommit=True, options=no_flush)
    unprepared = psycopg.connect(bench.url, autocommit=True, prepare_threshold=None, options=no_flush)
    with connection.cursor() as cursor:
        cursor.execute("SET synchronous_commit = off")
    ours_claim, ours_finish = _our_sql()
    raw_on_ours = (
        baseline.CLAIM.replace(baseline.TABLE, data.OURS),
        baseline.FINISH.replace(baseline.TABLE, data.OURS),
    )
    services_pair = _services_pair(tenant)

    def via(conn: psycopg.Connection) -> Callable[[], int]:
        return lambda: conn.info.backend_pid

    ladder = [
        Step("1. raw SQL, raw table, prepared (baseline)", baseline.TABLE,
             _psycopg_pair(prepared, baseline.CLAIM, baseline.FINISH, tenant), "", via(prepared)),
        Step("2. raw SQL, raw table, unprepared", baseline.TABLE,
             _psycopg_pair(unprepared, baseline.CLAIM, baseline.FINISH, tenant), "", via(unprepared)),
        Step("3. raw SQL, our table, trigger DISABLED", data.OURS,
             _psycopg_pair(prepared, *raw_on_ours, tenant), NO_TRIGGER, via(prepared)),
        Step("4. raw SQL, our table, trigger on", data.OURS,
             _psycopg_pair(prepared, *raw_on_ours, tenant), "", via(prepared)),
        Step("5. our SQL via psycopg, prepared", data.OURS,
             _psycopg_pair(prepared, ours_claim, ours_finish, tenant), "", via(prepared)),
        Step("6. our SQL via psycopg, unprepared", data.OURS,
             _psycopg_pair(unprepared, ours_claim, ours_finish, tenant), "", via(unprepared)),
        Step("7. services (Django), trigger on", data.OURS, services_pair, "", _django_backend_pid),
        Step("8. services (Django), trigger DISABLED", data.OURS, services_pair, NO_TRIGGER, _django_backend_pid),
        Step("9. services, Django OPTIONS server_side_binding + prepare_threshold=5", data.OURS, services_pair,
             PREPARED_DJANGO, _django_backend_pid),
    ]  # fmt: skip
    wall: dict[str, list[float]] = {step.name: [] for step in ladder}
    cpu: dict[str, list[float]] = {step.name: [] for step in ladder}
    for repeat in range(bench.repeats):
        for step in ladder if repeat % 2 == 0 else reversed(ladder):
            with _variant(bench, step.variant):
                w, c = _time(bench, tenant, step, n)
            wall[step.name].append(w)
            if c is not None:
                cpu[step.name].append(c)
    figures = cpu if all(cpu.values()) else wall
    unit = "CPU µs (client + server)" if figures is cpu else "wall µs"
    base = figures[ladder[0].name]
    previous: list[float] | None = None
    for step in ladder:
        note = f"{median(figures[step.name]) - median(previous):+.0f} vs previous step; " if previous else ""
        bench.report.add(
            Figure(
                "overhead ladder (1 proc)",
                step.name,
                f"{unit} per claim+finish",
                figures[step.name],
                base,
                note=note + f"wall {median(wall[step.name]):,.0f} µs",
            )
        )
        previous = figures[step.name]

    def django_select() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchall()

    with connection.cursor() as cursor:
        cursor.execute("RESET synchronous_commit")
    durable = psycopg.connect(bench.url, autocommit=True, options="-c synchronous_commit=on")
    for conn in (durable, prepared):
        conn.execute("CREATE TABLE IF NOT EXISTS bench_floor (id int PRIMARY KEY, n bigint NOT NULL)")
        conn.execute("INSERT INTO bench_floor VALUES (1, 0) ON CONFLICT DO NOTHING")
    bump = "UPDATE bench_floor SET n = n + 1 WHERE id = 1"
    flushed = [_floor(lambda: durable.execute(bump), n) for _ in range(bench.repeats)]
    unflushed = [_floor(lambda: prepared.execute(bump), n) for _ in range(bench.repeats)]
    bench.report.add(
        Figure(
            "floors (1 proc)",
            "one-row UPDATE commit: flushed vs synchronous_commit=off",
            "µs per commit",
            flushed,
            unflushed,
            note="the ratio is what a WAL flush costs on this disk",
        )
    )
    dj = [_floor(django_select, n) for _ in range(bench.repeats)]
    pg = [_floor(lambda: unprepared.execute("SELECT 1").fetchall(), n) for _ in range(bench.repeats)]
    bench.report.add(Figure("floors (1 proc)", "SELECT 1: Django cursor vs psycopg", "µs per call", dj, pg))
    for conn in (prepared, unprepared, durable):
        conn.close()
