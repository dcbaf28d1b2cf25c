"""Shared fixtures. Every test runs against a real PostgreSQL (DATABASE_URL or the embedded default)."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from buzz_delivery import models
from buzz_delivery.testing import (
    BindingFactory,
    CommunityFactory,
    EventFactory,
    Expr,
    WorkflowRunFactory,
    set_delivery_state,
)
from tests.worker_support import start_worker  # noqa: F401 (a fixture)


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):  # pytest-django's, extended
    """The suite runs with row-level security on (SPEC section 13), unless
    ``BUZZ_TENANT_ISOLATION=off``; on a Citus cluster, where it is not supported, it stays off."""
    if os.environ.get("BUZZ_TENANT_ISOLATION", "on") == "off":
        return
    with django_db_blocker.unblock():
        try:
            call_command("tenant_isolation", "enable", stdout=io.StringIO())
        except CommandError as exc:
            if getattr(exc, "returncode", None) != 3:
                raise


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In the Citus mode, skip what ``tests/citus_mode.py`` lists, with its reason."""
    from tests.citus_support import CITUS_MODE

    if not CITUS_MODE:
        return
    from tests.citus_mode import skip_reason

    for item in items:
        reason = skip_reason(item.nodeid)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"Citus mode: {reason}"))


@pytest.fixture
def community() -> models.Community:
    return CommunityFactory()


@pytest.fixture
def run(community: models.Community) -> models.WorkflowRun:
    return WorkflowRunFactory(community=community)


@pytest.fixture
def message_event(community: models.Community) -> models.Event:
    return EventFactory(community=community)


@pytest.fixture
def make_binding(run: models.WorkflowRun, message_event: models.Event):
    """Build bindings on the shared run and message event; override any field by keyword."""

    def make(**overrides):
        overrides.setdefault("run", run)
        overrides.setdefault("message_event", message_event)
        return BindingFactory(**overrides)

    return make


def unapplied_migrations() -> list[str]:
    """The migrations of every app that ``migrate`` would apply now (none once it has run)."""
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    return [f"{migration.app_label}.{migration.name}" for migration, _backwards in plan]


@pytest.fixture
def migrated_after() -> Iterator[None]:
    """For the modules whose tests migrate back (their ``pytestmark``): after each test every
    migration must be applied again. One that left the database part-way failed tests of other
    modules instead, whichever ran after it and before the next test that migrates forward:
    core 0037 without 0038 (the plan-cached claim still writes the record, the view reads the
    queue) made test_policy's concurrent claims read generation 0. Reported here, against the test
    that did it, after migrating forward so that nothing after it inherits the state. Inside a
    test's own transaction (still open here: not a ``transaction=True`` test) whatever it
    migrated is rolled back with it, and its role may be switched: nothing to check there."""
    yield
    if connection.in_atomic_block:
        return
    left = unapplied_migrations()
    if left:
        call_command("migrate", verbosity=0)
        from tests.citus_support import CITUS_MODE

        if CITUS_MODE:  # the re-created functions are delegated again (docs/scale-out.md)
            from buzz_delivery import scaleout

            scaleout.distribute_tables()
    assert not left, f"the test left these migrations unapplied: {left}"


# Seconds a thread of a concurrency test waits at its start barrier: one thread that died before
# it got there (e.g. no connection: the server's max_connections) breaks the barrier for all,
# and the test fails with BrokenBarrierError instead of hanging.
BARRIER_TIMEOUT = 60


def without_context(sql: str) -> str:
    """A logged statement without the tenant context the services send in front of it
    (``SELECT set_config(...); <statement>``, SPEC section 13)."""
    if sql.startswith(("SELECT set_config(", "SELECT o.r, o.c FROM")):
        return sql.split("; ", 1)[1]
    return sql


def backdate_lease(delivery_id, seconds: float = 3600) -> None:
    """Stand-in for time passing: move a lease deadline into the past (``claimed_at`` with it)."""
    set_delivery_state(
        delivery_id,
        lease_until=Expr("now() - make_interval(secs => %s)", [seconds]),
        claimed_at=Expr("buzz_delivery_plus_seconds(claimed_at, -%s)", [seconds]),
    )


def db_clock():
    """The database server's clock right now (``clock_timestamp()``), to bracket a lease call:
    the services judge by the clock of their own statement, which lies between two readings."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


@pytest.fixture
def table_snapshot() -> Iterator[callable]:
    """Return a function that snapshots every buzz_delivery table (for nothing-written checks)."""

    def snap() -> dict[str, list[tuple]]:
        out = {}
        with connection.cursor() as cursor:
            for model in (
                models.Community,
                models.Workflow,
                models.WorkflowRun,
                models.Event,
                models.WorkflowAgentDelivery,
            ):
                table = model._meta.db_table
                cursor.execute(f"SELECT * FROM {table} ORDER BY 1")
                out[table] = cursor.fetchall()
        return out

    yield snap


def lock_waits_reach(count: int, timeout: float) -> bool:
    """True once ``count`` backends of the test database wait on a lock (within ``timeout``
    seconds), read on a connection of its own: a lock-order test lines its transactions up with
    it. On Citus the waits happen on the workers, unseen on the coordinator: a fixed pause
    stands in (and it returns False)."""
    import time

    import psycopg

    from tests.citus_support import CITUS_MODE

    if CITUS_MODE:
        time.sleep(min(timeout, 0.5))
        return False
    s = connection.settings_dict
    deadline = time.monotonic() + timeout
    with psycopg.connect(dbname=s["NAME"], user=s["USER"], host=s["HOST"], port=s["PORT"], autocommit=True) as probe:
        while time.monotonic() < deadline:
            found = probe.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ).fetchone()[0]
            if found >= count:
                return True
            time.sleep(0.02)
    return False


def collecting(errors: list[BaseException]):
    """A decorator for a thread's body in a concurrency test: what the body raises goes to
    ``errors`` (the test asserts it empty), and the thread's connection is closed at its end."""

    def wrap(body):
        def run_it() -> None:
            try:
                body()
            except BaseException as exc:
                errors.append(exc)
            finally:
                connection.close()

        return run_it

    return wrap
