"""Every writer names the record, never the view of the old name (issue 31, stage 1).

``buzz_delivery_delivery`` is a view over ``buzz_delivery_delivery_record`` (core migration 0034).
On plain PostgreSQL a one-table view is auto-updatable, so an UPDATE, a DELETE or a ``FOR UPDATE``
through it would still work there, and the mistake would show only on Citus (where no UPDATE or
DELETE goes through a view, ``bench/results/queue-design-plan.md`` 2.2) or at stage 2, when the
view joins the live queue. A trigger, ``ANALYZE`` or ``ALTER TABLE`` on the view fails or, for
``ANALYZE``, silently does nothing. So this refuses, in the product (``buzz_delivery/`` but its
old migrations, ``project/``, ``bench/``):

- a write, lock or table command naming the view (``UPDATE``, ``INSERT INTO``, ``DELETE FROM``,
  ``TRUNCATE``, ``ALTER TABLE``, ``LOCK TABLE``, ``ANALYZE``, ``VACUUM``, ``CREATE TRIGGER ... ON``,
  ``REFERENCES``, ``RETURNS SETOF``, ``colocate_with``), and any statement with ``FOR UPDATE`` /
  ``FOR NO KEY UPDATE`` / ``FOR SHARE`` that names the view;
- in SQL text as written (string literals, f-strings with their ``{...}`` fields, where a field
  naming ``DELIVERY_VIEW``, ``LIVE_DELIVERIES``, ``TERMINAL_DELIVERIES`` or ``DELIVERY`` is the
  view), in every statement the modules hold once imported (their string constants, dicts of them,
  the plan-cached functions' ``CREATE FUNCTION``), and in the database's own functions.

Tests have their own rule (``tests/test_delivery_writes_rule.py``: through ``buzz_delivery.testing``).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
from django.db import connection

import buzz_delivery
from buzz_delivery.services import cached

ROOT = Path(__file__).resolve().parent.parent
VIEW = "buzz_delivery_delivery"
# The view's name in SQL text: the literal (not the record's, which only starts with it) or an
# f-string field that holds it.
_NAME = (
    r"(?:buzz_delivery_delivery(?![_a-z0-9])|\{[\w.]*(?:DELIVERY_VIEW|LIVE_DELIVERIES|TERMINAL_DELIVERIES|DELIVERY)\})"
)
WRITE = re.compile(
    r"\b(?:UPDATE|INSERT\s+INTO|DELETE\s+FROM|TRUNCATE(?:\s+TABLE)?|ALTER\s+TABLE(?:\s+IF\s+EXISTS)?|LOCK(?:\s+TABLE)?"
    r"|ANALYZE|VACUUM(?:\s+ANALYZE)?|REFERENCES|RETURNS\s+SETOF|TRIGGER\s+\w+\s+(?:BEFORE|AFTER)\s+[\w\s,]+?\s+ON)"
    r"\s+(?:ONLY\s+)?(?:public\.)?" + _NAME + r"|colocate_with\s*=>\s*'buzz_delivery_delivery'",
    re.I,
)
LOCKING = re.compile(r"\bFOR\s+(?:NO\s+KEY\s+)?(?:UPDATE|SHARE)\b", re.I)
NAMES_VIEW = re.compile(_NAME)

# Migrations: up to 0033 they wrote the table under its old name, before it became a view; sibling
# apps' migrations that name it read the name as the table of the moment (delivery_table.py);
# 0034 renames it and holds the old functions' bodies to put back. What they leave in the
# database is judged by the last test.
MIGRATIONS = re.compile(r"buzz_delivery/(?:\w+/)?migrations/")


def offences(text: str) -> list[str]:
    """What in one piece of SQL text writes, locks or alters the view."""
    found = [m.group(0) for m in WRITE.finditer(text)]
    if LOCKING.search(text) and NAMES_VIEW.search(text):
        found.append("a locking statement that names the view")
    return found


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue):
                parts.append("{" + ast.unparse(value.value) + "}")
        return "".join(parts)
    return None


def scan(source: str) -> list[tuple[int, str]]:
    """(line, offence) of every string literal or f-string of ``source``."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            return  # a docstring: prose
        text = _text(node)
        if text is not None:
            found.extend((node.lineno, what) for what in offences(text))
            if isinstance(node, ast.JoinedStr):
                return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def _product_files() -> list[Path]:
    files = [
        *(ROOT / "buzz_delivery").rglob("*.py"),
        *(ROOT / "project").rglob("*.py"),
        *(ROOT / "bench").rglob("*.py"),
    ]
    keep = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if "__pycache__" in path.parts or MIGRATIONS.search(rel):
            continue
        keep.append(path)
    return sorted(keep)


def _statements(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _statements(v)]
    if isinstance(value, tuple | list):
        return [s for v in value for s in _statements(v)]
    if isinstance(value, cached.CachedStatement):
        return [value.create_sql()]
    return []


def test_the_scan_finds_writes_locks_and_table_commands_on_the_view_and_passes_the_record():
    bad = """
a = "UPDATE buzz_delivery_delivery AS d SET status = 'x'"
b = f"INSERT INTO {sql.DELIVERY_VIEW} AS d (id) SELECT 1"
c = f"DELETE FROM {DELIVERY} AS d WHERE d.id = 1"
d = f"SELECT d.id FROM {LIVE_DELIVERIES} AS d WHERE d.community_id = %s FOR UPDATE OF d SKIP LOCKED"
e = "RETURNS SETOF buzz_delivery_delivery LANGUAGE plpgsql"
f = "CREATE TRIGGER audit AFTER UPDATE OF status ON buzz_delivery_delivery FOR EACH ROW"
g = "ANALYZE buzz_delivery_delivery"
h = "ALTER TABLE buzz_delivery_delivery ALTER COLUMN community_id SET (n_distinct = 10)"
i = "SELECT r.state FROM run r JOIN buzz_delivery_delivery d ON d.run_id = r.id FOR NO KEY UPDATE OF r"
j = "SELECT create_distributed_table(%s, 'community_id', colocate_with => 'buzz_delivery_delivery')"
"""
    assert [line for line, _ in scan(bad)] == list(range(2, 12))
    good = """
a = "UPDATE buzz_delivery_delivery_record AS d SET status = 'x'"
b = f"INSERT INTO {sql.RECORD} AS d (id) SELECT 1"
c = f"SELECT d.status FROM {sql.DELIVERY_VIEW} AS d WHERE d.community_id = %s AND d.id = %s"
d = f"SELECT d.id FROM {RECORD} AS d WHERE d.community_id = %s FOR UPDATE OF d"
e = "RETURNS SETOF buzz_delivery_delivery_record LANGUAGE plpgsql"
f = "ANALYZE buzz_delivery_delivery_record"
g = f"UPDATE {RESULT} AS r SET x = 1 FROM {RECORD} AS d WHERE d.id = r.delivery_id"
"""
    assert scan(good) == []


def test_no_product_source_writes_locks_or_alters_the_view():
    found = []
    for path in _product_files():
        for line, what in scan(path.read_text()):
            found.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not found, "name the record (sql.RECORD, buzz_delivery_delivery_record), not the view:\n" + "\n".join(found)


def test_no_statement_the_modules_hold_writes_locks_or_alters_the_view():
    """The rendered statements, whatever the modules call the table (an alias the source scan
    cannot resolve)."""
    found, seen = [], 0
    for info in pkgutil.walk_packages(buzz_delivery.__path__, "buzz_delivery."):
        if ".migrations" in info.name or info.name.endswith(".remote_runs"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            continue
        for name, value in vars(module).items():
            for statement in _statements(value):
                seen += 1
                found.extend(f"{info.name}.{name}: {what}" for what in offences(statement))
    assert seen > 300, seen  # the walk reached the statement modules
    assert not found, "\n".join(found)


@pytest.mark.django_db
def test_no_function_in_the_database_writes_locks_or_returns_the_view():
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT p.proname, p.prosrc, pg_get_function_result(p.oid) FROM pg_proc p"
            " JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = current_schema()"
            " AND p.prosrc ~ 'buzz_delivery_delivery'"
        )
        rows = cursor.fetchall()
    assert any(VIEW + "_record" in source for _, source, _ in rows)  # the query finds the functions
    found = [
        f"{name}: {what}" for name, source, result in rows for what in offences(source) + offences(f"RETURNS {result}")
    ]
    assert not found, "\n".join(found)
