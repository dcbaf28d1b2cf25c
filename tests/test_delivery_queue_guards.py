"""The record's history guard once the live state is the queue's (core 0037, review of issue 31,
stage 2). While a delivery is live its record's history is the commit's (or the last requeue's) and
its queue row's only grows from it: the terminal statement writes the queue row's history plus its
entry over the record's copy, which extends it. Any other rewrite is refused, as before stage 2.
And the queue row's own guards: the write fence of a fenced community, its key, target, workflow."""

from __future__ import annotations

import json

import pytest
from django.db import DatabaseError, connection, transaction

from buzz_delivery.models import DeliveryQueue, DeliveryRecord
from buzz_delivery.testing import DeliveryFactory, Expr, advance_to, set_delivery_state

pytestmark = pytest.mark.django_db

QUEUE = DeliveryQueue._meta.db_table
RECORD = DeliveryRecord._meta.db_table
TERMINAL = "status = 'failed', finished_at = now(), failure_code = 'x'"


def _entries(n: int, start: int = 0) -> list[dict]:
    return [{"event": "claim", "n": i} for i in range(start, start + n)]


def _live(make_binding, record_history: list[dict], queue_pushes: int):
    """A live delivery whose record holds ``record_history`` and whose queue row that plus
    ``queue_pushes`` entries (pushed one at a time, as claims do, the oldest dropped at 50)."""
    delivery = DeliveryFactory(binding=make_binding())
    key = (delivery.community_id, delivery.id)
    with connection.cursor() as cursor:  # one entry a statement, as the guard lets through
        for entry in record_history:
            cursor.execute(
                f"UPDATE {RECORD} SET history = buzz_delivery_history_push(history, %s::jsonb)"
                " WHERE community_id = %s AND id = %s",
                [json.dumps(entry), *key],
            )
    # The queue row, as committed: the commit copied the record's history; the same pushes, one a
    # statement (the queue row's own guard refuses a rewrite).
    for entry in record_history:
        set_delivery_state(key, history=Expr("buzz_delivery_history_push(history, %s::jsonb)", [json.dumps(entry)]))
    for i in range(queue_pushes):
        set_delivery_state(
            key, history=Expr("buzz_delivery_history_push(history, %s::jsonb)", [json.dumps({"event": "live", "n": i})])
        )
    return key


def _sql_in_test(statement: str, params) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


def _update_record(key, assignments: str, params: list | None = None) -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {RECORD} AS r SET {assignments} WHERE r.community_id = %s AND r.id = %s", [*(params or []), *key]
        )


def _terminal_from_queue(key) -> None:
    """What a terminal does: the queue row's history plus its entry into the record."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {RECORD} AS r SET {TERMINAL}, history = buzz_delivery_history_push(q.history,"
            " jsonb_build_object('event', 'fail')) FROM "
            f"{QUEUE} AS q WHERE q.community_id = r.community_id AND q.id = r.id AND r.community_id = %s AND r.id = %s",
            key,
        )
        assert cursor.rowcount == 1


@pytest.mark.parametrize(
    ("record_entries", "queue_pushes"), [(0, 0), (1, 3), (48, 1), (48, 5), (50, 1), (50, 30), (3, 80)]
)
def test_a_terminal_writes_the_queue_rows_history_plus_its_entry(make_binding, record_entries, queue_pushes):
    key = _live(make_binding, _entries(record_entries), queue_pushes)
    _terminal_from_queue(key)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT history -> -1 ->> 'event', status FROM {RECORD} WHERE community_id = %s AND id = %s", key
        )
        assert cursor.fetchone() == ("fail", "failed")


@pytest.mark.parametrize(
    "forged",
    [
        [],  # emptied
        [{"event": "forged"}],  # replaced
        [{"event": "claim", "n": 1}, {"event": "fail"}],  # the first entry dropped, under the bound
        [{"event": "claim", "n": 9}, {"event": "claim", "n": 1}, {"event": "fail"}],  # reordered
    ],
)
def test_a_terminal_statement_cannot_rewrite_a_live_records_history(make_binding, forged):
    key = _live(make_binding, _entries(2), 1)
    with pytest.raises(DatabaseError, match="past entries are never rewritten"):
        _update_record(key, f"{TERMINAL}, history = %s::jsonb", [json.dumps(forged)])


def test_a_terminal_statement_cannot_shorten_a_live_records_full_history(make_binding):
    """At the bound the queue row dropped its oldest entries: a full history is taken as it comes
    (the record's trigger cannot read the queue row), a shorter one must extend the record's."""
    key = _live(make_binding, _entries(50), 2)
    forged = [*_entries(48, start=100), {"event": "fail"}]
    with pytest.raises(DatabaseError, match="past entries are never rewritten"):
        _update_record(key, f"{TERMINAL}, history = %s::jsonb", [json.dumps(forged)])


def test_a_statement_that_keeps_a_delivery_live_cannot_rewrite_its_records_history(make_binding):
    key = _live(make_binding, _entries(3), 0)
    with pytest.raises(DatabaseError, match="past entries are never rewritten"):
        _update_record(key, "history = '[]'::jsonb")


def test_a_terminal_records_history_still_only_grows(make_binding):
    key = _live(make_binding, _entries(2), 1)
    _terminal_from_queue(key)
    with pytest.raises(DatabaseError, match="past entries are never rewritten"):
        _update_record(key, "history = '[]'::jsonb")
    # The requeue's one entry is still let through.
    _update_record(key, "history = buzz_delivery_history_push(history, jsonb_build_object('event', 'requeue'))")


@pytest.mark.parametrize(
    "statement",
    [
        f"UPDATE {QUEUE} SET renewals = renewals + 1 WHERE community_id = %s AND id = %s",
        f"DELETE FROM {QUEUE} WHERE community_id = %s AND id = %s",
        f"UPDATE {RECORD} SET status = 'failed', finished_at = now(), failure_code = 'x'"
        " WHERE community_id = %s AND id = %s",
    ],
)
def test_a_fenced_communitys_queue_rows_are_not_written(make_binding, community, statement):
    key = _live(make_binding, [], 0)
    advance_to(community, "fenced")
    with pytest.raises(DatabaseError, match=r"fenced|community"), transaction.atomic(), connection.cursor() as cur:
        cur.execute(statement, key)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {QUEUE} WHERE community_id = %s AND id = %s", key)
        assert cursor.fetchone() == (1,)


@pytest.mark.parametrize(
    "assignment",
    [
        "target_pubkey = decode(repeat('ab', 32), 'hex')",
        "workflow_id = '00000000-0000-4000-8000-000000000001'::uuid",
        "id = '00000000-0000-4000-8000-000000000002'::uuid",
    ],
)
def test_a_queue_rows_key_target_and_workflow_never_change(make_binding, assignment):
    """A claim selects by the queue row's target and workflow; the view shows the record's."""
    key = _live(make_binding, [], 0)
    update = f"UPDATE {QUEUE} SET {assignment} WHERE community_id = %s AND id = %s"
    with pytest.raises(DatabaseError, match="its binding and snapshots never"), transaction.atomic():
        _sql_in_test(update, key)
