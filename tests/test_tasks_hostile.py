"""The django.tasks backend under hostile input: values PostgreSQL's jsonb refuses (NaN, a NUL
character, a lone surrogate) as arguments, return values or error text, each judged where it
is first seen (enqueue refuses it naming the field, nothing written; a task whose value cannot
be stored fails once, never run again); backends sharing a queue's target; every statement
of enqueue and get_result naming its community (Citus's router form)."""

from __future__ import annotations

import io
import uuid

import pytest
from django.core.management import call_command

from buzz_delivery import models
from buzz_delivery.tasks import compat
from buzz_delivery.tasks.models import TaskResult
from buzz_delivery.testing import CommunityFactory
from tests import tasks_support as t

FAILED = compat.TaskResultStatus.FAILED


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
    assert t.RUNS == [name]  # ran once: not retried to be refused again
    got = result.task.get_backend().get_result(result.id)
    assert got.status == FAILED and len(got.errors) == 1
    delivery = models.WorkflowAgentDelivery.objects.get(id=TaskResult.objects.get(id=result.id).delivery_id)
    assert delivery.status == "failed" and delivery.failure_code == "TaskFailed"
    if name != "raises_odd":
        assert "return_value" in got.errors[0].traceback
    else:
        assert got.errors[0].exception_class_path == "odd\\x00module.OddError"
    assert t.add.get_result(good.id).return_value == 3  # the worker went on
