"""Row-level security under every community-scoped table (SPEC section 13): the roles, grants
and policies, and the switch that turns enforcement on and off.

Two roles (names from ``BUZZ_DELIVERY["TENANT_ROLE"]`` and ``["MAINTENANCE_ROLE"]``, default
``buzz_tenant`` and ``buzz_maintenance``), both ``NOLOGIN``, both granted DML on the apps'
tables. Two permissive policies on every community-scoped table (a table with a
``community_id`` column, and the community table itself by its ``id``):

- ``buzz_tenant_rows``, for the tenant role: only the rows whose community is the
  transaction-local setting ``buzz.community_id`` (:data:`CONTEXT_SETTING`). Unset or empty
  means no rows at all, for reads and for writes (fail closed);
- ``buzz_fleet_rows``, for the maintenance role: every row (the reaper, the pruner, the purge,
  the orchestrator's maintenance, operators).

Migrations create the roles where the migrating user may (a superuser, or ``CREATEROLE``) and
install grants and policies once the roles exist; where it may not, they skip with a warning and
``manage.py tenant_isolation sql`` prints the statements for a DBA (the settings then name the
roles the DBA created). Enforcement itself (``ENABLE`` and ``FORCE ROW LEVEL SECURITY``) is
switched by ``manage.py tenant_isolation enable | disable | status``, so an existing install can
adopt it. Nothing here is session-level: behind a transaction pooler no tenant state leaks.

Not supported on Citus in this version: a worker node does not see the coordinator's
``set_config`` (``tenant_isolation enable`` refuses there).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import models

from buzz_delivery.conf import raw_settings

# The transaction-local setting that names the tenant (a community id, or '' for none).
CONTEXT_SETTING = "buzz.community_id"
TENANT_POLICY = "buzz_tenant_rows"
TENANT_READ_POLICY = "buzz_tenant_reads"  # the community table only
FLEET_POLICY = "buzz_fleet_rows"
COMMUNITY_TABLE = "buzz_delivery_community"
# The apps whose tables the roles are granted and whose community-scoped tables get policies.
APP_LABELS = ("buzz_delivery", "buzz_workflows", "buzz_agents", "buzz_gateway", "buzz_tasks")

CURRENT_COMMUNITY_FUNCTION = f"""
CREATE OR REPLACE FUNCTION buzz_delivery_current_community() RETURNS uuid
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT nullif(current_setting('{CONTEXT_SETTING}', true), '')::uuid
$$;
"""
DROP_CURRENT_COMMUNITY_FUNCTION = "DROP FUNCTION IF EXISTS buzz_delivery_current_community()"


class IsolationError(RuntimeError):
    """Enforcement cannot be switched: roles missing, not the tables' owner, or Citus."""


@dataclass(frozen=True, slots=True)
class Roles:
    """The role names the policies name: ``tenant`` and ``maintenance`` (str)."""

    tenant: str
    maintenance: str


def roles() -> Roles:
    """The configured role names (``BUZZ_DELIVERY["TENANT_ROLE"]``/``["MAINTENANCE_ROLE"]``)."""
    raw = raw_settings()
    return Roles(tenant=raw["TENANT_ROLE"], maintenance=raw["MAINTENANCE_ROLE"])


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def community_column(model: type[models.Model]) -> str | None:
    """The column naming a row's community: ``id`` for the community table, ``community_id``
    for a community-scoped table, None for any other table."""
    if model._meta.db_table == COMMUNITY_TABLE:
        return "id"
    columns = {getattr(f, "column", None) for f in model._meta.concrete_fields}
    return "community_id" if "community_id" in columns else None


def app_tables(app_models: Iterable[type[models.Model]]) -> list[tuple[str, str | None]]:
    """``(db_table, community column or None)`` for every concrete, managed model given."""
    out = []
    for model in app_models:
        meta = model._meta
        if meta.proxy or not meta.managed or meta.abstract:
            continue
        out.append((meta.db_table, community_column(model)))
    return out


def app_views(app_models: Iterable[type[models.Model]]) -> list[str]:
    """The views among the models given: an unmanaged model's ``db_table`` (today the delivery
    view, ``buzz_delivery_delivery``, over its record). Both roles read them (``security_invoker``:
    the reader's row-level security on the tables beneath applies); nobody writes through them."""
    return [m._meta.db_table for m in app_models if not (m._meta.managed or m._meta.proxy or m._meta.abstract)]


def _installed_models() -> list[type[models.Model]]:
    from django.apps import apps

    found: list[type[models.Model]] = []
    for label in APP_LABELS:
        if apps.is_installed(_APP_NAMES[label]):
            found.extend(apps.get_app_config(label).get_models())
    return found


def installed_views() -> list[str]:
    """:func:`app_views` over the installed apps of :data:`APP_LABELS`."""
    return app_views(_installed_models())


def installed_tables() -> list[tuple[str, str | None]]:
    """:func:`app_tables` over the installed apps of :data:`APP_LABELS`."""
    return app_tables(_installed_models())


_APP_NAMES = {
    "buzz_delivery": "buzz_delivery",
    "buzz_workflows": "buzz_delivery.workflows",
    "buzz_agents": "buzz_delivery.agents",
    "buzz_gateway": "buzz_delivery.gateway",
    "buzz_tasks": "buzz_delivery.tasks",
}


def role_sql(names: Roles) -> list[str]:
    """Statements that create the two roles where they are missing (a DBA's script)."""
    return [
        f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{name}') THEN "
        f"CREATE ROLE {_ident(name)} NOLOGIN NOSUPERUSER NOBYPASSRLS; END IF; END $$"
        for name in (names.tenant, names.maintenance)
    ]


# What the tenant role may do on a table without a community: the gateway's replay store takes
# an INSERT ... ON CONFLICT (event_id) DO NOTHING from tenant-facing code; nothing else.
TENANT_TABLE_GRANTS = {"buzz_gateway_seen_event": "INSERT, SELECT (event_id)"}


def sequence_sql(names: Roles) -> list[str]:
    """Sequence rights (issue 27): none on any sequence of the schema (the host project's, such
    as ``auth_user_id_seq``, included), then, on the sequences owned by the apps' own tables
    (``<app label>_...``: today ``buzz_delivery_event_id_seq``), ``USAGE`` (``nextval``) to the
    tenant role, which may not read the fleet-wide value (``SELECT``), and ``USAGE, SELECT`` to
    the maintenance role. Judged by the database, so every app's migration can run it again."""
    tenant, fleet = _ident(names.tenant), _ident(names.maintenance)
    prefixes = ", ".join("'" + label.replace("_", "\\_") + "\\_%'" for label in APP_LABELS)
    return [
        f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {tenant}, {fleet}",
        f"""DO $$ DECLARE s regclass; BEGIN
    FOR s IN SELECT q.oid::regclass FROM pg_class q
             JOIN pg_namespace n ON n.oid = q.relnamespace AND n.nspname = 'public'
             JOIN pg_depend d ON d.classid = 'pg_class'::regclass AND d.objid = q.oid AND d.deptype IN ('a', 'i')
             JOIN pg_class t ON t.oid = d.refobjid
             WHERE q.relkind = 'S' AND t.relname LIKE ANY (ARRAY[{prefixes}]) LOOP
        EXECUTE format('GRANT USAGE ON SEQUENCE %s TO %s', s, {_literal(tenant)});
        EXECUTE format('GRANT USAGE, SELECT ON SEQUENCE %s TO %s', s, {_literal(fleet)});
    END LOOP;
END $$""",
    ]


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


# What shows another session's statement, literals included (pg_stat_activity.query): executable
# by every role by default, and PostgreSQL shows a session's text to any session of the same
# login; the documented tenant login is one login shared by every community's code.
ACTIVITY_FUNCTIONS = ("pg_catalog.pg_stat_get_activity(integer)", "pg_catalog.pg_stat_get_backend_activity(integer)")
ACTIVITY_VIEWS = ("pg_catalog.pg_stat_activity",)


def activity_sql() -> list[str]:
    """Statements that keep every role but superusers and ``pg_read_all_stats`` (``pg_monitor``)
    from reading other sessions' statements in this database (issue 27): ``EXECUTE`` on the
    functions behind ``pg_stat_activity`` (and the views built on it) revoked from ``PUBLIC``.
    Only a superuser may run them (the functions are the bootstrap superuser's)."""
    out = []
    for view in ACTIVITY_VIEWS:
        out += [f"REVOKE SELECT ON {view} FROM PUBLIC", f"GRANT SELECT ON {view} TO pg_read_all_stats"]
    for function in ACTIVITY_FUNCTIONS:
        out += [
            f"REVOKE EXECUTE ON FUNCTION {function} FROM PUBLIC",
            f"GRANT EXECUTE ON FUNCTION {function} TO pg_read_all_stats",
        ]
    return out


def hide_activity(cursor: Any) -> bool:
    """Run :func:`activity_sql` when the current user is a superuser; returns False (and warns)
    when it is not (a DBA runs ``manage.py tenant_isolation sql``'s statements)."""
    cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
    row = cursor.fetchone()
    if not (row and row[0]):
        warnings.warn(
            "buzz_delivery: this user may not revoke other roles' access to pg_stat_activity; every session of "
            "the shared tenant login can read the others' statements. Have a DBA run the statements of "
            "`manage.py tenant_isolation sql` that revoke it.",
            stacklevel=2,
        )
        return False
    for statement in activity_sql():
        cursor.execute(statement)
    return True


def view_grant_sql(views: Sequence[str], names: Roles) -> list[str]:
    """``SELECT`` on each view to both roles, and nothing else (:func:`app_views`)."""
    tenant, fleet = _ident(names.tenant), _ident(names.maintenance)
    return [f"GRANT SELECT ON {_ident(view)} TO {tenant}, {fleet}" for view in views]


def grant_sql(tables: Sequence[tuple[str, str | None]], names: Roles, views: Sequence[str] = ()) -> list[str]:
    """GRANT statements: schema usage for both roles; the maintenance role DML on every table;
    the tenant role DML on the community-scoped tables only (the community table itself: read
    and the row locks of the write fence, its policies refuse every write), plus
    :data:`TENANT_TABLE_GRANTS`. Sequences: :func:`sequence_sql`."""
    tenant, fleet = _ident(names.tenant), _ident(names.maintenance)
    out = [f"GRANT USAGE ON SCHEMA public TO {tenant}, {fleet}"]
    for table, column in tables:
        out.append(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {_ident(table)} TO {fleet}")
        out.append(f"REVOKE ALL ON {_ident(table)} FROM {tenant}")
        if table == COMMUNITY_TABLE:
            out.append(f"GRANT SELECT, UPDATE ON {_ident(table)} TO {tenant}")
        elif column is not None:
            out.append(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {_ident(table)} TO {tenant}")
        elif table in TENANT_TABLE_GRANTS:
            out.append(f"GRANT {TENANT_TABLE_GRANTS[table]} ON {_ident(table)} TO {tenant}")
    return out + view_grant_sql(views, names) + sequence_sql(names)


def policy_sql(tables: Sequence[tuple[str, str | None]], names: Roles) -> list[str]:
    """(Re)create the two policies on every community-scoped table of ``tables``."""
    out = [CURRENT_COMMUNITY_FUNCTION.strip()]
    for table, column in tables:
        if column is None:
            continue
        mine = f"{_ident(column)} = buzz_delivery_current_community()"
        # The community row: the tenant reads it and may lock it (the write fence's FOR SHARE
        # needs an UPDATE policy whose USING passes) but never change it: lifecycle moves are
        # fleet work. Every other table: its own community's rows, for every command.
        check = "false" if table == COMMUNITY_TABLE else mine
        command = "UPDATE" if table == COMMUNITY_TABLE else "ALL"
        out += [
            f"DROP POLICY IF EXISTS {TENANT_POLICY} ON {_ident(table)}",
            f"CREATE POLICY {TENANT_POLICY} ON {_ident(table)} AS PERMISSIVE FOR {command} "
            f"TO {_ident(names.tenant)} USING ({mine}) WITH CHECK ({check})",
            f"DROP POLICY IF EXISTS {TENANT_READ_POLICY} ON {_ident(table)}",
        ]
        if table == COMMUNITY_TABLE:
            out.append(
                f"CREATE POLICY {TENANT_READ_POLICY} ON {_ident(table)} AS PERMISSIVE FOR SELECT "
                f"TO {_ident(names.tenant)} USING ({mine})"
            )
        out += [
            f"DROP POLICY IF EXISTS {FLEET_POLICY} ON {_ident(table)}",
            f"CREATE POLICY {FLEET_POLICY} ON {_ident(table)} AS PERMISSIVE FOR ALL "
            f"TO {_ident(names.maintenance)} USING (true) WITH CHECK (true)",
        ]
    return out


def switch_sql(tables: Sequence[tuple[str, str | None]], on: bool) -> list[str]:
    """ENABLE + FORCE (``on``) or DISABLE + NO FORCE row-level security on the scoped tables."""
    verb = (
        "ENABLE ROW LEVEL SECURITY, FORCE ROW LEVEL SECURITY"
        if on
        else ("DISABLE ROW LEVEL SECURITY, NO FORCE ROW LEVEL SECURITY")
    )
    return [f"ALTER TABLE {_ident(table)} {verb}" for table, column in tables if column is not None]


def _missing_roles(cursor: Any, names: Roles) -> list[str]:
    cursor.execute(
        "SELECT n FROM unnest(%s::text[]) n WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = n)",
        [[names.tenant, names.maintenance]],
    )
    return [row[0] for row in cursor.fetchall()]


def _may_create_roles(cursor: Any) -> bool:
    cursor.execute("SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user")
    row = cursor.fetchone()
    return bool(row and row[0])


def ensure_roles(cursor: Any, names: Roles) -> list[str]:
    """Create the missing roles if the current user may, and make them settable by it (SET
    ROLE needs membership unless superuser). Returns the roles still missing."""
    missing = _missing_roles(cursor, names)
    if missing and _may_create_roles(cursor):
        for statement in role_sql(names):
            cursor.execute(statement)
        cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        if not cursor.fetchone()[0]:
            for name in (names.tenant, names.maintenance):
                cursor.execute(f"GRANT {_ident(name)} TO CURRENT_USER")
        missing = _missing_roles(cursor, names)
    return missing


def install(cursor: Any, tables: Sequence[tuple[str, str | None]], views: Sequence[str] = ()) -> bool:
    """Roles (where possible), grants and policies for ``tables``; returns False (and warns)
    when the roles are missing and the current user may not create them."""
    names = roles()
    missing = ensure_roles(cursor, names)
    if missing:
        warnings.warn(
            f"buzz_delivery: roles {', '.join(missing)} do not exist and this user may not create them; "
            "row-level security policies were not installed. Have a DBA run the output of "
            "`manage.py tenant_isolation sql`, then `manage.py tenant_isolation enable`.",
            stacklevel=2,
        )
        return False
    for statement in (*grant_sql(tables, names, views), *policy_sql(tables, names)):
        cursor.execute(statement)
    hide_activity(cursor)
    return True


def migration_operation(app_label: str) -> Any:
    """A ``RunPython`` that installs grants and policies for ``app_label``'s tables as the
    historical models of that migration state describe them (reversible: drops the policies)."""
    from django.db import migrations

    def forward(apps: Any, schema_editor: Any) -> None:
        app_models = list(apps.get_app_config(app_label).get_models())
        with schema_editor.connection.cursor() as cursor:
            install(cursor, app_tables(app_models), app_views(app_models))

    def backward(apps: Any, schema_editor: Any) -> None:
        tables = app_tables(apps.get_app_config(app_label).get_models())
        with schema_editor.connection.cursor() as cursor:
            for statement in switch_sql(tables, on=False):
                cursor.execute(statement)
            for table, column in tables:
                if column is not None:
                    cursor.execute(f"DROP POLICY IF EXISTS {TENANT_POLICY} ON {_ident(table)}")
                    cursor.execute(f"DROP POLICY IF EXISTS {FLEET_POLICY} ON {_ident(table)}")
                    cursor.execute(f"DROP POLICY IF EXISTS {TENANT_READ_POLICY} ON {_ident(table)}")

    return migrations.RunPython(forward, backward, elidable=False)


def view_grant_operation(app_label: str) -> Any:
    """A ``RunPython`` that grants ``SELECT`` on ``app_label``'s views (:func:`app_views` of that
    migration state) to both roles where they exist; backwards nothing (dropping a view drops
    its grants). For the migration that turns a table into a view over a renamed table: the
    table's own grants and policies follow the rename."""
    from django.db import migrations

    def forward(apps: Any, schema_editor: Any) -> None:
        views = app_views(apps.get_app_config(app_label).get_models())
        names = roles()
        with schema_editor.connection.cursor() as cursor:
            if _missing_roles(cursor, names):
                return
            for statement in view_grant_sql(views, names):
                cursor.execute(statement)

    return migrations.RunPython(forward, migrations.RunPython.noop, elidable=False)


@dataclass(frozen=True, slots=True)
class TableState:
    """One community-scoped table: ``enabled``/``forced`` RLS, policy names present."""

    table: str
    enabled: bool
    forced: bool
    policies: frozenset[str]

    @property
    def complete(self) -> bool:
        return self.enabled and self.forced and {TENANT_POLICY, FLEET_POLICY} <= self.policies


def table_states(cursor: Any, tables: Sequence[tuple[str, str | None]] | None = None) -> list[TableState]:
    """The RLS state of every community-scoped table (default: the installed apps')."""
    scoped = [t for t, c in (installed_tables() if tables is None else tables) if c is not None]
    cursor.execute(
        "SELECT c.relname, c.relrowsecurity, c.relforcerowsecurity,"
        " coalesce(array_agg(p.polname) FILTER (WHERE p.polname IS NOT NULL), '{}')"
        " FROM pg_class c LEFT JOIN pg_policy p ON p.polrelid = c.oid"
        " WHERE c.oid = ANY (SELECT to_regclass(t) FROM unnest(%s::text[]) t)"
        " GROUP BY 1, 2, 3 ORDER BY 1",
        [scoped],
    )
    return [TableState(r[0], r[1], r[2], frozenset(r[3])) for r in cursor.fetchall()]


def enforced(cursor: Any) -> bool:
    """True when RLS is enabled and forced on the delivery record table (how the services decide
    whether to set a tenant context at all)."""
    cursor.execute(
        "SELECT coalesce(bool_and(relrowsecurity AND relforcerowsecurity), false) FROM pg_class"
        " WHERE oid = to_regclass('buzz_delivery_delivery_record')"
    )
    return bool(cursor.fetchone()[0])


def is_citus(cursor: Any) -> bool:
    cursor.execute("SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')")
    return bool(cursor.fetchone()[0])


def switch(cursor: Any, on: bool) -> list[TableState]:
    """Enable (installing any missing grants and policies first) or disable enforcement on every
    installed community-scoped table, in the caller's transaction. Raises
    :class:`IsolationError` when the roles are missing or on Citus."""
    tables = installed_tables()
    cursor.execute(
        "SELECT coalesce(bool_and(pg_has_role(current_user, relowner, 'USAGE')), false) FROM pg_class"
        " WHERE oid = ANY (SELECT to_regclass(t) FROM unnest(%s::text[]) t)",
        [[t for t, _c in tables]],
    )
    if not cursor.fetchone()[0]:
        raise IsolationError("only the tables' owner may switch row-level security: run it as the migrating user")
    if on:
        if is_citus(cursor):
            raise IsolationError("tenant isolation is not supported on Citus in this version (SPEC section 13)")
        if not install(cursor, tables, installed_views()):
            raise IsolationError(
                "the roles the policies name do not exist: run `manage.py tenant_isolation sql` as a DBA first"
            )
    for statement in switch_sql(tables, on):
        cursor.execute(statement)
    return table_states(cursor, tables)


def dba_script() -> str:
    """The SQL a DBA runs where the migrating user may not create roles: roles, grants,
    policies, and the statement that enables enforcement (commented out)."""
    tables = installed_tables()
    names = roles()
    lines = [
        *role_sql(names),
        *grant_sql(tables, names, installed_views()),
        *policy_sql(tables, names),
        *activity_sql(),
    ]
    lines.append("-- then, as the tables' owner: manage.py tenant_isolation enable")
    return ";\n".join(line.rstrip(";") for line in lines[:-1]) + ";\n" + lines[-1] + "\n"
