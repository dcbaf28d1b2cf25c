"""The generic plan of a plan-cached statement (``buzz_delivery.services.cached``): what its
PL/pgSQL function runs after its first call in a backend, shown by ``EXPLAIN EXECUTE`` of the
same statement prepared with ``plan_cache_mode = force_generic_plan``."""

from __future__ import annotations

import re
from typing import Any

from django.db import connection

from buzz_delivery.services.cached import CachedStatement


def generic_explain(statement: CachedStatement, params: dict[str, Any], options: str = "") -> list[Any]:
    """EXPLAIN (``options``) rows of ``statement``'s generic plan for ``params``, inside the
    caller's transaction (the test's): its setting and prepared statement end with it."""
    order = [name for name, _ in statement.params]
    text = re.sub(r"%\((\w+)\)s", lambda m: f"${order.index(m.group(1)) + 1}", statement.statement)
    types = ", ".join(kind for _, kind in statement.params)
    values = ", ".join(f"%({name})s::{kind}" for name, kind in statement.params)
    explain = f"EXPLAIN ({options}) " if options else "EXPLAIN "
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE buzz_generic_plan ({types}) AS {text}")
        try:
            cursor.execute(f"{explain}EXECUTE buzz_generic_plan ({values})", params)
            rows = cursor.fetchall()
        finally:
            cursor.execute("DEALLOCATE buzz_generic_plan")
            cursor.execute("SET LOCAL plan_cache_mode = DEFAULT")
    return rows


def database_function(name: str) -> tuple[str, str, list[str]]:
    """The body, identity arguments and settings of the one database function named ``name``."""
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT p.prosrc, pg_get_function_identity_arguments(p.oid), p.proconfig
               FROM pg_proc p WHERE p.proname = %s""",
            [name],
        )
        rows = cursor.fetchall()
    assert len(rows) == 1, f"{name}: {len(rows)} functions of that name"
    return rows[0]
