"""Row-level security under every community-scoped table (SPEC section 13, issue 14).

A superuser bypasses row-level security, so every test that judges a policy connects as (or
switches to) a role that is neither superuser, nor BYPASSRLS, nor the tables' owner, and asserts
those attributes first. The suite runs with enforcement on (``tests/conftest.py``).
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Iterator

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import override_settings

from buzz_delivery import isolation
from buzz_delivery.catalog import catalog_models
from buzz_delivery.models import Community
from buzz_delivery.services import claim_delivery, reap, tenancy
from buzz_delivery.testing import BindingFactory, CommunityFactory, DeliveryFactory, Expr, set_delivery_state
from tests.conftest import backdate_lease
from tests.lifecycle_support import fill_community
from tests.pgbouncer_support import pgbouncer  # noqa: F401  (the fixture)

TENANT_LOGIN = "buzz_test_tenant_login"
FLEET_LOGIN = "buzz_test_fleet_login"
pytestmark = pytest.mark.django_db


def _sql(statement: str, params: object = None) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


@pytest.fixture(scope="module")
def logins(django_db_setup, django_db_blocker) -> Iterator[None]:
    """Two LOGIN roles: a plain member of the tenant role and one of the maintenance role."""
    names = isolation.roles()
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        for login, group in ((TENANT_LOGIN, names.tenant), (FLEET_LOGIN, names.maintenance)):
            cursor.execute(
                f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{login}') THEN "
                f"CREATE ROLE {login} LOGIN NOSUPERUSER NOBYPASSRLS; END IF; END $$"
            )
            cursor.execute(f"GRANT {group} TO {login}")
    yield


def login(role: str) -> psycopg.Connection:
    """An autocommit connection to the test database as ``role`` (trust auth)."""
    s = connection.settings_dict
    conn = psycopg.connect(host=s["HOST"] or None, port=s["PORT"] or None, dbname=s["NAME"], user=role, autocommit=True)
    attributes = conn.execute(
        "SELECT r.rolsuper, r.rolbypassrls, pg_has_role(r.oid, c.relowner, 'USAGE') FROM pg_roles r,"
        " pg_class c WHERE r.rolname = current_user AND c.oid = 'buzz_delivery_delivery'::regclass"
    ).fetchone()
    assert attributes == (False, False, False), f"{role} would bypass RLS: {attributes}"
    return conn


def scoped_tables() -> list[str]:
    return [table for table, column in isolation.installed_tables() if column is not None]


def test_every_community_scoped_table_has_rls_forced_and_both_policies():
    states = {s.table: s for s in isolation.table_states(connection.cursor())}
    catalog = {m._meta.db_table for m in catalog_models()} | {Community._meta.db_table}
    assert catalog <= set(scoped_tables()), "a catalog table is not seen as community-scoped"
    missing = [t for t in scoped_tables() if t not in states or not states[t].complete]
    assert not missing, f"tables without RLS, FORCE or their policies: {missing}"


def test_every_table_of_the_apps_with_a_community_id_column_in_the_database_is_covered():
    """From the catalog, not the models: a table a migration made in raw SQL, or a model the
    isolation module does not list, would escape the test above."""
    prefixes = ("buzz_delivery_", "buzz_workflows_", "buzz_agents_", "buzz_gateway_", "buzz_tasks_")
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT c.relname FROM pg_attribute a
            JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE a.attname = 'community_id' AND NOT a.attisdropped AND c.relkind IN ('r', 'p')
              AND n.nspname = current_schema()
            """
        )
        in_database = {name for (name,) in cursor.fetchall() if name.startswith(prefixes)}
    assert len(in_database) >= 10, in_database  # the query finds the tables
    assert in_database <= set(scoped_tables()), f"not covered: {sorted(in_database - set(scoped_tables()))}"


@pytest.mark.django_db(transaction=True)
def test_a_tenant_login_with_no_context_sees_no_row_of_any_table(logins):
    fill_community(CommunityFactory(), engine=True)
    filled = [t for t in scoped_tables() if _sql(f"SELECT count(*) FROM {t}") != [(0,)]]
    assert len(filled) >= 10, filled  # the test can fail: these tables have rows
    with login(TENANT_LOGIN) as conn:
        for table in filled:
            seen = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            assert seen == 0, f"{table}: {seen} rows without a tenant context"


@pytest.mark.django_db(transaction=True)
def test_with_community_a_context_a_tenant_login_never_reads_writes_or_deletes_b_rows(logins):
    a, b = CommunityFactory(), CommunityFactory()
    fill_community(a, engine=True)
    fill_community(b, engine=True)
    before = {t: _sql(f"SELECT * FROM {t} ORDER BY 1") for t in scoped_tables()}
    with login(TENANT_LOGIN) as conn, conn.transaction():
        conn.execute("SELECT set_config('buzz.community_id', %s, true)", [str(a.id)])
        for table in scoped_tables():
            column = "id" if table == "buzz_delivery_community" else "community_id"
            seen = conn.execute(f"SELECT DISTINCT {column} FROM {table}").fetchall()
            assert set(seen) <= {(a.id,)}, f"{table} shows another community's rows"
            assert conn.execute(f"UPDATE {table} SET {column} = {column} WHERE {column} = %s", [b.id]).rowcount == 0
            if table != "buzz_delivery_community":  # the tenant role may not delete communities at all
                assert conn.execute(f"DELETE FROM {table} WHERE {column} = %s", [b.id]).rowcount == 0
    assert {t: _sql(f"SELECT * FROM {t} ORDER BY 1") for t in scoped_tables()} == before


@pytest.mark.django_db(transaction=True)
def test_an_insert_of_b_row_under_a_context_is_refused(logins):
    a, b = CommunityFactory(), CommunityFactory()
    with (
        login(TENANT_LOGIN) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"),
        conn.transaction(),
    ):
        conn.execute("SELECT set_config('buzz.community_id', %s, true)", [str(a.id)])
        conn.execute(
            "INSERT INTO buzz_delivery_workflow (id, community_id, name, created_at) VALUES (%s, %s, 'x', now())",
            [uuid.uuid4(), b.id],
        )
    assert _sql("SELECT count(*) FROM buzz_delivery_workflow WHERE community_id = %s", [b.id]) == [(0,)]


@pytest.mark.django_db(transaction=True)
def test_the_context_is_transaction_local(logins):
    a = CommunityFactory()
    with login(TENANT_LOGIN) as conn:
        with conn.transaction():
            conn.execute("SELECT set_config('buzz.community_id', %s, true)", [str(a.id)])
            assert conn.execute("SELECT count(*) FROM buzz_delivery_community").fetchone()[0] == 1
        assert conn.execute("SELECT count(*) FROM buzz_delivery_community").fetchone()[0] == 0


@pytest.mark.django_db(transaction=True)
def test_a_fleet_login_sees_every_community(logins):
    a, b = CommunityFactory(), CommunityFactory()
    with login(FLEET_LOGIN) as conn:
        seen = {row[0] for row in conn.execute("SELECT id FROM buzz_delivery_community").fetchall()}
    assert {a.id, b.id} <= seen


def _as_login_role(role: str) -> None:
    """Switch this test's transaction to ``role`` (a plain login role) and check it obeys RLS."""
    _sql(f"SET LOCAL ROLE {role}")
    attributes = _sql(
        "SELECT r.rolsuper, r.rolbypassrls, pg_has_role(r.oid, c.relowner, 'USAGE') FROM pg_roles r, pg_class c"
        " WHERE r.rolname = current_user AND c.oid = 'buzz_delivery_delivery'::regclass"
    )
    assert attributes == [(False, False, False)]


@override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": False})
def test_a_forgetful_statement_inside_a_tenant_scope_sees_only_that_community(logins, make_binding, community):
    other = CommunityFactory()
    DeliveryFactory(binding=make_binding())
    DeliveryFactory(binding=BindingFactory(run__community=other))
    _as_login_role(TENANT_LOGIN)
    with tenancy.tenant(community.id):
        rows = _sql("SELECT DISTINCT community_id FROM buzz_delivery_delivery")  # no community filter
    assert rows == [(community.id,)]
    assert _sql("SELECT count(*) FROM buzz_delivery_delivery") == [(0,)]  # and none outside it


@override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": False})
def test_the_services_work_as_a_tenant_login_and_never_claim_another_community_rows(logins, make_binding, community):
    other = CommunityFactory()
    theirs = DeliveryFactory(binding=BindingFactory(run__community=other))
    mine = DeliveryFactory(binding=make_binding())
    _as_login_role(TENANT_LOGIN)
    claim = claim_delivery(community.id, mine.target_pubkey)
    assert claim is not None and claim.delivery.id == mine.id
    assert claim_delivery(community.id, theirs.target_pubkey) is None
    assert claim_delivery(community.id, mine.target_pubkey, delivery_id=theirs.id) is None


@override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": False})
def test_the_reaper_works_fleet_wide_as_a_maintenance_login(logins, community):
    other = CommunityFactory()
    claims = []
    for c in (community, other):
        delivery = DeliveryFactory(binding=BindingFactory(run__community=c))
        claims.append(claim_delivery(c.id, delivery.target_pubkey))
        backdate_lease(delivery.id)
    _as_login_role(FLEET_LOGIN)
    assert reap().total == 2


def test_with_switch_roles_a_tenant_scope_runs_as_the_tenant_role_and_a_fleet_scope_as_maintenance(community):
    names = isolation.roles()
    with tenancy.tenant(community.id):
        assert _sql("SELECT current_user, current_setting('buzz.community_id')") == [(names.tenant, str(community.id))]
    with tenancy.fleet():
        assert _sql("SELECT current_user, current_setting('buzz.community_id')") == [(names.maintenance, "")]
    # and the test's own transaction is back to its login role and no context
    assert _sql("SELECT current_user = session_user, current_setting('buzz.community_id', true)")[0] in (
        (True, ""),
        (True, None),
    )


@pytest.mark.django_db(transaction=True)
def test_in_autocommit_a_scoped_statement_carries_its_context_and_leaves_none_behind(community):
    names = isolation.roles()
    with tenancy.tenant(community.id):
        assert _sql("SELECT current_user, current_setting('buzz.community_id')") == [(names.tenant, str(community.id))]
    assert _sql("SELECT current_user = session_user, coalesce(current_setting('buzz.community_id', true), '')") == [
        (True, "")
    ]


def test_tenant_isolation_status_reports_every_table_enforced():
    import io

    out = io.StringIO()
    call_command("tenant_isolation", "status", stdout=out)
    assert f"{len(scoped_tables())} of {len(scoped_tables())} community-scoped tables enforced" in out.getvalue()


@pytest.mark.django_db(transaction=True)
def test_tenant_isolation_disable_then_enable_round_trips_and_status_flags_a_mixed_state(community):
    import io

    try:
        call_command("tenant_isolation", "disable", stdout=io.StringIO())
        assert not isolation.enforced(connection.cursor())
        with tenancy.tenant(community.id):  # enforcement off: the scope sends nothing
            assert _sql("SELECT current_user = session_user")[0][0] is True
        _sql("ALTER TABLE buzz_delivery_event ENABLE ROW LEVEL SECURITY")
        with pytest.raises(CommandError) as raised:
            call_command("tenant_isolation", "status", stdout=io.StringIO())
        assert raised.value.returncode == 1
    finally:
        call_command("tenant_isolation", "enable", stdout=io.StringIO())
    assert isolation.enforced(connection.cursor())


def test_tenant_isolation_sql_prints_roles_grants_and_policies_for_a_dba():
    import io

    out = io.StringIO()
    call_command("tenant_isolation", "sql", stdout=out)
    text = out.getvalue()
    assert "CREATE ROLE" in text and "GRANT SELECT, INSERT, UPDATE, DELETE" in text
    assert text.count("CREATE POLICY buzz_tenant_rows") == len(scoped_tables())


def test_install_without_the_right_to_create_roles_warns_and_installs_nothing(logins):
    _sql(f"SET LOCAL ROLE {TENANT_LOGIN}")
    with (
        override_settings(BUZZ_DELIVERY={"TENANT_ROLE": "buzz_no_such_role"}),
        warnings.catch_warnings(record=True) as caught,
        connection.cursor() as cursor,
    ):
        warnings.simplefilter("always")
        assert isolation.install(cursor, [("buzz_delivery_event", "community_id")]) is False
    assert any("tenant_isolation sql" in str(w.message) for w in caught)
    assert _sql("SELECT count(*) FROM pg_roles WHERE rolname = 'buzz_no_such_role'") == [(0,)]


def test_check_warns_when_the_tenant_code_runs_as_a_superuser():
    from buzz_delivery.checks import check_runtime_role_obeys_rls

    with override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": False}):
        warned = check_runtime_role_obeys_rls(databases=["default"])
    assert [w.id for w in warned] == ["buzz_delivery.W020"] and "superuser" in warned[0].msg
    with override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": True}):
        assert check_runtime_role_obeys_rls(databases=["default"]) == []


def test_the_rls_check_is_a_database_check_that_manage_py_check_database_runs():
    from django.core import checks as django_checks

    with override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": False}):
        assert "buzz_delivery.W020" not in {m.id for m in django_checks.run_checks()}
        assert "buzz_delivery.W020" in {m.id for m in django_checks.run_checks(databases=["default"])}


def test_check_warns_when_the_runtime_role_has_bypassrls(logins):
    from buzz_delivery.checks import check_runtime_role_obeys_rls

    _sql("CREATE ROLE buzz_test_bypass NOLOGIN BYPASSRLS")
    _sql("GRANT buzz_test_bypass TO CURRENT_USER")
    with override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": True, "TENANT_ROLE": "buzz_test_bypass"}):
        warned = check_runtime_role_obeys_rls(databases=["default"])
    assert [w.id for w in warned] == ["buzz_delivery.W020"] and "BYPASSRLS" in warned[0].msg


@pytest.mark.django_db(transaction=True)
def test_behind_pgbouncer_in_transaction_mode_no_context_reaches_the_next_client(pgbouncer, community):  # noqa: F811
    """Client A runs a scoped statement the way the services do outside a transaction (the
    ``set_config`` in front of the statement, one simple query); client B, handed the same server
    connection next (PgBouncer reuses the last released one), sees no role and no context."""
    names = isolation.roles()
    with pgbouncer.connect() as a, pgbouncer.connect() as b:
        cursor = psycopg.ClientCursor(a)
        cursor.execute(
            "SELECT set_config('role', %s, true), set_config('buzz.community_id', %s, true);"
            " SELECT current_user, current_setting('buzz.community_id'), pg_backend_pid()",
            [names.tenant, str(community.id)],
        )
        cursor.nextset()
        user, context, pid = cursor.fetchone()
        assert (user, context) == (names.tenant, str(community.id))
        user, context, other_pid = b.execute(
            "SELECT current_user, coalesce(current_setting('buzz.community_id', true), ''), pg_backend_pid()"
        ).fetchone()
        assert other_pid == pid, "PgBouncer gave client B another server connection: the test proves nothing"
        assert context == ""
        assert user != names.tenant


APP_LOGIN = "buzz_test_app_login"


@pytest.fixture(scope="module")
def app_login(django_db_setup, django_db_blocker) -> Iterator[str]:
    """A production-shaped login: no superuser, no BYPASSRLS, not the owner, a NOINHERIT member
    of both roles, so that a statement outside the services has no privilege at all and the
    services switch to the tenant or maintenance role for each call (``SWITCH_ROLES``)."""
    names = isolation.roles()
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(
            f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{APP_LOGIN}') THEN "
            f"CREATE ROLE {APP_LOGIN} LOGIN NOSUPERUSER NOBYPASSRLS NOINHERIT; END IF; END $$"
        )
        cursor.execute(f"GRANT {names.tenant}, {names.maintenance} TO {APP_LOGIN}")
    yield APP_LOGIN


def _env_as(role: str) -> dict[str, str]:
    import os

    from project.database_url import database_url

    settings = {**connection.settings_dict, "USER": role, "PASSWORD": ""}
    return {
        **os.environ,
        "DATABASE_URL": database_url(settings),
        "BUZZ_SWITCH_ROLES": "true",
        "BUZZ_MIN_LEASE_SECONDS": "1",
    }


@pytest.mark.django_db(transaction=True)
def test_a_bare_statement_of_the_app_login_is_refused(app_login):
    with login(app_login) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("SELECT count(*) FROM buzz_delivery_delivery")


@pytest.mark.django_db(transaction=True)
def test_the_delivery_worker_drains_its_community_as_the_app_login(app_login, community, make_binding):
    import subprocess
    import sys

    from tests.worker_support import ROOT

    mine = [DeliveryFactory(binding=make_binding(target_pubkey=b"\x07" * 32)) for _ in range(5)]
    DeliveryFactory(binding=BindingFactory(run__community=CommunityFactory(), target_pubkey=b"\x07" * 32))
    done = subprocess.run(
        [
            sys.executable, "manage.py", "run_delivery_worker", "--community", str(community.id),
            "--target", (b"\x07" * 32).hex(), "--handler", "bench.handlers:noop",
            "--poll-interval", "0.2", "--idle-exit", "1",
        ],
        cwd=ROOT, env=_env_as(app_login), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "community_not_found" not in done.stderr  # the app login's fleet read sees the community
    statuses = _sql("SELECT status, count(*) FROM buzz_delivery_delivery GROUP BY 1 ORDER BY 1")
    assert statuses == [("finished", 5), ("pending", 1)], done.stderr[-3000:] + done.stdout
    assert {d.id for d in mine} == {
        r[0] for r in _sql("SELECT id FROM buzz_delivery_delivery WHERE status = 'finished'")
    }


@pytest.mark.django_db(transaction=True)
def test_the_orchestrator_runs_workflows_of_every_community_as_the_app_login(app_login, community):
    import json
    import signal
    import subprocess
    import sys
    import time

    from buzz_delivery.testing import WorkflowFactory
    from buzz_delivery.workflows.models import Run
    from buzz_delivery.workflows.testing import diamond
    from tests.wf_support import start
    from tests.worker_support import ROOT

    runs = [start(WorkflowFactory(community=c), diamond()) for c in (community, CommunityFactory())]
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "run_workflow_worker", "--all", "--poll-interval", "0.2"],
        cwd=ROOT, env=_env_as(app_login), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while set(Run.objects.filter(pk__in=[r.pk for r in runs]).values_list("state", flat=True)) != {"succeeded"}:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"runs did not finish: {proc.communicate()[1][-3000:]}")
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["claimed"], summary["succeeded"], summary["errors"]) == (8, 8, 0)


@override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": False})
def test_the_pruner_and_the_purge_work_fleet_wide_as_a_maintenance_login(logins):
    import datetime as dt

    from buzz_delivery.services import finish_delivery, prune_deliveries, purge_community
    from buzz_delivery.testing import advance_to

    communities = [CommunityFactory(), CommunityFactory()]
    for c in communities:
        delivery = DeliveryFactory(binding=BindingFactory(run__community=c))
        finish_delivery(claim_delivery(c.id, delivery.target_pubkey).lease, "finished")
    set_delivery_state(
        Expr("community_id = ANY(%s)", [[c.id for c in communities]]),
        finished_at=Expr("now() - interval '2 days'"),
        created_at=Expr("now() - interval '2 days'"),  # a terminal's created_at precedes its finished_at
    )
    doomed = CommunityFactory()
    fill_community(doomed)
    advance_to(doomed, "fenced")
    _as_login_role(FLEET_LOGIN)
    pruned = prune_deliveries({"finished": dt.timedelta(days=1)})
    assert pruned.total == 2
    purged = purge_community(doomed.id)
    assert sum(purged.deleted.values()) > 0
    assert _sql("SELECT count(*) FROM buzz_delivery_delivery WHERE community_id = %s", [doomed.id]) == [(0,)]


def test_the_admin_lists_every_community_deliveries_as_a_maintenance_login(logins, client, admin_user):
    mine = {
        DeliveryFactory(binding=BindingFactory(run__community=CommunityFactory())).id,
        DeliveryFactory(binding=BindingFactory(run__community=CommunityFactory())).id,
    }
    client.force_login(admin_user)
    _sql(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {FLEET_LOGIN}")
    _as_login_role(FLEET_LOGIN)
    response = client.get("/admin/buzz_delivery/workflowagentdelivery/")
    assert response.status_code == 200
    # the listed rows (the count may be a planner estimate: the paginator's, at scale)
    assert {d.id for d in response.context["cl"].result_list} == mine


@pytest.mark.django_db(transaction=True)
def test_the_agent_worker_runs_journaled_calls_and_compensations_as_the_app_login(app_login, community, tmp_path):
    import subprocess
    import sys

    from buzz_delivery.agents.models import AgentRun, JournalEntry, RunOutput
    from buzz_delivery.agents.services import intake_event
    from tests.agents_support import AGENT
    from tests.worker_support import ROOT

    def new(handler: str) -> uuid.UUID:
        outcome = intake_event(community.id, "test", uuid.uuid4().hex, {"handler": handler}, AGENT)
        return outcome.run_id

    done_run, failed_run, streamed_run = new("three_calls"), new("four_calls_fail"), new("streams")
    env = {**_env_as(app_login), "AGENT_LEDGER": str(tmp_path / "ledger")}
    done = subprocess.run(
        [
            sys.executable, "manage.py", "run_agent_worker", "--handler", "tests.agent_handlers:by_input",
            "--agent", AGENT.hex(), "--community", str(community.id), "--exit-when-idle",
            "--poll-seconds", "0.2", "--lease-seconds", "15",
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "community_not_found" not in done.stderr  # the app login's fleet read sees the community
    states = dict(AgentRun.objects.filter(community_id=community.id).values_list("id", "state"))
    assert states[done_run] == "completed", done.stderr[-3000:]
    assert states[failed_run] == "failed", done.stderr[-3000:]
    assert JournalEntry.objects.filter(community_id=community.id, run_id=done_run).count() == 3
    # ctx.emit writes its chunks as the app login too (RLS, grants), under the run's lease.
    assert states[streamed_run] == "completed", done.stderr[-3000:]
    streamed = RunOutput.objects.filter(community_id=community.id, run_id=streamed_run).order_by("seq")
    assert list(streamed.values_list("seq", "chunk")) == [(1, "thinking… "), (2, "done")]


def test_a_handler_scope_keeps_the_login_role_and_names_the_community(community):
    """Handlers (user code) keep the login's grants on the project's tables, even inside a tenant
    scope of the package's own, with their community as context."""
    with tenancy.tenant(community.id), tenancy.handler(community.id):
        assert _sql("SELECT current_user = session_user, current_setting('buzz.community_id')") == [
            (True, str(community.id))
        ]


@pytest.mark.django_db(transaction=True)
def test_in_autocommit_a_handler_scope_keeps_the_login_role(community):
    with tenancy.tenant(community.id), tenancy.handler(community.id):
        assert _sql("SELECT current_user = session_user, current_setting('buzz.community_id')") == [
            (True, str(community.id))
        ]


@override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": False})
def test_the_workers_community_check_sees_a_community_as_a_tenant_login(logins, community):
    """The documented login without role switching (a plain member of the tenant role, W020's
    hint): the workers' start-up check must not call its existing community missing."""
    from buzz_delivery.services import missing_communities

    absent = uuid.uuid4()
    _as_login_role(TENANT_LOGIN)
    assert missing_communities([community.id, absent]) == [absent]
