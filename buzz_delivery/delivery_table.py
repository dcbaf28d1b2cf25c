"""The delivery table's name for the sibling apps' migrations that name it in SQL.

Core migration 0034 renames ``buzz_delivery_delivery`` to ``buzz_delivery_delivery_record`` and
puts a view of the old name in its place (``bench/results/queue-design-plan.md``, stage 1). A
sibling app's migration written before that (a foreign key into the table, a trigger on it) may
still run after it: the app was installed later, or a new database migrates the apps in another
order. 0034 cannot depend on those migrations (an app not installed when 0034 ran would leave the
history inconsistent once installed), so they name the table at run time instead:
:class:`RunSQLOnTheDeliveryTable` runs its SQL with ``buzz_delivery_delivery`` read as whichever
table holds the deliveries when it runs.
"""

from __future__ import annotations

import re
from typing import Any

from django.db import migrations

OLD_NAME = "buzz_delivery_delivery"
RECORD = "buzz_delivery_delivery_record"
_OLD_NAME = re.compile(r"\bbuzz_delivery_delivery\b")


def physical_table(cursor: Any) -> str:
    """The table that holds the deliveries now: the record after core 0034, else the old name."""
    cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [RECORD])
    return RECORD if cursor.fetchone()[0] else OLD_NAME


def on_table(sqls: Any, table: str) -> Any:
    """``sqls`` (what ``RunSQL`` takes) with the old name read as ``table``."""
    if isinstance(sqls, str):
        return _OLD_NAME.sub(table, sqls)
    if isinstance(sqls, list | tuple):
        out = []
        for item in sqls:
            if isinstance(item, list | tuple):
                out.append((on_table(item[0], table), *item[1:]))
            else:
                out.append(on_table(item, table))
        return out
    return sqls


class RunSQLOnTheDeliveryTable(migrations.RunSQL):
    """``RunSQL`` whose ``buzz_delivery_delivery`` is the table holding the deliveries when it runs."""

    def _run_sql(self, schema_editor: Any, sqls: Any) -> None:
        with schema_editor.connection.cursor() as cursor:
            table = physical_table(cursor)
        super()._run_sql(schema_editor, on_table(sqls, table))  # type: ignore[misc]  # (not in django-stubs)
