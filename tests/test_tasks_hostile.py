"""The django.tasks backend under hostile input: values PostgreSQL's jsonb refuses (NaN, a NUL
character, a lone surrogate) as arguments, return values or error text, each judged where it
is first seen (enqueue refuses it naming the field, nothing written; a task whose value cannot
be stored fails once, never run again); backends sharing a queue's target; every statement
of enqueue and get_result naming its community (Citus's router form)."""

from __future__ import annotations

import datetime as dt
import io
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from django.core.checks import run_checks
from django.core.management import call_command

from buzz_delivery import models
from buzz_delivery.tasks import compat
from buzz_delivery.tasks.models import TaskResult
from buzz_delivery.testing import CommunityFactory, Expr, set_delivery_state
from tests import tasks_support as t

FAILED = compat.TaskResultStatus.FAILED
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def tasks_community(db):
    return CommunityFactory(id=uuid.UUID(t.COMMUNITY))


def run_worker(*queues: str, idle_exit: float = 1.5) -> str:
    out = io.StringIO()
    call_command(
        "run_task_worker", *[f"--queue={q}" for q in queues], idle_exit=idle_exit, poll_interval=0.2, stdout=out
    )
    return out.getvalue()


def counts() -> tuple[int, int, int]:
    return (TaskResult.objects.count(), models.WorkflowAgentDelivery.objects.count(), models.Event.objects.count())


@pytest.mark.parametrize(
    ("args", "kwargs", "field"),
    [
        (["a\x00b"], {}, "args"),
        ([], {"b": {"nested": ["\x00"]}}, "kwargs"),
        ([], {"k\x00": 1}, "kwargs"),
        (["\ud800"], {}, "args"),
    ],
)
def test_arguments_jsonb_cannot_store_are_refused_naming_the_field_and_nothing_is_written(
    tasks_community, args, kwargs, field
):
    with pytest.raises(compat.InvalidTask, match=field):
        t.add.enqueue(*args, **kwargs)
    assert counts() == (0, 0, 0)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", ["returns_nan", "returns_nul", "returns_surrogate", "raises_odd"])
def test_a_task_whose_outcome_jsonb_cannot_store_fails_once_and_is_not_run_again(name):
    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    t.RUNS.clear()
    result = getattr(t, name).enqueue()
    good = t.add.enqueue(1, 2)
    run_worker("default")
    assert [name] == t.RUNS  # ran once: not retried to be refused again
    got = result.task.get_backend().get_result(result.id)
    assert got.status == FAILED and len(got.errors) == 1
    delivery = models.WorkflowAgentDelivery.objects.get(id=TaskResult.objects.get(id=result.id).delivery_id)
    assert delivery.status == "failed" and delivery.failure_code == "TaskFailed"
    if name != "raises_odd":
        assert "return_value" in got.errors[0].traceback
    else:
        assert got.errors[0].exception_class_path == "odd\\x00module.OddError"
    assert t.add.get_result(good.id).return_value == 3  # the worker went on


def two_backends(other_options: dict | None = None) -> dict:
    default = {
        "BACKEND": "buzz_delivery.tasks.DeliveryBackend",
        "QUEUES": ["default", "emails"],
        "OPTIONS": {"COMMUNITY": t.COMMUNITY},
    }
    other = {"BACKEND": "buzz_delivery.tasks.DeliveryBackend", "QUEUES": ["default"]}
    other["OPTIONS"] = {"COMMUNITY": t.COMMUNITY, **(other_options or {})}
    return {"default": default, "other": other}


@pytest.mark.django_db(transaction=True)
def test_a_worker_refuses_to_start_when_another_backend_of_its_community_shares_a_queues_target(settings):
    from django.core.management.base import CommandError

    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    settings.TASKS = two_backends()
    theirs = t.add.using(backend="other").enqueue(1, 2)
    refused = None
    try:
        run_worker("default")
    except CommandError as exc:
        refused = exc
    # The other backend's task was not claimed, let alone failed as "not a task of default".
    row = TaskResult.objects.get(id=theirs.id)
    delivery = models.WorkflowAgentDelivery.objects.get(id=row.delivery_id)
    assert (delivery.status, delivery.failure_code) == ("pending", None)
    assert compat.task_backends["other"].get_result(theirs.id).status == compat.TaskResultStatus.READY
    assert refused is not None and "TARGETS" in str(refused) and refused.returncode == 2
    errors = [e for e in run_checks() if e.id.startswith("buzz_delivery.E10")]
    assert [e.id for e in errors] == ["buzz_delivery.E102"] * 2  # each backend's
    assert all("TASKS['default']" in e.msg and "TASKS['other']" in e.msg for e in errors)


@pytest.mark.django_db(transaction=True)
def test_backends_of_one_community_with_their_own_targets_each_run_their_own_tasks(settings):
    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    settings.TASKS = two_backends({"TARGETS": {"default": "ab" * 32}})
    assert [e.id for e in run_checks() if e.id.startswith("buzz_delivery.E10")] == []
    mine = t.add.enqueue(1, 2)
    theirs = t.add.using(backend="other").enqueue(3, 4)
    run_worker("default")
    assert t.add.get_result(mine.id).return_value == 3
    assert compat.task_backends["other"].get_result(theirs.id).status == compat.TaskResultStatus.READY
    call_command("run_task_worker", "--backend=other", idle_exit=1.0, poll_interval=0.2, stdout=io.StringIO())
    assert compat.task_backends["other"].get_result(theirs.id).return_value == 7


@pytest.mark.django_db(transaction=True)
def test_every_statement_on_task_results_names_its_community():
    """Citus's router form (SPEC 15): what enqueue, get_result and the runner's reads and
    record send about a task result is filtered (or inserted) by its community."""
    import re

    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from buzz_delivery.tasks import services

    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    with CaptureQueriesContext(connection) as captured:
        result = t.add.enqueue(1, 2)
        t.add.get_result(result.id)
        stored = services.read_task(t.COMMUNITY, result.id)
        # Fenced by the lease: a pending delivery is no holder's.
        held = services.read_task_of_delivery(t.COMMUNITY, stored.delivery_id, 1)
        assert held.task.id == uuid.UUID(result.id) and held.recorded.state == "lease_lost"
        services.record_task_outcome(t.COMMUNITY, stored.delivery_id, 1, return_value=3)
    statements = [q["sql"].rsplit("; ", 1)[-1] for q in captured.captured_queries]
    statements = [sql for sql in statements if "buzz_tasks_result" in sql]
    assert len(statements) >= 5
    for sql in statements:
        if sql.lstrip().upper().startswith("INSERT"):
            assert "community_id" in sql.split("VALUES", 1)[0], sql
        else:
            assert re.search(r'WHERE\s+\(?[\w".]*community_id"?\s*=', sql), sql


# --- real worker processes: kill -9 mid-task, two workers racing ----------------------------


def spawn_worker(*options: str) -> subprocess.Popen:
    """``run_task_worker`` in its own process on the test database, with this module's tasks."""
    from django.db import connection

    from project.database_url import database_url

    code = (
        "import django, sys; django.setup(); import tests.tasks_support; "
        "from django.core.management import execute_from_command_line; "
        "execute_from_command_line(['manage.py', 'run_task_worker', *sys.argv[1:]])"
    )
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "BUZZ_MIN_LEASE_SECONDS": "1",  # so that --lease-seconds may be short
    }
    return subprocess.Popen(
        [sys.executable, "-c", code, "--poll-interval=0.2", *options],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.django_db(transaction=True)
def test_a_task_whose_worker_is_killed_mid_task_runs_again_and_its_result_is_recorded_once(tmp_path):
    from buzz_delivery.services import reap

    community = CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    log, gate = tmp_path / "runs.log", tmp_path / "gate"
    result = t.mark_and_wait.enqueue(str(log), str(gate))
    first = spawn_worker()
    try:
        wait_for(lambda: len(lines(log)) == 1)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    running = t.mark_and_wait.get_result(result.id)
    assert running.status == compat.TaskResultStatus.RUNNING and len(running.worker_ids) == 1
    with pytest.raises(ValueError):
        running.return_value  # noqa: B018
    # The lease lapses (its time, made to pass) and the reaper hands the task back.
    row = TaskResult.objects.get(id=result.id)
    set_delivery_state(
        (community.id, row.delivery_id), lease_until=Expr("STATEMENT_TIMESTAMP() - %s", [dt.timedelta(seconds=1)])
    )
    reap()
    assert t.mark_and_wait.get_result(result.id).status == compat.TaskResultStatus.READY
    gate.touch()
    second = spawn_worker("--idle-exit=1")
    assert second.wait(60) == 0
    done = t.mark_and_wait.get_result(result.id)
    assert done.status == compat.TaskResultStatus.SUCCESSFUL and done.return_value == result.id
    assert done.attempts == 2 and done.errors == []
    assert lines(log) == [f"{result.id} 1", f"{result.id} 2"]  # at least once: run again, once


@pytest.mark.django_db(transaction=True)
def test_two_worker_processes_racing_run_each_task_once(tmp_path):
    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    log = tmp_path / "runs.log"
    results = [t.mark_and_wait.enqueue(str(log), "") for _ in range(40)]
    workers = [spawn_worker("--idle-exit=1", "--concurrency=2") for _ in range(2)]
    try:
        assert [w.wait(120) for w in workers] == [0, 0]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    assert sorted(lines(log)) == sorted(f"{r.id} 1" for r in results)
    for r in results:
        got = t.mark_and_wait.get_result(r.id)
        assert got.status == compat.TaskResultStatus.SUCCESSFUL and got.return_value == r.id and got.attempts == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("signal_name", ["task_started", "task_finished"])
def test_a_task_signal_receiver_that_raises_neither_reruns_nor_blocks_the_task(tmp_path, signal_name):
    """The receivers are the project's code, not the task's: one that raises is logged; the
    task still runs once and its outcome stands (raising from the worker's handler would retry
    the delivery and run a task that already ran, again, up to max_attempts times)."""
    from buzz_delivery.tasks import DeliveryBackend

    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    log = tmp_path / "runs.log"

    def broken(sender, task_result, **kwargs):
        raise RuntimeError("a receiver's own bug")

    signal_ = getattr(compat, signal_name)
    signal_.connect(broken, sender=DeliveryBackend)
    try:
        result = t.mark_and_wait.enqueue(str(log), "")
        failing = t.explode.enqueue("boom")
        run_worker("default")
    finally:
        signal_.disconnect(broken, sender=DeliveryBackend)
    assert lines(log) == [f"{result.id} 1"]
    done = t.mark_and_wait.get_result(result.id)
    assert done.status == compat.TaskResultStatus.SUCCESSFUL and done.return_value == result.id
    assert done.attempts == 1
    failed = t.explode.get_result(failing.id)
    assert failed.status == FAILED and failed.attempts == 1
    assert failed.errors[0].exception_class_path == "builtins.ValueError"


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("enqueue", "field"),
    [
        (lambda: t.add.using(run_after="2030-01-01T00:00:00Z").enqueue(1, 2), "run_after"),
        (lambda: t.add.enqueue(nested(100_000), 1), "args"),
        (lambda: t.add.enqueue(1, b=nested(100_000)), "kwargs"),
        (lambda: compat.task_backends["default"].enqueue(t.add, "12", {}), "args"),
        (lambda: compat.task_backends["default"].enqueue(t.add, [1, 2], [("b", 2)]), "kwargs"),
    ],
)
def test_malformed_enqueues_are_refused_as_invalid_tasks_naming_the_field_and_nothing_is_written(
    tasks_community, enqueue, field
):
    with pytest.raises(compat.InvalidTask, match=field):
        enqueue()
    assert counts() == (0, 0, 0)


@pytest.mark.django_db(transaction=True)
def test_enqueue_commits_and_rolls_back_with_the_callers_transaction():
    """Our enqueue is the caller's transaction's (Django leaves it to the backend; its docs
    suggest transaction.on_commit): no other connection sees the task before the commit, and a
    rollback leaves nothing, not even a task a worker could run."""
    import threading

    from django.db import connections, transaction

    CommunityFactory(id=uuid.UUID(t.COMMUNITY))

    def seen_elsewhere() -> int:
        got: list[int] = []

        def look() -> None:
            try:
                got.append(TaskResult.objects.count())
            finally:
                connections.close_all()

        thread = threading.Thread(target=look)
        thread.start()
        thread.join()
        return got[0]

    with pytest.raises(RuntimeError), transaction.atomic():
        rolled_back = t.add.enqueue(1, 2)
        assert seen_elsewhere() == 0
        raise RuntimeError
    with pytest.raises(compat.TaskResultDoesNotExist):
        t.add.get_result(rolled_back.id)
    assert counts() == (0, 0, 0)
    with transaction.atomic():
        kept = t.add.enqueue(3, 4)
        assert seen_elsewhere() == 0
    assert seen_elsewhere() == 1
    run_worker("default")
    assert t.add.get_result(kept.id).return_value == 7


@pytest.mark.django_db(transaction=True)
def test_the_task_results_admin_list_reads_no_distinct_over_the_table(admin_client):
    """The queue filter offers TASKS' queues: no SELECT DISTINCT over every task row on each
    page (the house rule of the inbox's admin, tests/test_admin.py)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    done = t.add.enqueue(1, 2)
    mailed = t.email_users.enqueue(emails=[], subject="s", message="m")
    run_worker("default")
    url = "/admin/buzz_tasks/taskresult/"
    with CaptureQueriesContext(connection) as captured:
        page = admin_client.get(url)
    assert page.status_code == 200 and "SUCCESSFUL (finished)" in page.content.decode()
    assert not [q["sql"] for q in captured.captured_queries if "DISTINCT" in q["sql"].upper()]
    assert "?queue_name=emails" in page.content.decode()
    emails = admin_client.get(url, {"queue_name": "emails"}).content.decode()
    assert mailed.id in emails and done.id not in emails
    for result in (done, mailed):
        assert admin_client.get(f"{url}{result.id}/change/").status_code == 200


def test_get_result_returns_the_task_with_the_options_it_was_enqueued_with(tasks_community):
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    enqueued = t.add.using(run_after=later, priority=-7, queue_name="emails").enqueue(1, 2)
    task = t.add.get_result(enqueued.id).task
    assert (task.run_after, task.priority, task.queue_name) == (later, -7, "emails")
    assert task.func is t.add.func


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"COMMUNITY": "not-a-uuid"}, "COMMUNITY"),
        ({"COMMUNITY": t.COMMUNITY, "TARGETS": {"default": "xyz"}}, "TARGETS"),
    ],
)
def test_manage_py_check_reports_a_delivery_backends_bad_options(settings, options, problem):
    """On Django 5.2 the backport's check of the backends runs only where the django_tasks app
    is installed, which this app does not ask for (docs/tasks.md): ours runs regardless."""
    from django.core.management.base import SystemCheckError

    settings.TASKS = {"default": {"BACKEND": "buzz_delivery.tasks.DeliveryBackend", "OPTIONS": options}}
    with pytest.raises(SystemCheckError, match=problem) as raised:
        call_command("check")
    assert str(raised.value).count("buzz_delivery.E101") == 1


@pytest.mark.django_db(transaction=True)
def test_sigterm_gives_a_running_task_its_shutdown_grace_then_its_lease_and_the_task_runs_again(tmp_path):
    """Under cron or systemd: SIGTERM lets a running task finish within --shutdown-grace (exit
    0); past it the worker gives the lease up and exits 3, and the task runs again once the
    lease (--lease-seconds) lapses."""
    from buzz_delivery.services import reap

    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    log, gate = tmp_path / "runs.log", tmp_path / "gate"
    result = t.mark_and_wait.enqueue(str(log), str(gate))
    impatient = spawn_worker("--shutdown-grace=1", "--lease-seconds=2")
    try:
        wait_for(lambda: len(lines(log)) == 1)
        impatient.send_signal(signal.SIGTERM)
        assert impatient.wait(20) == 3  # abandoned: the task was still running
    finally:
        if impatient.poll() is None:
            impatient.kill()
    time.sleep(2.5)  # the given-up lease lapses
    reap()
    patient = spawn_worker("--shutdown-grace=20", "--lease-seconds=2")
    try:
        wait_for(lambda: len(lines(log)) == 2)
        patient.send_signal(signal.SIGTERM)
        time.sleep(1)
        gate.touch()  # the task finishes within the grace
        assert patient.wait(20) == 0
    finally:
        if patient.poll() is None:
            patient.kill()
    done = t.mark_and_wait.get_result(result.id)
    assert done.status == compat.TaskResultStatus.SUCCESSFUL and done.attempts == 2
    assert lines(log) == [f"{result.id} 1", f"{result.id} 2"]


@pytest.mark.django_db(transaction=True)
def test_an_async_tasks_orm_calls_run_in_the_handler_thread_on_its_connection():
    """async_to_sync (Django's Task.call) runs the coroutine on a loop of its own; what it
    hands to sync_to_async runs back in the handler thread (concurrency 1: the one a sync task
    runs in), on that thread's connection and community scope (buzz_delivery.usercode)."""
    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    in_async = t.count_results_async.enqueue()
    in_sync = t.count_results.enqueue()
    run_worker("default")
    rows, orm_thread, loop_thread = t.count_results_async.get_result(in_async.id).return_value
    sync_rows, handler_thread, _ = t.count_results.get_result(in_sync.id).return_value
    assert rows == sync_rows == 2
    assert orm_thread == handler_thread != loop_thread


# --- killed after the outcome was recorded, before the settle ------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("outcome", ["value", "none", "raise"])
def test_a_worker_killed_after_recording_the_outcome_leaves_it_to_the_next_which_never_runs_the_task_again(
    tmp_path, outcome
):
    """The first worker runs the task, records its outcome and is killed (-9) in its
    ``task_finished`` receiver (tests.tasks_support.hold_after_recording), before its settle.
    The second worker finds the outcome recorded: it settles the delivery as the outcome says
    (a return value, None included: finished, an error: failed ``TaskFailed``), without running
    the task or sending task_started/task_finished again."""
    from buzz_delivery.services import reap
    from buzz_delivery.tasks import DeliveryBackend

    community = CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    log, hold = tmp_path / "runs.log", tmp_path / "recorded"
    result = t.mark_and_hold.enqueue(str(log), str(hold), outcome)
    first = spawn_worker()
    try:
        wait_for(hold.exists)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    row = TaskResult.objects.get(id=result.id)
    recorded = (row.return_value, row.errors)
    assert models.WorkflowAgentDelivery.objects.get(id=row.delivery_id).status == "claimed"
    set_delivery_state(
        (community.id, row.delivery_id), lease_until=Expr("STATEMENT_TIMESTAMP() - %s", [dt.timedelta(seconds=1)])
    )
    reap()
    assert t.mark_and_hold.get_result(result.id).status == compat.TaskResultStatus.READY
    heard: list[str] = []

    def hear(sender, task_result, **kwargs):
        heard.append(task_result.id)

    # The second worker runs in this process (its signals heard here).
    compat.task_started.connect(hear, sender=DeliveryBackend)
    compat.task_finished.connect(hear, sender=DeliveryBackend)
    try:
        run_worker("default")
    finally:
        compat.task_started.disconnect(hear, sender=DeliveryBackend)
        compat.task_finished.disconnect(hear, sender=DeliveryBackend)
    assert lines(log) == [f"{result.id} 1"]  # ran once
    assert heard == []
    row.refresh_from_db()
    assert (row.return_value, row.errors) == recorded  # the first run's, untouched
    delivery = models.WorkflowAgentDelivery.objects.get(id=row.delivery_id)
    done = t.mark_and_hold.get_result(result.id)
    assert done.attempts == 2
    if outcome == "raise":
        assert (delivery.status, delivery.failure_code) == ("failed", "TaskFailed")
        assert done.status == FAILED and len(done.errors) == 1
        assert done.errors[0].exception_class_path == "builtins.ValueError"
        assert "attempt 1" in done.errors[0].traceback
    else:
        assert (delivery.status, delivery.failure_code) == ("finished", None)
        assert done.status == compat.TaskResultStatus.SUCCESSFUL
        assert done.return_value == (None if outcome == "none" else f"{result.id} 1")


@pytest.mark.django_db(transaction=True)
def test_a_failed_task_an_operator_requeues_runs_again_its_earlier_error_is_not_its_outcome(tmp_path):
    """A recorded error ends the task, unless an operator requeues the delivery after it: the
    task runs again and its new outcome is the one settled."""
    from buzz_delivery.services.operator import requeue_delivery

    community = CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    log = tmp_path / "runs.log"
    result = t.mark_and_hold.enqueue(str(log), "", "raise")
    run_worker("default")
    assert t.mark_and_hold.get_result(result.id).status == FAILED
    row = TaskResult.objects.get(id=result.id)
    assert requeue_delivery(community.id, row.delivery_id).done
    run_worker("default")
    assert lines(log) == [f"{result.id} 1", f"{result.id} 2"]  # ran again
    done = t.mark_and_hold.get_result(result.id)
    assert done.status == FAILED and len(done.errors) == 2
    # A not-registered task, requeued once it is registered, runs then.
    planted = t.add.enqueue(1, 2)
    TaskResult.objects.filter(id=planted.id).update(task_path="tests.never_imported_tasks.payload")
    run_worker("default")
    planted_row = TaskResult.objects.get(id=planted.id)
    delivery = models.WorkflowAgentDelivery.objects.get(id=planted_row.delivery_id)
    assert (delivery.status, delivery.failure_code) == ("failed", "task_not_registered")
    TaskResult.objects.filter(id=planted.id).update(task_path=row.task_path.replace("mark_and_hold", "add"))
    assert requeue_delivery(community.id, planted_row.delivery_id).done
    run_worker("default")
    again = t.add.get_result(planted.id)
    assert again.status == compat.TaskResultStatus.SUCCESSFUL and again.return_value == 3
    assert [e.exception_class_path for e in again.errors] == ["LookupError"]
