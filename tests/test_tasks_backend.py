"""The django.tasks backend on the inbox (buzz_delivery.tasks, issue 34): enqueue and results,
run_after as the retry gate, priority and queues, the worker with sync, async and context
tasks, errors, Django's task signals, the registry rule (a stored path is never imported), and
the documented examples. Runs on Django 6.x's django.tasks and on 5.2 with the backport."""

from __future__ import annotations

import datetime as dt
import io
import sys
import uuid

import pytest
from django.core import mail
from django.core.management import call_command
from django.db import connections

from buzz_delivery import models
from buzz_delivery.tasks import DeliveryBackend, compat, services
from buzz_delivery.tasks.models import TaskResult
from buzz_delivery.testing import CommunityFactory
from tests import tasks_support as t

READY, RUNNING = compat.TaskResultStatus.READY, compat.TaskResultStatus.RUNNING
SUCCESSFUL, FAILED = compat.TaskResultStatus.SUCCESSFUL, compat.TaskResultStatus.FAILED


@pytest.fixture
def tasks_community(db):
    return CommunityFactory(id=uuid.UUID(t.COMMUNITY))


def run_worker(*queues: str, max_tasks: int | None = None) -> str:
    out = io.StringIO()
    options = {"idle_exit": 1.0, "poll_interval": 0.2, "stdout": out}
    if max_tasks:
        options["max_tasks"] = max_tasks
    call_command("run_task_worker", *[f"--queue={q}" for q in queues], **options)
    return out.getvalue()


def counts() -> tuple[int, int, int]:
    return (TaskResult.objects.count(), models.WorkflowAgentDelivery.objects.count(), models.Event.objects.count())


def test_the_backend_is_djangos_and_says_what_it_supports():
    backend = compat.task_backends["default"]
    assert isinstance(backend, DeliveryBackend) and isinstance(backend, compat.BaseTaskBackend)
    assert backend.supports_defer and backend.supports_async_task and backend.supports_get_result
    assert backend.supports_priority  # stored, and the delivery's priority (docs/tasks.md)


def test_enqueue_commits_a_delivery_and_its_result_and_get_result_reads_it(tasks_community):
    result = t.add.enqueue(2, 3)
    assert result.status == READY and result.args == [2, 3] and result.kwargs == {}
    assert result.backend == "default" and result.enqueued_at is not None
    with pytest.raises(ValueError):
        result.return_value  # noqa: B018  (not finished)
    again = compat.task_backends["default"].get_result(result.id)
    assert again.id == result.id and again.status == READY and again.task.func is t.add.func
    assert again.worker_ids == [] and again.started_at is None
    row = TaskResult.objects.get(id=result.id)
    delivery = models.WorkflowAgentDelivery.objects.get(id=row.delivery_id)
    assert delivery.community_id == tasks_community.id and delivery.step_id == result.id
    assert bytes(delivery.target_pubkey) == services.queue_target("default") and delivery.status == "pending"
    assert delivery.trigger_context["django_task"]["path"] == "tests.tasks_support.add"
    assert t.add.get_result(result.id).id == result.id


def test_run_after_is_the_deliverys_retry_gate_and_priority_is_stored(tasks_community):
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    result = t.add.using(run_after=later, priority=-7).enqueue(1, 1)
    row = TaskResult.objects.get(id=result.id)
    assert row.priority == -7 and row.run_after == later
    delivery = models.WorkflowAgentDelivery.objects.get(id=row.delivery_id)
    assert delivery.next_attempt_at == later
    from buzz_delivery import services as inbox

    assert inbox.claim_delivery(tasks_community.id, services.queue_target("default")) is None


@pytest.mark.parametrize(
    ("task_priority", "delivery_priority"),
    [
        (-100, -10),
        (-95, -10),
        (-94, -9),
        (-5, -1),
        (-4, 0),
        (0, 0),
        (4, 0),
        (5, 1),
        (14, 1),
        (15, 2),
        (95, 10),
        (100, 10),
    ],
)
def test_a_tasks_priority_becomes_a_tenth_of_it_on_its_delivery_and_stays_whole_on_the_task(
    tasks_community, task_priority, delivery_priority
):
    result = t.add.using(priority=task_priority).enqueue(1, 2)
    row = TaskResult.objects.get(id=result.id)
    assert row.priority == task_priority
    assert result.task.get_backend().get_result(result.id).task.priority == task_priority
    assert models.WorkflowAgentDelivery.objects.get(id=row.delivery_id).priority == delivery_priority


def test_the_delivery_priority_keeps_the_tasks_order():
    mapped = [services.delivery_priority(p) for p in range(-100, 101)]
    assert mapped == sorted(mapped) and mapped[0] == models.PRIORITY_MIN and mapped[-1] == models.PRIORITY_MAX


@pytest.mark.django_db(transaction=True)
def test_a_higher_priority_task_enqueued_later_is_run_first():
    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    low = t.add.using(priority=-100).enqueue(1, 1)
    ordinary = t.add.enqueue(2, 2)
    raised = t.add.using(priority=10).enqueue(3, 3)
    urgent = t.add.using(priority=100).enqueue(4, 4)
    backend = low.task.get_backend()

    def done() -> set[str]:
        rows = {"low": low, "ordinary": ordinary, "raised": raised, "urgent": urgent}
        return {name for name, r in rows.items() if backend.get_result(r.id).status == SUCCESSFUL}

    run_worker("default", max_tasks=1)
    assert done() == {"urgent"}
    run_worker("default", max_tasks=1)
    assert done() == {"urgent", "raised"}
    run_worker("default", max_tasks=1)
    assert done() == {"urgent", "raised", "ordinary"}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: t.add.using(priority=101), "priority"),
        (lambda: t.add.using(queue_name="nowhere"), "Queue"),
        (lambda: t.add.using(run_after=dt.datetime(2030, 1, 1)), "aware"),
    ],
)
def test_django_validation_refuses_bad_options_and_writes_nothing(tasks_community, make, message):
    with pytest.raises(compat.InvalidTask, match=message):
        make().enqueue(1, 2)
    assert counts() == (0, 0, 0)


def test_arguments_that_are_not_json_are_refused_naming_the_field_and_nothing_is_written(tasks_community):
    with pytest.raises(compat.InvalidTask, match="kwargs"):
        t.add.enqueue(1, b=object())
    assert counts() == (0, 0, 0)


def test_a_result_of_another_community_does_not_exist_for_this_backend(tasks_community, settings):
    result = t.add.enqueue(1, 2)
    other = CommunityFactory()
    backend = DeliveryBackend("default", {"QUEUES": ["default"], "OPTIONS": {"COMMUNITY": str(other.id)}})
    with pytest.raises(compat.TaskResultDoesNotExist):
        backend.get_result(result.id)
    with pytest.raises(compat.TaskResultDoesNotExist):
        compat.task_backends["default"].get_result("not-a-uuid")


@pytest.mark.django_db(transaction=True)
def test_the_worker_runs_sync_async_failing_and_context_tasks_and_records_each_result():
    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    enqueued = {
        "sync": t.add.enqueue(2, 3),
        "async": t.add_later.enqueue(a=4, b=5),
        "error": t.explode.enqueue("boom"),
        "context": t.who_am_i.enqueue(),
    }
    run_worker("default", max_tasks=4)
    got = {name: r.task.get_backend().get_result(r.id) for name, r in enqueued.items()}
    assert got["sync"].status == SUCCESSFUL and got["sync"].return_value == 5
    assert got["async"].status == SUCCESSFUL and got["async"].return_value == 9
    assert got["context"].return_value == {"id": enqueued["context"].id, "attempt": 1}
    failed = got["error"]
    assert failed.status == FAILED and len(failed.errors) == 1
    assert failed.errors[0].exception_class_path == "builtins.ValueError"
    assert failed.errors[0].exception_class is ValueError and "boom" in failed.errors[0].traceback
    with pytest.raises(ValueError, match="failed"):
        failed.return_value  # noqa: B018
    for result in got.values():
        assert result.is_finished and result.attempts == 1 and result.worker_ids[0].endswith(":tasks")
        assert result.enqueued_at <= result.started_at == result.last_attempted_at <= result.finished_at
    delivery = models.WorkflowAgentDelivery.objects.get(id=TaskResult.objects.get(id=failed.id).delivery_id)
    assert delivery.status == "failed" and delivery.failure_code == "TaskFailed"


@pytest.mark.django_db(transaction=True)
def test_djangos_task_signals_are_sent_at_enqueue_start_and_finish():
    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    heard: list[tuple[str, str, str]] = []

    def receiver(name):
        def hear(sender, task_result, **kwargs):
            heard.append((name, task_result.id, task_result.status))

        return hear

    receivers = {
        s: receiver(n)
        for n, s in (
            ("enqueued", compat.task_enqueued),
            ("started", compat.task_started),
            ("finished", compat.task_finished),
        )
    }
    for signal, hear in receivers.items():
        signal.connect(hear, sender=DeliveryBackend)
    try:
        result = t.add.enqueue(1, 2)
        run_worker("default", max_tasks=1)
    finally:
        for signal, hear in receivers.items():
            signal.disconnect(hear, sender=DeliveryBackend)
    assert heard == [
        ("enqueued", result.id, READY),
        ("started", result.id, RUNNING),
        ("finished", result.id, SUCCESSFUL),
    ]


@pytest.mark.django_db(transaction=True)
def test_a_stored_path_that_names_no_registered_task_fails_that_task_and_is_never_imported():
    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    planted = t.add.enqueue(1, 2)
    good = t.add.enqueue(3, 4)
    # A row whose path was changed behind the backend's back (SQL, a restore, another app).
    TaskResult.objects.filter(id=planted.id).update(task_path="tests.never_imported_tasks.payload")
    sys.modules.pop("tests.never_imported_tasks", None)
    run_worker("default", max_tasks=2)
    assert "tests.never_imported_tasks" not in sys.modules
    row = TaskResult.objects.get(id=planted.id)
    delivery = models.WorkflowAgentDelivery.objects.get(id=row.delivery_id)
    assert delivery.status == "failed" and delivery.failure_code == "task_not_registered"
    assert t.add.get_result(good.id).return_value == 7  # one bad row stops nothing else


@pytest.mark.django_db(transaction=True)
@pytest.mark.filterwarnings("ignore:Django 2028 will not have a default mailer")  # Django 6.1, no MAILERS
def test_djangos_documented_example_sends_the_email_on_its_queue():
    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    mail.outbox = []
    result = t.email_users.enqueue(emails=["user@example.com"], subject="You have a message", message="Hello there!")
    assert result.status == READY and result.task.queue_name == "emails" and result.task.priority == 10
    run_worker("emails", max_tasks=1)
    result.refresh()
    assert result.status == SUCCESSFUL and result.return_value == 1
    assert [m.subject for m in mail.outbox] == ["You have a message"]
    row = TaskResult.objects.get(id=result.id)
    delivery = models.WorkflowAgentDelivery.objects.get(id=row.delivery_id)
    assert bytes(delivery.target_pubkey) == services.queue_target("emails")


@pytest.mark.django_db(transaction=True)
def test_aenqueue_and_aget_result():
    import asyncio

    from asgiref.sync import sync_to_async

    CommunityFactory(id=uuid.UUID(t.COMMUNITY))

    async def enqueue():
        try:
            return await t.add_later.aenqueue(20, 22)
        finally:  # the thread-sensitive executor's connection
            await sync_to_async(connections.close_all)()

    result = asyncio.run(enqueue())
    assert result.status == READY
    run_worker("default", max_tasks=1)

    async def read():
        try:
            again = await t.add_later.aget_result(result.id)
            await result.arefresh()
            return again
        finally:
            await sync_to_async(connections.close_all)()

    again = asyncio.run(read())
    assert again.status == SUCCESSFUL and again.return_value == 42 and result.return_value == 42
