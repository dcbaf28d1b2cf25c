"""``manage.py tenant_isolation enable | disable | status | sql``: switch row-level security on
every community-scoped table (SPEC section 13; docs/tenant-isolation.md).

``enable`` installs any missing grants and policies, then enables and forces RLS, in one
transaction (run it as the tables' owner). ``disable`` undoes the switch, keeping the policies.
``status`` prints each table's state. ``sql`` prints the roles, grants and policies for a DBA
where the migrating user may not create roles. Processes read the switch when they connect:
restart workers after switching.

``enable`` and ``status`` also print, on stderr, the warnings of ``manage.py check --database``
about the role the tenant code runs as (``buzz_delivery.W020``: a superuser, BYPASSRLS or owner
login with ``SWITCH_ROLES`` off, which row-level security does not hold; ``W021``, ``W022``):
every table may be enforced while the policies hold nothing. They do not change the exit code.

Exit codes: 0 done (``status``: every table in one state); 1 ``status`` found tables in mixed
states; 2 bad arguments; 3 the switch is refused (roles missing, Citus), nothing changed.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import connections, transaction

from buzz_delivery import isolation
from buzz_delivery.management.base import StrictOptionsCommand
from buzz_delivery.services import tenancy

REFUSED = 3


class Command(StrictOptionsCommand):
    help = "Switch row-level security on the community-scoped tables: enable, disable, status, or sql (for a DBA)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=("enable", "disable", "status", "sql"))
        parser.add_argument("--database", default="default", help="Database alias (default: default).")

    def handle(self, *args: Any, **options: Any) -> None:
        action, alias = options["action"], options["database"]
        if action == "sql":
            self.stdout.write(isolation.dba_script(), ending="")
            return
        conn = connections[alias]
        if action == "status":
            with conn.cursor() as cursor:
                states = isolation.table_states(cursor)
            self._report(states)
            self._warn_runtime_role(conn)
            kinds = {s.complete for s in states} | {s.enabled for s in states}
            if len(kinds) > 1:
                raise CommandError("tables are in mixed states: run enable or disable", returncode=1)
            return
        try:
            with transaction.atomic(using=alias), conn.cursor() as cursor:
                states = isolation.switch(cursor, on=action == "enable")
        except isolation.IsolationError as exc:
            raise CommandError(str(exc), returncode=REFUSED) from exc
        if alias == "default":
            tenancy.forget()
        self._report(states)
        if action == "enable":
            self._warn_runtime_role(conn)

    def _warn_runtime_role(self, conn: Any) -> None:
        """The check's warnings on the runtime role (W020...): "enforced" above says nothing of
        whom the policies hold."""
        from buzz_delivery.checks import runtime_role_warnings

        for warning in runtime_role_warnings(conn):
            self.stderr.write(f"WARNING ({warning.id}) {warning.msg}\n\tHINT: {warning.hint}")

    def _report(self, states: list[isolation.TableState]) -> None:
        for state in states:
            if state.complete:
                word = "enforced"
            elif state.enabled:
                word = "enabled, incomplete (missing FORCE or a policy)"
            else:
                word = "off"
            self.stdout.write(f"{state.table}: {word}; policies: {', '.join(sorted(state.policies)) or 'none'}")
        on = sum(s.complete for s in states)
        self.stdout.write(f"{on} of {len(states)} community-scoped tables enforced")
