"""A migration operation that sends its SQL one statement at a time (docs/scale-out.md).

On a Citus coordinator whose tables are already distributed, Citus propagates a DDL statement to
the workers with the text it was sent in; a text of several commands (django-pgtrigger installs a
trigger as ``CREATE FUNCTION ...; DROP TRIGGER ...; CREATE TRIGGER ...; COMMENT ...``) is refused
there: "cannot insert multiple commands into a prepared statement". :class:`OneStatementAtATime`
wraps any operation (a pgtrigger ``AddTrigger``/``RemoveTrigger``) and splits each text it runs
into its statements (``sqlparse``, which knows dollar quoting), in order, in the migration's
transaction. On plain PostgreSQL the same statements run, one round trip each.
"""

from __future__ import annotations

from typing import Any

import sqlparse
from django.db import migrations


def statements(sql: str) -> list[str]:
    """The statements of ``sql``, each without its closing semicolon."""
    return [part.strip().rstrip(";").rstrip() for part in sqlparse.split(sql) if part.strip().rstrip(";").strip()]


class OneStatementAtATime(migrations.operations.base.Operation):
    """``operation``, its database work sent one statement at a time (state unchanged)."""

    reversible = True

    def __init__(self, operation: Any) -> None:
        self.operation = operation
        super().__init__()

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", [self.operation], {})

    def state_forwards(self, app_label: str, state: Any) -> None:
        self.operation.state_forwards(app_label, state)

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        with _split(schema_editor):
            self.operation.database_forwards(app_label, schema_editor, from_state, to_state)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        with _split(schema_editor):
            self.operation.database_backwards(app_label, schema_editor, from_state, to_state)

    def describe(self) -> str:
        return f"{self.operation.describe()} (one statement at a time)"


class _split:
    """Within it, ``schema_editor.execute`` of a text without parameters runs statement by statement."""

    def __init__(self, schema_editor: Any) -> None:
        self.schema_editor = schema_editor

    def __enter__(self) -> None:
        original = self.schema_editor.execute

        def execute(sql: Any, params: Any = ()) -> None:
            if isinstance(sql, str) and not params:
                for statement in statements(sql):
                    original(statement, params=None)
            else:
                original(sql, params)

        self.schema_editor.execute = execute

    def __exit__(self, *exc: object) -> None:
        del self.schema_editor.execute
