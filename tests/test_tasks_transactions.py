"""A task that leaves a database transaction open, run by a real worker on real PostgreSQL: its
outcome is recorded on a connection of its own (nothing the task wrote there is committed),
the task ends FAILED with an error saying so, and ``task_finished`` says what was recorded.
And a recorded traceback too long to keep whole keeps its end, the exception line."""

from __future__ import annotations

import io
import uuid

import pytest
from django.core.management import call_command
from django.db import connection

from buzz_delivery import models
from buzz_delivery.tasks import DeliveryBackend, compat
from buzz_delivery.tasks.models import TaskResult
from buzz_delivery.testing import CommunityFactory
from tests import tasks_support as t

PROBE = "tasks_left_open_probe"


@pytest.fixture
def probe_table():
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE IF NOT EXISTS {PROBE} (note text)")
    yield PROBE
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {PROBE}")


def run_worker() -> str:
    out = io.StringIO()
    call_command("run_task_worker", "--queue=default", idle_exit=1.5, poll_interval=0.2, stdout=out)
    return out.getvalue()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["autocommit", "atomic", "begin"])
@pytest.mark.parametrize("then_raise", [False, True])
def test_a_task_that_leaves_a_transaction_open_fails_with_its_error_recorded_and_its_writes_rolled_back(
    probe_table, how, then_raise
):
    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    finished = []

    def seen(sender, task_result, **kwargs):
        finished.append((task_result.id, task_result.status, [e.traceback for e in task_result.errors]))

    compat.task_finished.connect(seen, sender=DeliveryBackend)
    try:
        result = t.leaves_transaction_open.enqueue(how, probe_table, then_raise)
        after = t.add.enqueue(1, 2)  # the same worker thread goes on, on a clean connection
        run_worker()
    finally:
        compat.task_finished.disconnect(seen, sender=DeliveryBackend)

    got = t.leaves_transaction_open.get_result(result.id)
    assert got.status == compat.TaskResultStatus.FAILED
    assert len(got.errors) == 1
    error = got.errors[0]
    assert error.exception_class_path == "buzz_delivery.tasks.runner.transaction_left_open"
    assert "left its database connection with" in error.traceback
    assert "nothing it wrote there is kept" in error.traceback
    assert ("and then it raised" in error.traceback) is then_raise
    delivery = models.WorkflowAgentDelivery.objects.get(id=TaskResult.objects.get(id=result.id).delivery_id)
    assert delivery.status == "failed" and delivery.failure_code == "transaction_left_open"
    # The signal agrees with what was recorded.
    ((_, status, tracebacks),) = [f for f in finished if f[0] == result.id]
    assert status == compat.TaskResultStatus.FAILED and tracebacks == [error.traceback]
    # Nothing of the task's open transaction was committed.
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {probe_table}")
        assert cursor.fetchone() == (0,)
    done = t.add.get_result(after.id)
    assert done.status == compat.TaskResultStatus.SUCCESSFUL and done.return_value == 3


@pytest.mark.django_db(transaction=True)
def test_a_long_traceback_is_cut_at_its_beginning_keeping_its_final_exception_line():
    from buzz_delivery.worker.handlers import FAILURE_MESSAGE_MAX_CHARS

    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    result = t.raises_with_a_long_cause.enqueue()
    run_worker()
    (error,) = t.raises_with_a_long_cause.get_result(result.id).errors
    assert error.exception_class_path == "builtins.ValueError"
    assert len(error.traceback) <= FAILURE_MESSAGE_MAX_CHARS
    assert error.traceback.startswith("[cut: the first ")
    assert error.traceback.endswith("ValueError: the final exception line\n")


@pytest.mark.django_db(transaction=True)
def test_task_enqueued_is_sent_at_the_enqueue_inside_the_callers_transaction_even_if_it_rolls_back():
    """What docs/tasks.md says, as Django's database backend does: sent from enqueue, not on
    commit; a receiver's on_commit hook is dropped with the rollback."""
    from django.db import transaction

    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    sent, committed = [], []

    def seen(sender, task_result, **kwargs):
        sent.append(task_result.id)
        transaction.on_commit(lambda: committed.append(task_result.id))

    compat.task_enqueued.connect(seen, sender=DeliveryBackend)
    try:
        with pytest.raises(RuntimeError), transaction.atomic():
            rolled_back = t.add.enqueue(1, 2)
            raise RuntimeError("the caller rolls back")
        kept = t.add.enqueue(3, 4)
    finally:
        compat.task_enqueued.disconnect(seen, sender=DeliveryBackend)
    assert sent == [rolled_back.id, kept.id] and committed == [kept.id]
    assert list(TaskResult.objects.values_list("id", flat=True)) == [uuid.UUID(kept.id)]


def leave_open(how: str, table: str) -> None:
    """Write a row into ``table`` inside a transaction left open (as the task above does)."""
    from django.db import transaction

    if how == "autocommit":
        transaction.set_autocommit(False)
    elif how == "atomic":
        transaction.atomic().__enter__()
    with connection.cursor() as cursor:
        if how == "begin":
            cursor.execute("BEGIN")
        cursor.execute(f"INSERT INTO {table} (note) VALUES ('a receiver wrote this inside its open transaction')")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("signal_name", ["task_started", "task_finished"])
@pytest.mark.parametrize("how", ["autocommit", "atomic", "begin"])
def test_a_task_signal_receiver_that_leaves_a_transaction_open_is_rolled_back_and_told_and_the_outcome_stands(
    probe_table, signal_name, how
):
    """A receiver is the project's code, not the task's: one that leaves a transaction open is
    told as one that raises is (``task_signal_error``, ``transaction_left_open``), what it wrote
    there is rolled back, and the task runs once, on a clean connection, its outcome settled as
    recorded (not failed by what a receiver did after, or before, it ran)."""
    import logging

    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    signal_ = getattr(compat, signal_name)
    told: list[str] = []

    class Told(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            told.append(record.getMessage())

    def receiver(sender, task_result, **kwargs):
        if task_result.task.func is t.add.func and task_result.args == [1, 2]:
            leave_open(how, probe_table)

    handler = Told(level=logging.ERROR)
    logging.getLogger("buzz_delivery.tasks").addHandler(handler)
    signal_.connect(receiver, sender=DeliveryBackend)
    try:
        first = t.add.enqueue(1, 2)
        after = t.add.enqueue(3, 4)  # the same worker thread goes on, on a clean connection
        run_worker()
    finally:
        signal_.disconnect(receiver, sender=DeliveryBackend)
        logging.getLogger("buzz_delivery.tasks").removeHandler(handler)
    for result, value in ((first, 3), (after, 7)):
        got = t.add.get_result(result.id)
        assert (got.status, got.return_value, got.attempts, got.errors) == (
            compat.TaskResultStatus.SUCCESSFUL,
            value,
            1,
            [],
        )
        delivery = models.WorkflowAgentDelivery.objects.get(id=TaskResult.objects.get(id=result.id).delivery_id)
        assert (delivery.status, delivery.failure_code) == ("finished", None)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {probe_table}")
        assert cursor.fetchone() == (0,)
    (line,) = [m for m in told if "transaction_left_open" in m]
    assert f"result={first.id} signal={signal_name}" in line and "nothing it wrote there is kept" in line


@pytest.mark.django_db(transaction=True)
def test_each_task_runs_in_one_user_code_guard_not_the_workers_and_the_runners_both(monkeypatch):
    from buzz_delivery.usercode import UserCode

    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    entered: list[object] = []
    enter = UserCode.__enter__

    def counted(self):
        entered.append(self)
        return enter(self)

    monkeypatch.setattr(UserCode, "__enter__", counted)
    results = [t.add.enqueue(n, n) for n in range(3)] + [t.explode.enqueue("boom")]
    run_worker()
    assert [t.add.get_result(r.id).return_value for r in results[:3]] == [0, 2, 4]
    assert t.explode.get_result(results[3].id).status == compat.TaskResultStatus.FAILED
    assert len(entered) == len(results)
