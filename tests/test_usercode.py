"""buzz_delivery.usercode: what a user's call leaves on its thread's connection never reaches the
runtime's next statement (issue 28), and ordinary ORM work costs no extra round trip."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from buzz_delivery.models import Event
from buzz_delivery.usercode import UserCode

pytestmark = pytest.mark.django_db(transaction=True)


def setting(name: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SHOW {name}")
        return cursor.fetchone()[0]


def backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def test_orm_work_leaves_nothing_to_clean(community):
    with UserCode(community.id) as call:
        Event.objects.filter(community_id=community.id).count()
    assert (call.left_open, call.session_touched) == (None, False)


def test_a_session_setting_is_discarded_after_the_call(community):
    with UserCode(community.id) as call, connection.cursor() as cursor:
        cursor.execute("SET statement_timeout = 1")
    assert (call.left_open, call.session_touched) == (None, True)
    assert setting("statement_timeout") == "0"


@pytest.mark.parametrize("how", ["atomic", "begin", "autocommit_off"])
def test_a_transaction_left_open_is_rolled_back_and_reported(community, how):
    before = backend_pid()
    with UserCode(community.id) as call:
        if how == "atomic":
            transaction.atomic().__enter__()
        elif how == "autocommit_off":
            transaction.set_autocommit(False)
        with connection.cursor() as cursor:
            if how == "begin":
                cursor.execute("BEGIN")
            cursor.execute("CREATE TABLE usercode_left_open (x int)")
    assert call.left_open is not None
    assert not connection.in_atomic_block and connection.get_autocommit()
    assert setting("transaction_isolation")  # the thread's next statement runs, in autocommit
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass('usercode_left_open') IS NULL")
        assert cursor.fetchone()[0]  # what it wrote in that transaction is gone
    if how != "atomic":
        assert backend_pid() != before  # that connection was closed, a fresh one opened
