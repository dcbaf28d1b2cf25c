"""Cron schedules (issue 12): one run per slot, exactly once even when two maintenance runs
overlap; missed slots by the stated policy."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, connections

from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows.models import Run, Schedule
from buzz_delivery.workflows.services import create_schedule, publish_definition, start_due_schedules
from buzz_delivery.workflows.services.schedules import slot_key
from buzz_delivery.workflows.testing import function_step
from tests.conftest import BARRIER_TIMEOUT

pytestmark = pytest.mark.django_db


@pytest.fixture
def workflow(community):
    w = WorkflowFactory(community=community)
    publish_definition(community.id, w.id, {"steps": [function_step("a", "echo", input={"x": {"$ref": "input.x"}})]})
    return w


def due(schedule: Schedule, minutes_ago: int) -> dt.datetime:
    """Move the schedule's next slot into the past (time passing), on a whole minute."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_workflows_schedule SET next_slot_at = date_trunc('minute', now())"
            " - make_interval(mins => %s) WHERE id = %s RETURNING next_slot_at",
            [minutes_ago, schedule.id],
        )
        return cursor.fetchone()[0]


def test_a_due_slot_starts_one_run_with_a_schedule_cause(workflow):
    schedule = create_schedule(workflow.community_id, workflow.id, "* * * * *", input={"x": 1})
    assert start_due_schedules().started == 0  # the first slot is in the future
    slot = due(schedule, 0)
    result = start_due_schedules()
    assert (result.started, result.missed) == (1, 0)
    run = Run.objects.get(workflow_id=workflow.id)
    assert (run.cause_kind, run.cause_scheduled_for, run.input) == ("schedule", slot, {"x": 1})
    assert run.idempotency_key == slot_key(schedule.id, slot)
    schedule.refresh_from_db()
    assert schedule.next_slot_at > slot
    assert start_due_schedules().started == 0


def test_a_second_start_of_the_same_slot_is_an_idempotent_no_op(workflow):
    schedule = create_schedule(workflow.community_id, workflow.id, "* * * * *")
    slot = due(schedule, 0)
    start_due_schedules()
    with connection.cursor() as cursor:  # a second maintenance run that read the old next slot
        cursor.execute("UPDATE buzz_workflows_schedule SET next_slot_at = %s WHERE id = %s", [slot, schedule.id])
    start_due_schedules()
    assert Run.objects.filter(workflow_id=workflow.id, cause_scheduled_for=slot).count() == 1


def test_missed_slots_latest_starts_only_the_most_recent_and_all_starts_each(workflow):
    latest = create_schedule(workflow.community_id, workflow.id, "* * * * *")
    every = create_schedule(workflow.community_id, workflow.id, "* * * * *", missed="all")
    due(latest, 4)
    due(every, 4)
    result = start_due_schedules()
    assert (result.started, result.missed) == (1 + 5, 4)
    assert Run.objects.filter(idempotency_key__startswith=f"schedule:{every.id}:").count() == 5
    assert Run.objects.filter(idempotency_key__startswith=f"schedule:{latest.id}:").count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_overlapping_maintenance_runs_start_each_slot_once(workflow):
    import threading

    schedules = [create_schedule(workflow.community_id, workflow.id, "* * * * *", missed="all") for _ in range(5)]
    for s in schedules:
        due(s, 2)
    barrier = threading.Barrier(2, timeout=BARRIER_TIMEOUT)
    results = []

    def body() -> None:
        try:
            barrier.wait()
            results.append(start_due_schedules())
        finally:
            connections.close_all()

    threads = [threading.Thread(target=body) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(r.started for r in results) == 15
    assert Run.objects.filter(workflow_id=workflow.id).count() == 15


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"cron": "every day"}, "cron"),
        ({"cron": "* * *"}, "cron"),
        ({"missed": "some"}, "missed"),
        ({"input": [1]}, "input"),
    ],
)
def test_bad_schedules_are_refused_by_name(workflow, kwargs, field):
    args = {"cron": "* * * * *", **kwargs}
    with pytest.raises(ValidationError) as exc:
        create_schedule(workflow.community_id, workflow.id, args.pop("cron"), **args)
    assert field in exc.value.message_dict
    assert Schedule.objects.count() == 0
