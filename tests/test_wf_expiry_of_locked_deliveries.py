"""A run's end expires its pending deliveries skipping rows locked right now, and gives up on
one still locked after about two seconds (``services/runs.py``, ``LOCKED_TRIES``). Its mark,
``deliveries_to_expire``, must then stay: the maintenance's next pass expires what was left.
Cleared anyway, a delivery of an ended run locked that long by another transaction (a claim
under a concurrency limit that found no slot for it, any long lock of its queue row) stayed
pending for good."""

from __future__ import annotations

import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection, transaction

from buzz_delivery import services
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.services import sql
from buzz_delivery.services.runs import PENDING_OF_RUNS_LEFT
from buzz_delivery.services.tenancy import fleet
from buzz_delivery.testing import CommunityFactory, WorkflowFactory, random32
from buzz_delivery.workflows.models import Run
from buzz_delivery.workflows.services import Canceled, cancel_run
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from buzz_delivery.workflows.testing import run_until_idle, send_step
from tests.citus_support import CITUS_MODE
from tests.wf_support import start

pytestmark = pytest.mark.django_db(transaction=True)


def locking(community_id, delivery_id, locked: threading.Event, release: threading.Event) -> None:
    """Another transaction holding the delivery's queue row (``FOR UPDATE``) until released."""
    try:
        with transaction.atomic(), fleet(), connection.cursor() as cursor:
            cursor.execute(
                f"SELECT id FROM {sql.QUEUE} WHERE community_id = %s AND id = %s FOR UPDATE",
                [community_id, delivery_id],
            )
            assert cursor.fetchall()
            locked.set()
            assert release.wait(60)
    finally:
        connection.close()


def ended_with_one_locked(end, bad: bytes | None = None) -> tuple[Run, WorkflowAgentDelivery, object]:
    """A run with two pending deliveries (and one to ``bad`` in a step of its own, if given),
    one of them locked by another transaction while ``end(run, workflow)`` ends the run (the
    lock outlasts the expiry's tries); returns the run, the locked delivery and what ``end``
    returned."""
    workflow = WorkflowFactory()
    locked_target, other = sorted([random32(), random32()])
    steps = [send_step("send", [locked_target, other])]
    if bad is not None:
        steps.append(send_step("bad", [bad]))
    run = start(workflow, {"steps": steps})
    run_until_idle(workflow.community_id)
    held = WorkflowAgentDelivery.objects.get(run_id=run.pk, target_pubkey=locked_target)
    assert held.status == "pending"
    connection.close()
    locked, release = threading.Event(), threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        lock = pool.submit(locking, workflow.community_id, held.id, locked, release)
        assert locked.wait(30)
        try:
            outcome = end(run, workflow)
        finally:
            release.set()
            connection.close()
        lock.result(30)
    return run, held, outcome


def expired_later_by_the_maintenance(run: Run, held: WorkflowAgentDelivery) -> None:
    held.refresh_from_db()
    assert held.status == "pending"  # the expiry gave up on it, locked all along
    run.refresh_from_db()
    assert run.deliveries_to_expire is True, "the mark was cleared with a delivery of the ended run left pending"
    assert reap_workflow_steps().deliveries_expired == 1
    held.refresh_from_db()
    assert (held.status, held.failure_code) == ("expired", "run_canceled")
    run.refresh_from_db()
    assert run.deliveries_to_expire is False
    assert reap_workflow_steps().deliveries_expired == 0


def test_a_cancel_that_gives_up_on_a_locked_delivery_keeps_the_mark_for_the_maintenance():
    run, held, outcome = ended_with_one_locked(lambda run, workflow: cancel_run(workflow.community_id, run.pk))
    assert outcome == Canceled(runs=1, deliveries=1)
    expired_later_by_the_maintenance(run, held)


def test_a_maintenance_pass_that_gives_up_on_a_locked_delivery_keeps_the_mark_for_the_next():
    """The path of ``expire_deliveries_of_ended_runs``: a run ended with the mark set and its
    deliveries left (as the fan-in trigger leaves them), expired by the maintenance."""

    bad = random32()

    def fail_in_the_trigger(run, workflow):
        claim = services.claim_delivery(workflow.community_id, bad, lease_seconds=30)
        services.finish_delivery(claim.lease, "failed")  # its step fails the run inside the trigger
        run.refresh_from_db()
        assert (run.state, run.deliveries_to_expire) == ("failed", True)
        return reap_workflow_steps().deliveries_expired

    run, held, expired = ended_with_one_locked(fail_in_the_trigger, bad)
    assert expired == 1
    expired_later_by_the_maintenance(run, held)


@pytest.mark.skipif(not CITUS_MODE, reason="Citus mode only: the plan of the read on the cluster")
def test_on_citus_the_read_of_what_is_left_runs_on_the_community_node_alone():
    community = CommunityFactory()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "EXPLAIN (COSTS OFF) " + PENDING_OF_RUNS_LEFT, {"community_id": community.id, "run_ids": [uuid.uuid4()]}
        )
        plan = "\n".join(row[0] for row in cursor.fetchall())
    counts = re.findall(r"Task Count: (\d+)", plan)
    assert counts and set(counts) == {"1"}, plan
