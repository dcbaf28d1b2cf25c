"""Row-level security's cost (SPEC section 13, issue 14): the claim -> finish path in one process
and the ``run_delivery_worker`` drain, with enforcement off and on in the same run.

Cases, each against "off" (RLS disabled on the tables: the scopes send nothing):
- on, context only: RLS enabled and forced, the services send ``buzz.community_id`` in front
  of each statement, in the same simple query (one round trip), and run as the login role
  (``SWITCH_ROLES`` off). The login here is a superuser, which bypasses the policies, so this
  case prices the context alone;
- on, context + role: the same with ``SWITCH_ROLES`` on, so every statement runs as the tenant
  role and the policies are evaluated (the example project's setting).
Target: on costs at most 1.15x off.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection
from django.test import override_settings

from bench import data
from bench.context import Bench
from bench.report import Figure
from bench.scenarios import overhead, worker

TARGET = 1.15


@contextmanager
def enforcement(bench: Bench, on: bool) -> Iterator[None]:
    """Switch RLS on the tables for the block (the Django connection re-reads the switch)."""
    from buzz_delivery import isolation
    from buzz_delivery.services import tenancy

    tables = isolation.installed_tables()
    if on:
        with connection.cursor() as cursor:
            isolation.install(cursor, tables)
    for statement in isolation.switch_sql(tables, on):
        bench.conn.execute(statement)
    tenancy.forget()
    try:
        yield
    finally:
        for statement in isolation.switch_sql(tables, False):
            bench.conn.execute(statement)
        tenancy.forget()


CASES = {
    "off": (False, False),
    "on, context only (superuser login)": (True, False),
    "on, context + tenant role (SWITCH_ROLES)": (True, True),
}


def run(bench: Bench) -> None:
    n = bench.scaled(1000, 300)
    data.reset(bench.conn)
    (tenant,) = data.create_tenants(1)
    with connection.cursor() as cursor:
        cursor.execute("SET synchronous_commit = off")
    pair = overhead._services_pair(tenant)
    step = overhead.Step("services", data.OURS, pair, "", overhead._django_backend_pid)
    wall: dict[str, list[float]] = {name: [] for name in CASES}
    cpu: dict[str, list[float]] = {name: [] for name in CASES}
    for repeat in range(bench.repeats):
        for name in CASES if repeat % 2 == 0 else reversed(list(CASES)):
            on, switch = CASES[name]
            with enforcement(bench, on), override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": switch}):
                w, c = overhead._time(bench, tenant, step, n)
            wall[name].append(w)
            if c is not None:
                cpu[name].append(c)
    figures = cpu if all(cpu.values()) else wall
    unit = "CPU µs (client + server)" if figures is cpu else "wall µs"
    for name in CASES:
        bench.report.add(
            Figure(
                "RLS: claim+finish via the services (1 proc)",
                name,
                f"{unit} per claim+finish",
                figures[name],
                figures["off"],
                target_ratio=None if name == "off" else TARGET,
                lower_is_better=True,
                note=f"wall {overhead.median(wall[name]):,.0f} µs",
            )
        )
    with connection.cursor() as cursor:
        cursor.execute("RESET synchronous_commit")

    count = bench.scaled(20_000, 4_000)
    rates: dict[bool, list[float]] = {False: [], True: []}
    for repeat in range(bench.repeats):
        for on in (False, True) if repeat % 2 == 0 else (True, False):
            with enforcement(bench, on):
                rate, _wall, _ = worker._drain_with_command(bench, tenant, count, quiet=True)
            rates[on].append(rate)
    for on in (False, True):
        bench.report.add(
            Figure(
                f"RLS: run_delivery_worker drain {count:,}, {worker.PROCESSES} proc, -v 0",
                "on (SWITCH_ROLES, tenant role)" if on else "off",
                "deliveries/s",
                rates[on],
                rates[False],
                target_ratio=1 / TARGET if on else None,
                note="the example project's settings: SWITCH_ROLES on",
            )
        )
