"""Regression tests for the defects a hostile review of the row-level security implementation
found (issue 14, SPEC section 13): one test per defect, each failing on the first version.

Tests that judge a policy run as a role that is neither superuser, nor BYPASSRLS, nor the tables'
owner, and assert it (a superuser bypasses RLS, so a test run as one proves nothing)."""

from __future__ import annotations

import io

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.test import override_settings

from buzz_delivery import isolation
from buzz_delivery.checks import check_runtime_role_obeys_rls
from buzz_delivery.gateway import services as gateway
from buzz_delivery.models import Community
from buzz_delivery.services import tenancy
from buzz_delivery.testing import CommunityFactory, DeliveryFactory, WorkflowRunFactory, random32
from buzz_delivery.worker import WorkerConfig, run_worker
from tests.test_tenant_isolation import FLEET_LOGIN, TENANT_LOGIN, login, logins  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db


def _sql(statement: str, params: object = None) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


def _who() -> tuple:
    """(current_user is the login, the community context) of the default connection."""
    return _sql("SELECT current_user = session_user, coalesce(current_setting('buzz.community_id', true), '')")[0]


def _obeys_rls() -> None:
    attributes = _sql(
        "SELECT r.rolsuper, r.rolbypassrls, pg_has_role(r.oid, c.relowner, 'USAGE') FROM pg_roles r, pg_class c"
        " WHERE r.rolname = current_user AND c.oid = 'buzz_delivery_delivery'::regclass"
    )
    assert attributes == [(False, False, False)], attributes


def _role(name: str, *options: str, member_of: tuple[str, ...] = ()) -> None:
    """Create a role for this test's transaction (rolled back with it)."""
    _sql(f"CREATE ROLE {name} {' '.join(options)}")
    for group in member_of:
        _sql(f"GRANT {group} TO {name}")


# --- 1. leaks: a scope's role and context survive it ------------------------------------------


def test_executemany_as_the_first_statement_of_a_scope_inside_a_transaction_leaves_no_role_behind(community):
    """tenancy._Prefix._on_its_own opens transaction.atomic(): inside a transaction that is a
    SAVEPOINT statement, which goes through the same execute_wrapper and is prefixed with SWAP
    (previous = the transaction's own role/context); then the raw SWAP runs again and overwrites
    ``previous`` with the scope's own values. restore() then "puts back" the tenant role and
    community A: every later statement of the caller's transaction runs as buzz_tenant in A."""
    with tenancy.tenant(community.id), connection.cursor() as cursor:
        cursor.executemany("SELECT %s", [[1], [2]])
    assert _who() == (True, "")


def test_a_server_side_iterator_first_in_a_scope_inside_a_transaction_leaves_no_role_behind(community):
    """The same path for a server-side (named) cursor: QuerySet.iterator() in a tenant scope
    opened inside a caller's transaction, a report's natural shape."""
    with tenancy.tenant(community.id):
        assert len(list(Community.objects.all().iterator())) == 1
    assert _who() == (True, "")


@pytest.mark.django_db(transaction=True)
def test_a_scope_in_manual_transaction_mode_leaves_no_role_or_context_behind():
    """scope() decides 'outside a transaction' from connection.in_atomic_block; with Django's
    manual transaction mode (set_autocommit(False), or DATABASES AUTOCOMMIT=False) a
    transaction is open although no atomic block is, so each statement is prefixed with a
    transaction-local set_config that outlives the scope until commit, and nothing restores it."""
    a, b = CommunityFactory(), CommunityFactory()
    transaction.set_autocommit(False)
    try:
        with tenancy.tenant(a.id):
            assert Community.objects.count() == 1
        after = _who()
        visible = Community.objects.filter(id=b.id).count()
    finally:
        transaction.rollback()
        transaction.set_autocommit(True)
    assert after == (True, "") and visible == 1


def test_a_savepoint_rolled_back_inside_a_tenant_scope_does_not_hand_its_statements_to_the_login_role(community):
    """Inside a transaction the scope sets its context once, with its first statement, and
    never again. A savepoint taken before the scope and rolled back inside it undoes that
    set_config (GUCs are transactional): the scope's later statements run as the login (here
    a superuser, under SWITCH_ROLES) with no context, and see every community's rows."""
    CommunityFactory()
    # Django 6.1 renamed savepoint() savepoint_create() (the old name warns, an error here).
    sid = getattr(transaction, "savepoint_create", transaction.savepoint)()
    with tenancy.tenant(community.id):
        assert Community.objects.count() == 1
        transaction.savepoint_rollback(sid)
        seen = Community.objects.count()
        who = _who()
    assert (seen, who) == (1, (False, str(community.id)))


# --- 2. missed scoping ----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_delivery_worker_runs_its_handler_with_its_community_as_context_and_the_login_role():
    """The handler (user code) keeps the login's role, so the login's grants on the project's
    own tables, with its delivery's community as context: a login subject to RLS (a member of
    the tenant role) sees only that community's rows of ours. (Found by the RLS review: the
    handler ran with no scope at all.)"""
    a, b = CommunityFactory(), CommunityFactory()
    target = random32()
    DeliveryFactory(binding__run=WorkflowRunFactory(community=a), binding__target_pubkey=target)
    DeliveryFactory(binding__run=WorkflowRunFactory(community=b), binding__target_pubkey=target)
    seen: list[tuple] = []

    def handler(delivery: object) -> None:
        try:
            seen.append(
                _sql(
                    "SELECT current_user, coalesce(current_setting('buzz.community_id', true), ''),"
                    " (SELECT count(DISTINCT community_id) FROM buzz_delivery_delivery)"
                )[0]
            )
        finally:
            connection.close()

    summary = run_worker(
        WorkerConfig(community_id=a.id, target_pubkey=target, handler=handler, max_deliveries=1, poll_interval=0.1),
        handle_signals=False,
    )
    assert summary["finished"] == 1, summary
    login = _sql("SELECT session_user")[0][0]
    assert seen == [(login, str(a.id), seen[0][2])]


@pytest.mark.xfail(
    strict=True,
    reason="known limit (docs/tenant-isolation.md): the gateway's look-up of a key's communities is a fleet "
    "read; run the gateway with SWITCH_ROLES or a login that may assume the maintenance role",
)
@override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": False})
def test_with_the_documented_tenant_login_the_gateway_finds_the_communities_a_key_is_enrolled_in(logins):  # noqa: F811
    """docs/tenant-isolation.md gives the gateway a plain member of buzz_tenant (SWITCH_ROLES
    off). Its /claim and /me start with gateway.enrolled_communities(), a @fleet_scoped read:
    without SWITCH_ROLES a fleet scope does nothing, the tenant login has no context, sees no
    enrollment, and every claim is 403 not_enrolled."""
    agent = random32()
    community = CommunityFactory()
    gateway.enroll(community.id, agent, enrolled_by="review")
    _sql(f"SET LOCAL ROLE {TENANT_LOGIN}")
    _obeys_rls()
    assert gateway.is_enrolled(community.id, agent)  # the tenant-scoped check works
    assert gateway.enrolled_communities(agent) == [community.id]


def test_operator_commands_read_in_a_fleet_scope(logins):  # noqa: F811
    """gateway_enrollment list (and purge_community's look-up of the community) read
    community-scoped tables with no scope: under SWITCH_ROLES they run as the login, not as
    the maintenance role. With a login that may only SET ROLE to the two roles (NOINHERIT, the
    one non-superuser login under which forgetful code is fail-closed) the listing fails."""
    community = CommunityFactory()
    agent = random32()
    gateway.enroll(community.id, agent, enrolled_by="review")
    names = isolation.roles()
    _role("buzz_review_switcher", "LOGIN", "NOINHERIT", member_of=(names.tenant, names.maintenance))
    _sql("SET LOCAL ROLE buzz_review_switcher")
    _obeys_rls()
    out = io.StringIO()
    call_command("gateway_enrollment", "list", "--community", str(community.id), stdout=out)
    assert agent.hex() in out.getvalue()


# --- 4. policies: tables without community_id -----------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "statement",
    [
        "DELETE FROM buzz_gateway_seen_event",
        "UPDATE buzz_gateway_seen_event SET seen_at = now()",
        "SELECT count(*) FROM buzz_delivery_maintenance_lease",
        "DELETE FROM buzz_delivery_maintenance_lease",
    ],
)
def test_a_tenant_login_cannot_read_or_erase_the_fleet_tables_without_community(logins, statement):  # noqa: F811
    """The tables without community_id: the tenant role may only record a replay-store event id
    (INSERT, and SELECT of event_id, which ON CONFLICT (event_id) needs), never erase or move
    them (replays would pass), and cannot touch the maintenance commands' overlap leases."""
    with login(TENANT_LOGIN) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(statement)


@pytest.mark.django_db(transaction=True)
def test_a_tenant_context_cannot_move_its_own_community_through_the_lifecycle(logins):  # noqa: F811
    """Lifecycle moves are fleet work (advance_community is @fleet_scoped), but the tenant
    policy on buzz_delivery_community is FOR ALL: code in A's tenant scope may fence (or, when
    empty, delete) its own community."""
    a = CommunityFactory()
    with login(TENANT_LOGIN) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege), conn.transaction():
        conn.execute("SELECT set_config('buzz.community_id', %s, true)", [str(a.id)])
        conn.execute("UPDATE buzz_delivery_community SET deletion_state = 'quiescing' WHERE id = %s", [a.id])
    assert Community.objects.get(id=a.id).deletion_state == "active"


# --- 5. the check and the command -----------------------------------------------------------


@override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": False})
def test_check_warns_when_the_runtime_login_is_also_a_member_of_the_maintenance_role(community):
    """check_runtime_role_obeys_rls looks at rolsuper, rolbypassrls and ownership only. A login
    that is a member of both roles (an easy mistake: one login for the gateway and cron) gets
    the permissive fleet policy too and reads every community under any tenant context, with
    no warning."""
    names = isolation.roles()
    other = CommunityFactory()
    _role("buzz_review_both", "LOGIN", member_of=(names.tenant, names.maintenance))
    _sql("SET LOCAL ROLE buzz_review_both")
    _obeys_rls()
    with tenancy.tenant(community.id):
        assert _sql("SELECT count(*) FROM buzz_delivery_community WHERE id = %s", [other.id]) == [(1,)]
    assert [w.id for w in check_runtime_role_obeys_rls(databases=["default"])] == ["buzz_delivery.W020"]


@override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": True, "TENANT_ROLE": "buzz_review_tenant"})
def test_check_warns_when_the_tenant_role_is_a_member_of_the_maintenance_role(community):
    """With SWITCH_ROLES the check judges the tenant role's own attributes, not its
    memberships: a tenant role granted the maintenance role sees every community."""
    names = isolation.roles()
    _role("buzz_review_tenant", "NOLOGIN", member_of=(names.maintenance,))
    _sql("GRANT buzz_review_tenant TO CURRENT_USER")
    assert [w.id for w in check_runtime_role_obeys_rls(databases=["default"])] == ["buzz_delivery.W020"]


def test_enable_as_a_role_that_does_not_own_the_tables_is_refused_with_exit_3(logins):  # noqa: F811
    """IsolationError's docstring (and docs: 'exits 3 and changes nothing') cover 'not the
    tables' owner', but switch() never checks ownership: a non-owner gets a raw
    ProgrammingError (a traceback, exit 1) from the first GRANT."""
    _sql(f"SET LOCAL ROLE {FLEET_LOGIN}")
    with pytest.raises(CommandError) as raised, transaction.atomic():
        call_command("tenant_isolation", "enable", stdout=io.StringIO())
    assert raised.value.returncode == 3


# --- 3. the SQL prefixing -------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_composed_statement_runs_inside_a_scope():
    """_Prefix.__call__ builds f"{prefix}; {sql}": a psycopg.sql.Composed statement (which
    Django's cursor passes through to psycopg, and which runs fine outside a scope) becomes
    the text "Composed([...])" inside one: a syntax error. (_several_statements would raise
    AttributeError on the pipeline path.)"""
    from psycopg import sql as pgsql

    community = CommunityFactory()
    statement = pgsql.SQL("SELECT count(*) FROM {}").format(pgsql.Identifier("buzz_delivery_community"))
    with tenancy.tenant(community.id):
        assert _sql(statement) == [(1,)]
