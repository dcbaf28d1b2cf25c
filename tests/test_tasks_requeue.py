"""An operator's requeue of a failed task asks for another run however many leases lapse
after it: the recorded error is keyed with the delivery's requeue count (never dropped), not
found through its history (its last 50 entries). And an error recorded by a holder whose settle
never committed stays the outcome however many leases lapse after it (no requeue: not run again).

Leases are made to lapse cheaply: a claim through the services, its lease aged in the row, the
reaper; each adds two history entries (the claim's and the reaper's)."""

from __future__ import annotations

import datetime as dt
import io
import json
import uuid

import pytest
from django.core.management import call_command

from buzz_delivery import models, services
from buzz_delivery.services import reap
from buzz_delivery.services.operator import requeue_delivery
from buzz_delivery.tasks import compat
from buzz_delivery.tasks import services as task_services
from buzz_delivery.tasks.models import TaskResult
from buzz_delivery.testing import CommunityFactory, Expr, set_delivery_state
from tests import tasks_support as t

FAILED = compat.TaskResultStatus.FAILED
LAPSES = 30  # 60 history entries: more than the 50 the history keeps


def run_worker() -> None:
    call_command("run_task_worker", "--queue=default", idle_exit=1.5, poll_interval=0.2, stdout=io.StringIO())


def delivery_of(result_id: str) -> models.WorkflowAgentDelivery:
    return models.WorkflowAgentDelivery.objects.get(id=TaskResult.objects.get(id=result_id).delivery_id)


def age_and_reap(delivery: models.WorkflowAgentDelivery) -> None:
    set_delivery_state(delivery, lease_until=Expr("STATEMENT_TIMESTAMP() - %s", [dt.timedelta(seconds=1)]))
    reap()
    assert delivery_of_id(delivery).status == "pending"


def delivery_of_id(delivery: models.WorkflowAgentDelivery) -> models.WorkflowAgentDelivery:
    return models.WorkflowAgentDelivery.objects.get(community_id=delivery.community_id, id=delivery.id)


def lapse(delivery: models.WorkflowAgentDelivery, times: int) -> None:
    """``times`` leases of the delivery claimed (by no task worker) and lapsed."""
    target = compat.task_backends["default"].target_for("default")
    for _ in range(times):
        claim = services.claim_delivery(delivery.community_id, target, holder="lapsing")
        assert claim is not None and claim.lease.delivery_id == delivery.id
        age_and_reap(delivery)


def lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.django_db(transaction=True)
def test_a_requeue_followed_by_more_lapsed_leases_than_the_history_keeps_still_runs_the_task_again(tmp_path):
    community = CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    log = tmp_path / "runs.log"
    result = t.mark_and_hold.enqueue(str(log), "", "raise")
    delivery = delivery_of(result.id)
    set_delivery_state((community.id, delivery.id), max_attempts=None)
    run_worker()
    assert t.mark_and_hold.get_result(result.id).status == FAILED
    assert requeue_delivery(community.id, delivery.id).done
    lapse(delivery, LAPSES)
    history = delivery_of_id(delivery).history
    assert len(history) == 50 and "requeue" not in {entry["event"] for entry in history}  # dropped
    run_worker()
    # Ran again, after the lapses (the attempt Django's context counts is the claims the
    # history still holds: 25 of the 31 since the requeue).
    assert lines(log) == [f"{result.id} 1", f"{result.id} 25"]
    done = t.mark_and_hold.get_result(result.id)
    assert done.status == FAILED and len(done.errors) == 2
    assert [e["requeues"] for e in TaskResult.objects.get(id=result.id).errors] == [0, 1]
    settled = delivery_of_id(delivery)
    assert (settled.failure_code, settled.attempt, settled.requeues) == ("TaskFailed", LAPSES + 1, 1)


@pytest.mark.django_db(transaction=True)
def test_an_error_recorded_before_a_settle_that_never_came_stays_the_outcome_however_many_leases_lapse(tmp_path):
    """A holder records the task's error and dies before its settle (the record made here, as
    its statement does); after more lapsed leases than the history keeps, the next worker
    settles the delivery failed as recorded, without running the task."""
    community = CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    log = tmp_path / "runs.log"
    result = t.mark_and_hold.enqueue(str(log), "", "raise")
    delivery = delivery_of(result.id)
    set_delivery_state((community.id, delivery.id), max_attempts=None)
    target = compat.task_backends["default"].target_for("default")
    claim = services.claim_delivery(community.id, target, holder="killed after recording")
    assert claim is not None
    error = {"exception_class_path": "builtins.ValueError", "traceback": "recorded", "failure_code": "TaskFailed"}
    # A caller's requeues is not what is stored: the delivery's count is.
    forged = {**error, "requeues": 7}
    assert task_services.record_task_outcome(community.id, delivery.id, claim.lease.lease_generation, error=forged)
    age_and_reap(delivery)
    lapse(delivery, LAPSES)
    run_worker()
    assert lines(log) == []  # never run
    row = TaskResult.objects.get(id=result.id)
    assert row.errors == [{**error, "lease_generation": claim.lease.lease_generation, "requeues": 0}]
    settled = delivery_of_id(delivery)
    assert (settled.status, settled.failure_code) == ("failed", "TaskFailed")


# The record statement of the release before requeues existed (its error carries no
# ``requeues``): what a worker still running that release writes after migration 0033 is
# applied, during a rolling deploy.
PREVIOUS_RELEASE_RECORD = f"""
UPDATE {TaskResult._meta.db_table} AS r
SET return_value = NULL, errors = r.errors || jsonb_build_array(%(error)s::jsonb)
WHERE r.community_id = %(community_id)s AND r.delivery_id = %(delivery_id)s
  AND EXISTS (
      SELECT 1 FROM {models.WorkflowAgentDelivery._meta.db_table} d
      WHERE d.community_id = %(community_id)s AND d.id = %(delivery_id)s
        AND d.lease_generation = %(generation)s AND d.status = 'claimed' AND d.lease_until >= buzz_delivery_now()
  )
RETURNING r.id
"""


@pytest.mark.django_db(transaction=True)
def test_an_error_without_requeues_recorded_after_a_counted_requeue_stays_the_outcome(tmp_path):
    """A requeue is counted; then a worker of the previous release (no ``requeues`` in what it
    records) runs the task, records its error and dies before its settle. The requeue came
    before that error (its history entry says so, still there): the next worker settles the
    delivery failed as recorded, without running the task again (a count above 0 does not
    mean a requeue since, for an error written after the count existed)."""
    from django.db import connection

    community = CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    log = tmp_path / "runs.log"
    result = t.mark_and_hold.enqueue(str(log), "", "raise")
    delivery = delivery_of(result.id)
    set_delivery_state((community.id, delivery.id), max_attempts=None)
    run_worker()
    assert requeue_delivery(community.id, delivery.id).done
    target = compat.task_backends["default"].target_for("default")
    claim = services.claim_delivery(community.id, target, holder="previous release, killed after recording")
    assert claim is not None
    error = {
        "exception_class_path": "builtins.ValueError",
        "traceback": "recorded after the requeue",
        "failure_code": "TaskFailed",
        "lease_generation": claim.lease.lease_generation,
    }
    with connection.cursor() as cursor:
        cursor.execute(
            PREVIOUS_RELEASE_RECORD,
            {
                "error": json.dumps(error),
                "community_id": community.id,
                "delivery_id": delivery.id,
                "generation": claim.lease.lease_generation,
            },
        )
        assert cursor.fetchall()
    age_and_reap(delivery)
    run_worker()
    assert lines(log) == [f"{result.id} 1"]  # the first run only: not run again
    settled = delivery_of_id(delivery)
    assert (settled.status, settled.failure_code, settled.requeues) == ("failed", "TaskFailed", 1)
