"""An operator's force-fail of a claimed delivery and the agent's accept of that same delivery, at
once. The accept (agents ``accept_delivery``) takes the delivery's workflow run first (the
engine's lock order), then settles the delivery (its queue row). The force-fail deletes the
queue row first, then writes the record, whose triggers count the failure in the workflow run
(``buzz_agents_delivery_lost`` and the fan-in lock the run's row): the other order. Met between
their statements, each holds what the other waits for: "deadlock detected". The accept retries
its deadlocks; the force-fail (the admin's action) does not, and it is the victim whenever it
waited first.

A reproduction, deterministic: a transaction holding the workflow run's row (the engine at work
on that run) makes the accept wait for the run while the force-fail takes the queue row and
queues behind the accept for the run; once the run is free the accept takes it, then waits for
the queue row."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection, transaction

from buzz_delivery import services as core
from buzz_delivery.agents.services import Accepted, LeaseLost, accept_delivery
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.services import Cause
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.services import publish_definition, start_run
from buzz_delivery.workflows.testing import run_until_idle, send_step
from tests.conftest import BARRIER_TIMEOUT, collecting, lock_waits_reach

LOCK_WORKFLOW_RUN = "SELECT 1 FROM buzz_workflows_run WHERE community_id = %s AND run_id = %s FOR NO KEY UPDATE"


@pytest.mark.django_db(transaction=True)
def test_a_force_fail_and_an_accept_of_one_delivery_never_deadlock(community):
    agent = random32()
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, {"steps": [send_step("ask", [agent], **{"await": "agent_run"})]})
    run = start_run(community.id, workflow.id, {}, cause=Cause.event(os.urandom(32)))
    run_until_idle(community.id)
    delivery = WorkflowAgentDelivery.objects.get(run_id=run.pk)
    claim = core.claim_delivery(community.id, agent, delivery_id=delivery.id, lease_seconds=60)
    assert claim is not None
    connection.close()
    errors: list[BaseException] = []
    found: dict[str, object] = {}
    holding, release = threading.Event(), threading.Event()

    guarded = collecting(errors)

    @guarded
    def engine() -> None:  # the engine at work on the run: holds its row for a moment
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(LOCK_WORKFLOW_RUN, [community.id, run.pk])
            holding.set()
            assert release.wait(BARRIER_TIMEOUT)

    @guarded
    def accept() -> None:
        found["accept"] = accept_delivery(claim.lease)

    @guarded
    def force_fail() -> None:
        found["force_fail"] = core.force_fail_delivery(community.id, delivery.id, actor="operator:test")

    with ThreadPoolExecutor(max_workers=3) as pool:
        held = pool.submit(engine)
        assert holding.wait(BARRIER_TIMEOUT)
        accepted = pool.submit(accept)
        lock_waits_reach(1, 5.0)  # the accept waits for the run
        failed = pool.submit(force_fail)
        lock_waits_reach(2, 5.0)  # the force-fail deleted the queue row and waits for the run
        release.set()  # the accept takes the run, then waits for the queue row: the force-fail's
        held.result(BARRIER_TIMEOUT)
        accepted.result(BARRIER_TIMEOUT)
        failed.result(BARRIER_TIMEOUT)

    assert not errors, [str(e).splitlines()[0] for e in errors]
    # One of them wins: the force-fail (the accept's lease is lost), or the accept (the delivery
    # is no longer claimed when the force-fail runs).
    assert (found["force_fail"].done, type(found["accept"])) in ((True, LeaseLost), (False, Accepted))
