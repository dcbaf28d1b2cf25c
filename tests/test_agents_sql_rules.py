"""SPEC 15 rules on every statement of the agent runs (their services, maintenance and the
triggers of their migration): each UPDATE and DELETE names ``community_id`` in its own WHERE, no
CASE holds a clock or an interval, and no SET applies the clock plus an interval to a column."""

from __future__ import annotations

import importlib
import re

from buzz_delivery.agents.services import maintenance, sql

MIGRATION = importlib.import_module("buzz_delivery.agents.migrations.0002_keys_and_triggers")


def statements() -> list[tuple[str, str]]:
    out = []
    for module in (sql, maintenance):
        for name, value in vars(module).items():
            if isinstance(value, str) and name.isupper() and re.search(r"\b(UPDATE|DELETE)\b", value):
                out.append((f"{module.__name__}.{name}", value))
    for name in ("APPROVAL_RESUME", "WAY_BACK", "JOURNAL_SEQUENCE"):
        for i, part in enumerate(re.split(r";\s*\n", getattr(MIGRATION, name))):
            out.append((f"migration.{name}[{i}]", part))
    return out


def writes(text: str) -> list[str]:
    """Each UPDATE ... / DELETE ... statement body up to its RETURNING or end (triggers' ``AFTER
    UPDATE OF`` clauses are not writes)."""
    bodies = []
    for m in re.finditer(r"(?<!AFTER )(?<!BEFORE )\b(UPDATE|DELETE FROM)\s+(buzz_\w+)", text):
        if text[max(0, m.start() - 12) : m.start()].strip().endswith(("OF", "ON")):
            continue
        rest = text[m.end() :]
        stop = re.search(r"\bRETURNING\b|;|\n\)|\bINTO\b", rest)
        bodies.append(rest[: stop.start()] if stop else rest)
    return bodies


def test_every_update_and_delete_names_community_id_in_its_own_where():
    checked = 0
    for name, text in statements():
        for body in writes(text):
            where = body.split("WHERE", 1)
            assert len(where) == 2, (name, body)
            assert "community_id" in where[1], (name, body)
            checked += 1
    assert checked >= 20


def test_no_case_holds_a_clock_or_an_interval():
    for name, text in statements():
        for case in re.findall(r"CASE\b.*?\bEND\b", text, re.S):
            assert not re.search(r"now\(\)|buzz_delivery_now|interval", case), (name, case)


def test_no_set_adds_an_interval_to_a_column():
    for name, text in statements():
        for body in writes(text):
            set_clause = body.split("WHERE", 1)[0]
            for expr in re.findall(r"make_interval\(secs => ([^)]*)\)", set_clause):
                assert expr.startswith("%("), (name, expr)
