"""The ladders' schema variants apply to the migrated schema (``bench.server_ladder.VARIANTS``,
``bench.worker_ladder.STEPS``): each names indexes, keys, triggers and functions of the delivery
record by name, and a migration that drops or renames one (core 0036 dropped
``delivery_workflow_idx``) leaves a variant that fails on its first statement, after the tool
has copied the bench database. Each variant's DDL runs here in a savepoint, rolled back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, transaction

from bench import server_ladder, worker_ladder
from tests.citus_support import CITUS_MODE

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(CITUS_MODE, reason="the ladders measure one PostgreSQL backend, never a cluster"),
]


class _Conn:
    """What the variants' DDL makers read through: psycopg's ``Connection.execute`` over Django's cursor."""

    def __init__(self, cursor: Any) -> None:
        self.cursor = cursor

    def execute(self, sql: str, params: Any = None) -> Any:
        self.cursor.execute(sql, params)
        return self.cursor


def _apply(makers: list[Callable[[Any], list[str]]]) -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        conn = _Conn(cursor)
        for make in makers:
            for statement in make(conn):
                cursor.execute(statement)
        transaction.set_rollback(True)


@pytest.mark.parametrize("name", list(server_ladder.VARIANTS))
def test_each_server_ladder_variant_applies_to_the_migrated_schema(name):
    _apply([server_ladder.VARIANTS[name][1]])


@pytest.mark.parametrize("name", list(worker_ladder.STEPS))
def test_each_worker_ladder_step_applies_to_the_migrated_schema_and_holds(name):
    with transaction.atomic(), connection.cursor() as cursor:
        for statement in worker_ladder.STEPS[name][1](_Conn(cursor)):
            cursor.execute(statement)
        cursor.execute(worker_ladder.STEPS[name][2])
        (holds,) = cursor.fetchone() or (False,)
        transaction.set_rollback(True)
    assert holds, name


def test_the_worker_ladders_steps_apply_in_their_default_order():
    _apply([step[1] for step in worker_ladder.STEPS.values()])
