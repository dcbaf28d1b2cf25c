"""The array texts the batch settle sends (``services.db.uuid_array``, ``int_array``,
``bytea_array``; issue 31): PostgreSQL reads each back as exactly the values given, whatever
their bytes, and a value that is not of the array's type is refused before any SQL."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection

from buzz_delivery.services.db import bytea_array, int_array, uuid_array

pytestmark = pytest.mark.django_db


def _read(text: str, kind: str) -> list:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT %s::{kind}", [text])
        (value,) = cursor.fetchone()
    return value


def test_each_array_text_reads_back_as_the_values_given():
    ids = [uuid.uuid4() for _ in range(5)]
    assert _read(uuid_array(ids), "uuid[]") == ids
    assert _read(uuid_array([str(i).upper() for i in ids]), "uuid[]") == ids  # normalised first
    generations = [1, 2**63 - 1, 7]
    assert _read(int_array(generations), "bigint[]") == generations
    # Every byte, quotes, backslashes and braces included: hex never reaches the array's syntax.
    values = [bytes(range(256)), b'"\\{},', b"", bytes(32)]
    assert [bytes(v) for v in _read(bytea_array(values), "bytea[]")] == values
    assert _read(uuid_array([]), "uuid[]") == []


@pytest.mark.parametrize("bad", [True, 1.5, "3"])
def test_a_generation_that_is_not_an_int_is_refused(bad):
    with pytest.raises(TypeError):
        int_array([1, bad])


def test_an_id_that_is_not_a_uuid_is_refused():
    with pytest.raises(ValueError):
        uuid_array([uuid.uuid4(), "1},{2"])


@pytest.mark.parametrize("bad", [3, True, "ab"])
def test_a_target_that_is_not_bytes_is_refused(bad):
    """``bytes(3)`` is three zero bytes: an int is refused, not written as a key of zeros."""
    with pytest.raises(TypeError):
        bytea_array([bytes(32), bad])
