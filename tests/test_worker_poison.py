"""The delivery worker's poison matrix (issue 28), as a real process: every kind of hostile
handler fails (or retries) only its own delivery, with a failure code; the worker serves every
other delivery on the same handler thread, counts each in its summary and exits 0."""

from __future__ import annotations

import pytest

from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import random32
from tests.test_worker import commit

pytestmark = pytest.mark.django_db(transaction=True)

LONG = "ThisExceptionClassHasANameMuchLongerThanSixtyFourCharactersWhichNoFailureCodeColumnCanHold"
POISON = {  # the handler's script -> (status, failure code) the delivery ends with
    "system_exit": ("failed", "SystemExit"),
    "keyboard_interrupt": ("failed", "KeyboardInterrupt"),
    "base_exception": ("failed", "Stop"),
    "cancelled": ("failed", "CancelledError"),
    "unprintable": ("pending", None),  # an ordinary exception: retried, its text described
    "long_code": ("failed", LONG[:64]),
    "nul_permanent": ("failed", "BadPayload"),  # a message PostgreSQL cannot store, made storable
    "atomic_left_open": ("failed", "transaction_left_open"),
    "raw_begin": ("failed", "transaction_left_open"),
    "autocommit_off": ("failed", "transaction_left_open"),
    "statement_timeout": ("finished", None),  # its session setting is cleaned after it
    "terminate_self": ("pending", None),  # its connection was cut: retried; the next handler reconnects
}


def test_every_poison_kind_fails_only_its_delivery_and_the_worker_serves_the_rest(make_binding, start_worker):
    target = random32()
    poison, ordinary = {}, []
    for kind in POISON:
        (poison[kind],) = commit(make_binding, target, **{"raise": kind})
        ordinary += commit(make_binding, target, **{"raise": "sql"})  # runs right after it, on the same thread

    worker = start_worker(target, "--concurrency", "1", "--idle-exit", "2", "--lease-seconds", "5")

    assert worker.wait(60) == 0, worker.log()
    rows = {row.id: row for row in WorkflowAgentDelivery.objects.filter(id__in=[*poison.values(), *ordinary])}
    for kind, (status, code) in POISON.items():
        row = rows[poison[kind]]
        assert (row.status, row.failure_code) == (status, code), (kind, row.failure_message)
    assert rows[poison["system_exit"]].failure_message == "SystemExit: 4"
    assert {rows[d].status for d in ordinary} == {"finished"}
    sql = [e for e in worker.handler_events() if e["event"] == "sql"]
    assert len(sql) == len(ordinary)
    assert {(e["statement_timeout"], e["in_atomic_block"]) for e in sql} == {("0", False)}  # a clean session
    summary = worker.summary()
    failed = sum(1 for status, _ in POISON.values() if status == "failed")
    retried = sum(1 for status, _ in POISON.values() if status == "pending")
    # Each retry the worker counted is one ``retry`` entry in a history: a retried delivery whose
    # backoff ran out before the worker's idle exit (a slow machine: CI's Citus run) was claimed
    # and retried again, so at least one a kind, not exactly one.
    entries = sum(1 for d in [*poison.values(), *ordinary] for e in rows[d].history if e.get("event") == "retry")
    assert entries >= retried
    assert (summary["finished"], summary["failed"], summary["retried"]) == (len(ordinary) + 1, failed, entries)
    assert (summary["settle_errors"], summary["reason"], summary["exit_code"]) == (0, "idle_exit", 0)
    assert "worker_error" not in worker.log()


@pytest.mark.parametrize("kind", ["autocommit_off", "raw_begin"])
def test_the_first_handler_on_a_fresh_thread_that_leaves_a_transaction_open_fails_it(make_binding, start_worker, kind):
    """The handler thread's connection is not open yet when its first handler is called (Django's
    wrapper then says autocommit off until it connects): that is no caller's transaction, and
    what the handler leaves open is judged as on any later call."""
    target = random32()
    (poison,) = commit(make_binding, target, **{"raise": kind})
    (after,) = commit(make_binding, target, **{"raise": "sql"})

    worker = start_worker(target, "--concurrency", "1", "--idle-exit", "2", "--lease-seconds", "5")

    assert worker.wait(60) == 0, worker.log()
    rows = {row.id: row for row in WorkflowAgentDelivery.objects.filter(id__in=[poison, after])}
    assert (rows[poison].status, rows[poison].failure_code) == ("failed", "transaction_left_open")
    assert rows[after].status == "finished"
    sql = [e for e in worker.handler_events() if e["event"] == "sql"]
    assert [(e["statement_timeout"], e["in_atomic_block"]) for e in sql] == [("0", False)]
