"""The tenant scope object (``services.tenancy.scope``): what it pushes onto the connection and
takes off again, including when an instance is misused (issue 16 made it a class)."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection

from buzz_delivery.services import tenancy


def _open() -> tuple[int, list[tenancy.Target]]:
    return len(connection.execute_wrappers), list(tenancy._state().stack)


def test_an_open_scope_entered_again_is_refused_and_the_outer_scope_stays():
    before = _open()
    scope = tenancy.tenant(uuid.uuid4())
    with scope:
        inside = _open()
        assert inside[0] == before[0] + 1 and len(inside[1]) == len(before[1]) + 1
        with pytest.raises(RuntimeError, match="open already"), scope:
            pass
        assert _open() == inside  # the refused entry took nothing of the outer one away
    assert _open() == before
    with scope:  # once closed, the same object may be entered again
        assert _open() == inside
    assert _open() == before


def test_nested_scopes_unwind_in_order_through_an_exception():
    before = _open()
    first, second = uuid.uuid4(), uuid.uuid4()
    with pytest.raises(ZeroDivisionError), tenancy.tenant(first), tenancy.handler(second):
        assert _open()[0] == before[0] + 2
        with tenancy.handler(second):  # the same target again: nothing added
            assert _open()[0] == before[0] + 2
        raise ZeroDivisionError
    assert _open() == before


def test_a_scope_of_the_target_already_open_adds_nothing():
    community = uuid.uuid4()
    with tenancy.tenant(community):
        inside = _open()
        with tenancy.tenant(community):
            assert _open() == inside
        assert _open() == inside
