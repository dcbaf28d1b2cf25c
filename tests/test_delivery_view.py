"""The delivery table is the record behind a one-table view of its old name (issue 31, stage 1;
core migration 0034): the view applies the reader's row-level security, and the migration goes
back and forth over a table holding rows without losing or changing one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import override_settings

from buzz_delivery import scaleout, services
from buzz_delivery.models import SETTLE_TALLY_TABLE, DeliveryQueue, DeliveryRecord, WorkflowAgentDelivery
from buzz_delivery.services import Settled, claim_delivery, tenancy
from buzz_delivery.testing import BindingFactory, CommunityFactory, DeliveryFactory
from tests.citus_support import CITUS_MODE
from tests.test_tenant_isolation import TENANT_LOGIN, _as_login_role, logins  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("migrated_after")]

VIEW = WorkflowAgentDelivery._meta.db_table
RECORD = DeliveryRecord._meta.db_table
QUEUE = DeliveryQueue._meta.db_table
ROOT = Path(__file__).resolve().parent.parent


def _sql(statement: str, params: object = None) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


def test_the_model_of_the_readers_is_an_unmanaged_view_over_the_record():
    assert (VIEW, RECORD) == ("buzz_delivery_delivery", "buzz_delivery_delivery_record")
    assert not WorkflowAgentDelivery._meta.managed and DeliveryRecord._meta.managed
    kinds = dict(_sql("SELECT relname, relkind::text FROM pg_class WHERE relname = ANY(%s)", [[VIEW, RECORD]]))
    assert kinds == {VIEW: "v", RECORD: "r"}
    columns = [f.column for f in WorkflowAgentDelivery._meta.concrete_fields]
    assert sorted(columns) == sorted(f.column for f in DeliveryRecord._meta.concrete_fields)
    in_view = _sql("SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0", [VIEW])
    assert sorted(name for (name,) in in_view) == sorted(columns)


@pytest.mark.skipif(CITUS_MODE, reason="row-level security is not on Citus in this version (SPEC section 13)")
@override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": False})
def test_the_view_is_security_invoker_a_tenant_reads_only_its_communitys_rows_through_it(
    logins,  # noqa: F811
    make_binding,
    community,
):
    other = CommunityFactory()
    mine = DeliveryFactory(binding=make_binding())
    DeliveryFactory(binding=BindingFactory(run__community=other))
    assert _sql("SELECT count(DISTINCT community_id) FROM buzz_delivery_delivery") == [(2,)]
    assert _sql("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", [VIEW]) == [(["security_invoker=true"],)]
    _as_login_role(TENANT_LOGIN)
    with tenancy.tenant(community.id):
        assert _sql("SELECT id FROM buzz_delivery_delivery") == [(mine.id,)]  # no community filter
        assert list(WorkflowAgentDelivery.objects.values_list("id", flat=True)) == [mine.id]
    assert _sql("SELECT count(*) FROM buzz_delivery_delivery") == [(0,)]  # no context: no row


def _rows() -> list[tuple]:
    return _sql(f"SELECT * FROM {VIEW} ORDER BY id")


@pytest.mark.django_db(transaction=True)
def test_the_migration_goes_back_to_a_table_and_forward_to_the_view_with_every_row_intact(community, make_binding):
    claimed = DeliveryFactory(binding=make_binding())
    finished = DeliveryFactory(binding=make_binding())
    pending = DeliveryFactory(binding=make_binding())
    # The longest lease: it must outlast two migrations (53 s of the default 60 on a loaded
    # machine; a lapsed lease settled nothing and the row stayed claimed).
    held = claim_delivery(community.id, claimed.target_pubkey, delivery_id=claimed.id, lease_seconds=300)
    done = claim_delivery(community.id, finished.target_pubkey, delivery_id=finished.id)
    assert held is not None and done is not None
    services.finish_delivery(done.lease, outcome="finished")
    before = _rows()
    assert sorted(r.status for r in WorkflowAgentDelivery.objects.all()) == ["claimed", "finished", "pending"]

    call_command("migrate", "buzz_delivery", "0033", verbosity=0)
    try:
        assert _sql("SELECT relkind::text FROM pg_class WHERE relname = %s", [VIEW]) == [("r",)]
        assert _sql("SELECT to_regclass(%s)::text", [RECORD]) == [(None,)]
        assert _rows() == before
        # The functions' old bodies are back and name the table again.
        assert _sql("SELECT count(*) FROM pg_proc WHERE prosrc ~ %s", [RECORD]) == [(0,)]
    finally:
        call_command("migrate", verbosity=0)
        if CITUS_MODE:  # the re-created functions are delegated again (docs/scale-out.md)
            scaleout.distribute_tables()

    assert _rows() == before
    # The services write through the record again: the held lease settles, the pending row claims.
    assert services.finish_delivery(held.lease, outcome="finished") == Settled("finished")
    again = claim_delivery(community.id, pending.target_pubkey, delivery_id=pending.id)
    assert again is not None
    assert services.finish_delivery(again.lease, outcome="finished") == Settled("finished")
    assert sorted(r.status for r in WorkflowAgentDelivery.objects.all()) == ["finished"] * 3


def test_the_changelists_state_filters_narrow_through_one_function(admin_client, make_binding, monkeypatch):
    """The seam a later stage re-points (the list by status read from the table owning it):
    the status, failure-code and lease filters all call ``filters.by_state``."""
    from buzz_delivery.admin import filters
    from tests.test_admin import changelist, listed_ids

    pending = DeliveryFactory(binding=make_binding())
    calls = []
    real = filters.by_state

    def spy(queryset, **state):
        calls.append(state)
        return real(queryset, **state)

    monkeypatch.setattr(filters, "by_state", spy)
    assert listed_ids(changelist(admin_client, status__exact="pending")) == {str(pending.id)}
    assert listed_ids(changelist(admin_client, status__exact="claimed")) == set()
    assert listed_ids(changelist(admin_client, failure_code="attempts_exhausted")) == set()
    assert listed_ids(changelist(admin_client, lease_expired="yes")) == set()
    assert listed_ids(changelist(admin_client)) == {str(pending.id)}
    assert calls == [
        {"status": "pending"},
        {"status": "claimed"},
        {"failure_code": "attempts_exhausted"},
        {"lease": "expired"},
    ]


READER = "buzz_test_delivery_reader"


@pytest.mark.django_db(transaction=True)
def test_a_role_that_read_the_table_before_the_migration_reads_the_view_after_it(community, make_binding):
    """A role an operator granted ``SELECT`` on the delivery table (a dashboard, a report) keeps
    reading it under its name: the table's grants follow the rename to the record, and the
    migration gives the view the same readers (``security_invoker``: the record's grants and
    row-level security still decide what they see)."""
    DeliveryFactory(binding=make_binding())
    call_command("migrate", "buzz_delivery", "0033", verbosity=0)
    try:
        _sql(
            f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{READER}') THEN "
            f"CREATE ROLE {READER} LOGIN NOSUPERUSER NOBYPASSRLS; END IF; END $$"
        )
        _sql(f"GRANT SELECT ON {VIEW} TO {READER}")  # still the table, before 0034
    finally:
        call_command("migrate", verbosity=0)
        if CITUS_MODE:
            scaleout.distribute_tables()
    try:
        assert _sql("SELECT has_table_privilege(%s, %s, 'SELECT')", [READER, RECORD]) == [(True,)]
        assert _sql("SELECT has_table_privilege(%s, %s, 'SELECT')", [READER, VIEW]) == [(True,)]
        # The view joins the live queue (core 0037): the queue has the record's readers.
        assert _sql("SELECT has_table_privilege(%s, %s, 'SELECT')", [READER, QUEUE]) == [(True,)]
        # Only what the table gave: the view is read-only to it, as to everyone.
        assert _sql("SELECT has_table_privilege(%s, %s, 'UPDATE')", [READER, VIEW]) == [(False,)]
        with connection.cursor() as cursor:
            cursor.execute("BEGIN")
            try:
                cursor.execute(f"SET LOCAL ROLE {READER}")
                cursor.execute(f"SELECT count(*) FROM {VIEW}")  # no "permission denied"
                cursor.fetchall()
            finally:
                cursor.execute("ROLLBACK")
    finally:
        _sql(f"REVOKE ALL ON {RECORD} FROM {READER}")
        _sql(f"REVOKE ALL ON {QUEUE} FROM {READER}")
        _sql(f"REVOKE ALL ON {SETTLE_TALLY_TABLE} FROM {READER}")  # the record's readers too (core 0039)
        _sql(f"REVOKE ALL ON {VIEW} FROM {READER}")
        _sql(f"DROP ROLE {READER}")


def _migrate(url: str, settings: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": settings, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "migrate", "-v0"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.skipif(CITUS_MODE, reason="a new database of its own, on plain PostgreSQL (migration order only)")
@pytest.mark.django_db(transaction=True)
def test_a_sibling_app_installed_after_the_migration_migrates_onto_the_record():
    """A deployment migrated past 0034 without ``buzz_delivery.tasks`` then installs it: its
    first migration (a foreign key into the delivery table) runs after the rename, and 0034's
    history stays consistent (it cannot depend on an app that was not installed when it ran)."""
    settings = connection.settings_dict
    name = f"{settings['NAME']}_late_app"
    url = f"postgres://{settings['USER']}@{settings['HOST']}:{settings['PORT']}/{name}"
    with connection.cursor() as cursor:
        cursor.execute(f'DROP DATABASE IF EXISTS "{name}"')
        cursor.execute(f'CREATE DATABASE "{name}"')
    try:
        first = _migrate(url, "tests.settings_without_tasks")
        assert first.returncode == 0, first.stderr[-3000:]
        then = _migrate(url, "project.settings")
        assert then.returncode == 0, then.stderr[-3000:]
        check = subprocess.run(
            [
                sys.executable,
                "-c",
                "import psycopg, sys\n"
                "with psycopg.connect(sys.argv[1]) as c:\n"
                '    print(c.execute("SELECT confrelid::regclass::text FROM pg_constraint'
                " WHERE conname = 'task_result_delivery_same_community'\").fetchone()[0])",
                url.replace("postgres://", "postgresql://"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert check.stdout.strip() == RECORD, check.stderr
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
