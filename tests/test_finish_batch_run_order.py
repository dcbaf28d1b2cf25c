"""services.finish_deliveries and services.settle_deliveries take their deliveries' runs in run id
order before they settle anything (issue 31): two workers settling deliveries of the same workflow
runs (one per target) deadlocked when their batches met the runs in different orders, because the
workflow engine counts each delivery under its run's lock in the order the batch UPDATE meets the
rows."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction
from django.db.utils import OperationalError

from buzz_delivery import services
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.services.types import Settle
from buzz_delivery.testing import BindingFactory, EventFactory, WorkflowRunFactory, random32
from tests.citus_support import waits_for_a_row_lock

pytestmark = pytest.mark.django_db(transaction=True)

LOCK_RUN = """
SELECT 1 FROM buzz_delivery_workflow_run WHERE community_id = %s AND id = %s FOR NO KEY UPDATE{}
"""


def _lock_run(community_id, run_id, nowait: bool = False) -> None:
    with connection.cursor() as cursor:
        cursor.execute(LOCK_RUN.format(" NOWAIT" if nowait else ""), [community_id, run_id])


def _two_runs_claimed(community):
    """Two runs (in run id order), each with one claimed delivery of one target: their claims by
    run id."""
    runs = sorted((WorkflowRunFactory(community=community) for _ in range(2)), key=lambda r: r.id)
    event = EventFactory(community=community)
    target = random32()
    for run in runs:
        services.commit_deliveries(
            community.id, event, [BindingFactory(run=run, message_event=event, target_pubkey=target)]
        )
    claims = {c.delivery.run_id: c for c in services.claim_deliveries(community.id, target, limit=2, lease_seconds=60)}
    return runs, claims


def _settles_after_locking_in_run_order(community, runs, settle, statement_like: str) -> list[object]:
    """Run ``settle`` (a batch listing the later run's delivery first) while another transaction
    holds the later run: it must wait on that run while it already holds the earlier one, having
    settled nothing; returns its outcomes once the holder lets go."""
    first, second = runs
    held, release = threading.Event(), threading.Event()
    pid: list[int] = []
    outcomes: list[object] = []

    def holder():  # another settle, holding the later run
        try:
            with transaction.atomic():
                _lock_run(community.id, second.id)
                held.set()
                release.wait(60)
        finally:
            connections.close_all()

    def settler():
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                pid.append(cursor.fetchone()[0])
            outcomes.extend(settle())
        except BaseException as exc:
            outcomes.append(exc)
        finally:
            connections.close_all()

    h = threading.Thread(target=holder)
    h.start()
    assert held.wait(60)
    s = threading.Thread(target=settler)
    s.start()
    try:
        while not pid:
            time.sleep(0.001)
        waited = False
        while not waited and s.is_alive():
            waited = waits_for_a_row_lock(pid[0], statement_like)
        assert waited, f"the batch settled without taking the later run's row: {outcomes}"
        # It holds the earlier run already, and has settled nothing.
        with pytest.raises(OperationalError), transaction.atomic():
            _lock_run(community.id, first.id, nowait=True)
        statuses = WorkflowAgentDelivery.objects.filter(community_id=community.id).values_list("status", flat=True)
        assert sorted(statuses) == ["claimed", "claimed"]
    finally:
        release.set()
        h.join(60)
        s.join(60)
    return outcomes


def test_a_batch_locks_its_runs_in_run_order_before_it_settles_anything(community):
    runs, claims = _two_runs_claimed(community)
    first, second = runs
    # The batch lists the later run first: the order of the locks is the runs', not the list's.
    leases = [claims[second.id].lease, claims[first.id].lease]
    outcomes = _settles_after_locking_in_run_order(
        community, runs, lambda: services.finish_deliveries(leases), "%finish_leases%"
    )
    assert outcomes == [services.Settled("finished")] * 2


def test_a_mixed_batch_locks_its_runs_in_run_order_before_it_settles_anything(community):
    """The same for settle_deliveries with rows of their own outcomes (the in-process worker's
    settler and the gateway's batch finish): a failed row of the later run listed first, then a
    retry of the earlier run."""
    runs, claims = _two_runs_claimed(community)
    first, second = runs
    settles = [
        Settle(claims[second.id].lease, "failed", failure_code="boom", failure_message="it broke"),
        Settle(claims[first.id].lease, "retry", failure_message="again", retry_after=5.0),
    ]
    outcomes = _settles_after_locking_in_run_order(
        community, runs, lambda: services.settle_deliveries(settles), "%settle_leases%"
    )
    assert outcomes == [services.Settled("failed"), services.Settled("pending")]


def test_a_batch_of_one_run_does_not_lock_its_run(community):
    """A batch whose deliveries are all of one run cannot close a cycle, so it takes no lock of the
    run's row: K workers settling one producer's backlog are not serialized on it."""
    run, event, target = WorkflowRunFactory(community=community), EventFactory(community=community), random32()
    services.commit_deliveries(
        community.id, event, [BindingFactory(run=run, message_event=event, target_pubkey=target) for _ in range(3)]
    )
    leases = [c.lease for c in services.claim_deliveries(community.id, target, limit=3, lease_seconds=60)]
    held, release = threading.Event(), threading.Event()

    def holder():  # another transaction holding the run's row as the ordered lock would
        try:
            with transaction.atomic():
                _lock_run(community.id, run.id)
                held.set()
                release.wait(60)
        finally:
            connections.close_all()

    h = threading.Thread(target=holder)
    h.start()
    try:
        assert held.wait(60)
        with connection.cursor() as cursor:  # a wait would fail fast instead of settling
            cursor.execute("SET lock_timeout = '2s'")
        try:
            assert services.finish_deliveries(leases) == [services.Settled("finished")] * 3
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
    finally:
        release.set()
        h.join(60)
