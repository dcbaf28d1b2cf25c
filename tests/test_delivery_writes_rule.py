"""Tests write a delivery's row only through ``buzz_delivery.testing`` (issue 31, stage 0).

The delivery table is to split into a record, a queue and an outcome; a view of the old name
will serve readers, but on Citus no UPDATE or DELETE goes through it (docs:
``bench/results/queue-design-plan.md`` 2.2-2.3). So a test that writes the row itself
(an UPDATE, INSERT, DELETE or TRUNCATE of ``buzz_delivery_delivery`` in SQL text, or the ORM's
``WorkflowAgentDelivery.objects...update()`` / ``.create()`` / ``.delete()``) would break then.
It must call :func:`~buzz_delivery.testing.set_delivery_state`,
:func:`~buzz_delivery.testing.backdate`, :func:`~buzz_delivery.testing.insert_delivery_rows` or
:func:`~buzz_delivery.testing.delete_delivery_rows`, the one path the split changes.

A static scan of every module under ``tests/`` (string literals, f-strings rendered with their
``{...}`` fields, and ORM calls), per enclosing function. The exceptions are listed in
``ALLOWED`` with their reason: tests that assert on purpose that the database (a CHECK, a
unique key, a trigger, row-level security, the write fence) refuses a raw write, or that write
through another connection. Stage 3 moves them with the constraints they test. An entry that
no longer matches anything fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TABLE = "buzz_delivery_delivery_record"

# The view of the old name and, since stage 1, the record table behind it (and the names the
# modules give them: ``{DELIVERY}``, ``{sql.RECORD}``...).
WRITE = re.compile(
    r"\b(?:UPDATE|INSERT\s+INTO|DELETE\s+FROM|TRUNCATE(?:\s+TABLE)?)\s+(?:ONLY\s+)?"
    r"(?:buzz_delivery_delivery(?:_record)?\b|\{[\w.]*(?:DELIVERY|RECORD)\w*\})",
    re.I,
)
ORM_WRITES = {"update", "create", "delete", "bulk_create", "bulk_update", "update_or_create", "get_or_create"}
MODEL = "WorkflowAgentDelivery"

REFUSAL = "asserts on purpose that the database refuses a raw write"
OTHER_CONNECTION = "writes through another connection (a tenant login, a second session) on purpose"

# (module path under tests/, enclosing function or "*" for every one) -> why it writes the table directly.
ALLOWED: dict[tuple[str, str], str] = {
    ("test_delivery_writes_rule.py", "test_the_scan_finds_raw_and_orm_writes_and_passes_the_helpers"): (
        "this rule's own self-test (known-bad snippets)"
    ),
    ("test_constraints.py", "*"): f"{REFUSAL}: every CHECK and composite key of the table (moves with them, stage 3)",
    ("test_delivery_queue_guards.py", "*"): (
        f"{REFUSAL}: the record's history guard on the statements that make it terminal, and the queue's guards"
    ),
    ("test_delivery_queue_migration_review.py", "_clone"): (
        "rows as stage 1 left them, written under core 0036 (before the queue the helpers write)"
    ),
    ("test_flow_priority.py", "test_the_database_refuses_a_priority_outside_the_range"): (
        f"{REFUSAL}: the priority CHECK"
    ),
    ("test_flow_singleton.py", "test_the_database_refuses_a_second_unclaimed_pending_delivery_of_one_key"): (
        f"{REFUSAL}: the singleton unique key and the binding-immutable trigger"
    ),
    ("test_history.py", "test_the_database_refuses_a_holder_over_200_characters"): f"{REFUSAL}: the holder CHECK",
    ("test_history.py", "test_the_trigger_refuses_any_rewrite_of_past_entries"): (
        f"{REFUSAL}: the history append-only trigger (and the appends it lets pass)"
    ),
    ("test_history.py", "test_history_keeps_the_last_50_entries"): f"{REFUSAL}: the 50-entry history CHECK",
    ("test_review_regressions.py", "test_a_repeatable_read_writer_whose_snapshot_predates_the_fence_is_refused"): (
        f"{OTHER_CONNECTION}: the write fence against a repeatable-read writer"
    ),
    ("test_review_regressions.py", "test_the_database_refuses_rewriting_history_of_a_delivery"): (
        f"{REFUSAL}: the binding-immutable and generation-monotonic triggers"
    ),
    (
        "test_tenant_sql.py",
        "test_a_move_still_waits_for_writers_and_refuses_them_after_it_while_a_tenant_holds_the_lock",
    ): (f"{OTHER_CONNECTION}: the fence move waits for a tenant login's open write, then refuses it"),
    ("test_scale_out_rules.py", "<module>"): "the Citus statement rules' self-tests (SQL text, never run)",
    (
        "test_record_writes_rule.py",
        "test_the_scan_finds_writes_locks_and_table_commands_on_the_view_and_passes_the_record",
    ): "the product's record-writes rule's own self-test (SQL text, never run)",
    ("test_scale_out_function_rules.py", "<module>"): "the Citus function rules' self-tests (SQL text, never run)",
    ("test_queue_adversary.py", "pruner"): (
        f"{OTHER_CONNECTION}: time passing for the pruner, from a thread racing requeues (one statement"
        " conditioned on the terminal status; the helpers' read-then-write would race its CHECK)"
    ),
    (
        "test_queue_maintenance.py",
        "test_a_record_out_of_step_in_one_community_never_stops_the_reap_of_the_others",
    ): "breaks on purpose the pending-iff-queue-row invariant no constraint refuses, to show the reaper survives it",
    ("test_queue_maintenance.py", "test_the_pruner_skips_an_old_terminal_record_that_still_has_a_queue_row"): (
        "breaks on purpose the pending-iff-queue-row invariant no constraint refuses: the pruner's guard against it"
    ),
}


def _text(node: ast.AST) -> str | None:
    """A string literal, or an f-string with its fields rendered as ``{expression}``."""
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


def _names_model(node: ast.AST) -> bool:
    """Whether the receiver chain of a call names the delivery model."""
    while True:
        if isinstance(node, ast.Name):
            return node.id == MODEL
        if isinstance(node, ast.Attribute):
            if node.attr == MODEL:
                return True
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            return False


def scan(source: str) -> list[tuple[int, str, str]]:
    """Every direct write of the delivery table in ``source``: (line, enclosing function, text)."""
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        text = _text(node)
        if text is not None:
            if WRITE.search(text):
                found.append((node.lineno, function, " ".join(text.split())[:80]))
            if isinstance(node, ast.JoinedStr):
                return  # its parts are not literals of their own
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ORM_WRITES
            and _names_model(node.func.value)
        ):
            found.append((node.lineno, function, ast.unparse(node)[:80]))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), "<module>")
    return found


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_scan_finds_raw_and_orm_writes_and_passes_the_helpers():
    bad = '''
DELIVERY = "buzz_delivery_delivery"
def a(cursor, ids):
    cursor.execute("UPDATE buzz_delivery_delivery SET lease_until = now() WHERE id = %s", ids)
def b(cursor):
    cursor.execute(f"""insert into {DELIVERY} (id) SELECT 1""")
def c(cursor, sql):
    cursor.execute(f"DELETE FROM {sql.DELIVERY} WHERE id = 1")
def d(models, i):
    models.WorkflowAgentDelivery.objects.filter(id=i).update(max_attempts=1)
def e(i):
    WorkflowAgentDelivery._base_manager.filter(id=i).delete()
def f(cursor):
    cursor.execute("TRUNCATE buzz_delivery_delivery")
def g(cursor, sql):
    cursor.execute("UPDATE buzz_delivery_delivery_record SET x = 1")
    cursor.execute(f"DELETE FROM {sql.RECORD} WHERE id = 1")
'''
    assert [(line, function) for line, function, _ in scan(bad)] == [
        (4, "a"), (6, "b"), (8, "c"), (10, "d"), (12, "e"), (14, "f"), (16, "g"), (17, "g"),
    ]  # fmt: skip
    good = """
def a(cursor, d):
    set_delivery_state(d, lease_until=Expr("now()"))
    cursor.execute("SELECT status FROM buzz_delivery_delivery WHERE id = %s", [d.id])
    cursor.execute("UPDATE buzz_delivery_event SET content = 'x'")
    WorkflowAgentDelivery.objects.filter(id=d.id).count()
    WorkflowRun.objects.filter(id=d.run_id).update(x=1)
"""
    assert scan(good) == []


def test_tests_write_a_deliverys_row_only_through_the_testing_helpers():
    found, used = [], set()
    for path in _modules():
        name = path.relative_to(TESTS).as_posix()
        for line, function, text in scan(path.read_text()):
            key = (name, "*") if (name, "*") in ALLOWED else (name, function)
            if key in ALLOWED:
                used.add(key)
            else:
                found.append(f"tests/{name}:{line} in {function}: {text}")
    assert not found, (
        "a test writes the delivery table directly; use buzz_delivery.testing's set_delivery_state, "
        "backdate, insert_delivery_rows or delete_delivery_rows (or, for an on-purpose refusal, add "
        "an ALLOWED entry with its reason):\n" + "\n".join(found)
    )
    assert set(ALLOWED) == used, f"stale ALLOWED entries (they match nothing now): {set(ALLOWED) - used}"


@pytest.mark.django_db
def test_each_helper_names_a_column_the_table_does_not_have(community):
    from buzz_delivery import testing

    for call in (
        lambda: testing.set_delivery_state(community, lease_untill=None),
        lambda: testing.backdate(community, created=1),
        lambda: testing.insert_delivery_rows(["id", "lease_untill"], "SELECT 1, 2"),
    ):
        with pytest.raises(ValueError, match=f"{TABLE} has no column '(lease_untill|created)'"):
            call()
