"""Maintenance and operator moves on the live queue (issue 31, stage 2): a move back to pending
updates the queue row alone (slots cleared); every terminal deletes the queue row and writes its
final state on the record; a requeue gives the record a queue row again; the pruner touches
terminal records only."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection
from django.test import override_settings

from buzz_delivery import models, services
from buzz_delivery.services import runs, sql
from buzz_delivery.testing import (
    BindingFactory,
    CommunityFactory,
    EventFactory,
    WorkflowRunFactory,
    random32,
    set_delivery_state,
)
from tests.conftest import backdate_lease

pytestmark = pytest.mark.django_db


def commit(community, n: int, max_attempts: int | None = None):
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    target = random32()
    bindings = [BindingFactory(run=run, message_event=event, target_pubkey=target) for _ in range(n)]
    services.commit_deliveries(community.id, event, bindings)
    if max_attempts is not None:
        for delivery in models.DeliveryQueue.objects.filter(community=community).values_list("id", flat=True):
            set_delivery_state(delivery, max_attempts=max_attempts)
    return run, target


def queue_row(delivery_id):
    return models.DeliveryQueue.objects.filter(id=delivery_id).first()


def record(delivery_id):
    return models.DeliveryRecord.objects.get(id=delivery_id)


def test_a_reap_back_to_pending_updates_the_queue_row_only_and_clears_its_slots(community):
    _, target = commit(community, 1)
    with override_settings(BUZZ_DELIVERY={"CONCURRENCY_LIMITS": {"target": 1}}):
        claim = services.claim_delivery(community.id, target, holder="w-1")
    assert queue_row(claim.lease.delivery_id).slot_target == 0
    backdate_lease(claim.lease.delivery_id)
    before = record(claim.lease.delivery_id)

    assert services.reap().reclaimed == 1

    row = queue_row(claim.lease.delivery_id)
    assert (row.status, row.lease_generation, row.lease_until, row.claimed_at) == ("pending", 2, None, None)
    assert (row.slot_community, row.slot_target, row.slot_workflow) == (None, None, None)
    assert row.history[-1]["event"] == "reap"
    after = record(claim.lease.delivery_id)
    assert (after.status, after.lease_generation, after.history) == ("pending", before.lease_generation, before.history)


@pytest.mark.parametrize("end", ["exhausted", "past_deadline"])
def test_a_reap_to_a_terminal_deletes_the_queue_row_and_writes_its_state_on_the_record(community, end):
    _, target = commit(community, 1, max_attempts=1)
    claim = services.claim_delivery(community.id, target, holder="w-1")
    delivery = claim.lease.delivery_id
    services.renew_delivery(claim.lease, lease_seconds=30)
    backdate_lease(delivery)
    if end == "past_deadline":
        set_delivery_state(delivery, expires_at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    live = queue_row(delivery)

    result = services.reap()

    assert (result.exhausted, result.expired) == ((1, 0) if end == "exhausted" else (0, 1))
    assert queue_row(delivery) is None
    row = record(delivery)
    status, code = ("failed", "attempts_exhausted") if end == "exhausted" else ("expired", "delivery_expired")
    assert (row.status, row.failure_code, row.lease_generation) == (status, code, live.lease_generation + 1)
    assert (row.attempt, row.claimed_by, row.renewals) == (live.attempt, "w-1", live.renewals) == (1, "w-1", 1)
    assert row.finished_at is not None
    assert (row.lease_until, row.claimed_at, row.next_attempt_at, row.slot_target) == (None, None, None, None)
    assert row.history[:-1] == live.history
    assert row.history[-1] | {"at": None} == {
        "event": "reap",
        "status": status,
        "generation": live.lease_generation + 1,
        "actor": "reaper",
        "renewals": 1,
        "at": None,
    }


def test_an_overdue_pending_delivery_expires_off_the_queue(community):
    commit(community, 1)
    (delivery,) = models.DeliveryQueue.objects.filter(community=community).values_list("id", flat=True)
    set_delivery_state(delivery, expires_at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))

    assert services.reap().expired == 1

    assert queue_row(delivery) is None
    row = record(delivery)
    assert (row.status, row.failure_code, row.lease_generation) == ("expired", "delivery_expired", 1)
    assert row.history[-1]["event"] == "expire"


def test_a_requeue_inserts_the_queue_row_and_a_force_fail_deletes_it(community):
    _, target = commit(community, 1, max_attempts=1)
    claim = services.claim_delivery(community.id, target, holder="w-1")
    delivery = claim.lease.delivery_id
    services.finish_delivery(claim.lease, "failed", failure_code="boom")
    assert queue_row(delivery) is None

    assert services.requeue_delivery(community.id, delivery, actor="operator:alice").done
    assert not services.requeue_delivery(community.id, delivery).done  # live again: nothing to requeue

    row, live = record(delivery), queue_row(delivery)
    assert (row.status, live.status, live.lease_generation, live.attempt) == ("pending", "pending", 2, 0)
    assert (live.history, live.expires_at, live.singleton_key) == (row.history, row.expires_at, None)
    assert (live.lease_until, live.claimed_at, live.slot_target) == (None, None, None)
    assert (row.requeues, row.history[-1]["event"]) == (1, "requeue")

    again = services.claim_delivery(community.id, target, holder="w-2")
    assert again.lease.lease_generation == 3
    assert services.force_fail_delivery(community.id, delivery, failure_message="stuck", actor="operator:bob").done
    assert not services.force_fail_delivery(community.id, delivery).done

    assert queue_row(delivery) is None
    row = record(delivery)
    assert (row.status, row.failure_code, row.failure_message) == ("failed", "operator_force_failed", "stuck")
    assert (row.lease_generation, row.attempt, row.claimed_by) == (4, 1, "w-2")
    assert [e["event"] for e in row.history[-2:]] == ["claim", "force_fail"]


def test_a_cancelled_runs_pending_deliveries_leave_the_queue_and_a_claimed_one_stays(community):
    run, target = commit(community, 3)
    claim = services.claim_delivery(community.id, target)

    assert runs.expire_run_deliveries(community.id, run.id, batch_size=1) == 2

    assert list(models.DeliveryQueue.objects.filter(community=community).values_list("id", flat=True)) == [
        claim.lease.delivery_id
    ]
    ended = models.DeliveryRecord.objects.filter(community=community, status="expired")
    assert sorted(ended.values_list("failure_code", "lease_generation")) == [("run_canceled", 0)] * 2


def test_the_pruner_leaves_live_deliveries_alone_even_beside_an_old_terminal_record(community):
    _, target = commit(community, 2)
    claim = services.claim_delivery(community.id, target)
    services.finish_delivery(claim.lease, "finished")
    old = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)  # a terminal's created_at precedes its finished_at
    set_delivery_state(claim.lease.delivery_id, created_at=old, finished_at=old)

    result = services.prune_deliveries({"finished": dt.timedelta(days=1)})

    assert result.deleted["finished"] == 1
    assert models.DeliveryQueue.objects.filter(community=community).count() == 1
    assert models.DeliveryRecord.objects.filter(community=community).count() == 1


def test_lapsed_leases_are_counted_on_the_queue(community):
    _, target = commit(community, 2)
    claim = services.claim_delivery(community.id, target)
    backdate_lease(claim.lease.delivery_id)
    with connection.cursor() as cursor:
        cursor.execute(sql.COUNT_LAPSED_LEASES)
        assert cursor.fetchone()[0] == 1


def test_a_record_out_of_step_in_one_community_never_stops_the_reap_of_the_others(community, caplog):
    """A queue row whose record is not pending (nothing in the schema refuses it: the foreign key
    only names the record; here a raw UPDATE) makes its terminal move raise RecordOutOfStep. The
    reap walks every community: that community's batch rolls back and is logged and left (as a
    busy one), and every other community is still reaped, in this run and the next."""
    _, broken_target = commit(community, 1, max_attempts=1)
    broken = services.claim_delivery(community.id, broken_target).lease.delivery_id
    backdate_lease(broken)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {sql.RECORD} SET status = 'failed', finished_at = now(), failure_code = 'x'"
            " WHERE community_id = %s AND id = %s",
            [community.id, broken],
        )
    healthy = CommunityFactory()
    _, target = commit(healthy, 1, max_attempts=1)
    delivery = services.claim_delivery(healthy.id, target).lease.delivery_id
    backdate_lease(delivery)

    result = services.reap()

    assert (result.exhausted, result.skipped_busy) == (1, 1)
    assert record(delivery).status == "failed" and queue_row(delivery) is None
    assert queue_row(broken).status == "claimed"  # its batch rolled back whole
    assert "out of step" in caplog.text and str(community.id) in caplog.text
    assert services.reap().skipped_busy == 1  # and the next run leaves it again, raising nothing


def test_the_pruner_skips_an_old_terminal_record_that_still_has_a_queue_row(community):
    """The pruner's ``NOT EXISTS`` on the queue (test_the_pruner_leaves_live_deliveries_alone...
    passes without it: a live record is pending, which the pruner never reads). A terminal record
    with a queue row is an invariant broken (a raw UPDATE here): deleting the record would cascade
    to its live row, so the pruner leaves both."""
    _, target = commit(community, 1)
    claim = services.claim_delivery(community.id, target)
    delivery = claim.lease.delivery_id
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {sql.RECORD} SET status = 'finished', finished_at = '2000-01-01', created_at = '2000-01-01'"
            " WHERE community_id = %s AND id = %s",
            [community.id, delivery],
        )

    assert services.prune_deliveries({"finished": dt.timedelta(days=1)}).total == 0

    assert queue_row(delivery).status == "claimed"
    assert record(delivery).status == "finished"


@pytest.mark.django_db(transaction=True)
def test_a_cancelled_runs_pending_deliveries_expire_even_while_a_claim_that_takes_none_holds_them():
    """A claim under a concurrency limit locks its candidates (FOR UPDATE SKIP LOCKED) and, with no
    free slot, claims none of them: they stay pending, locked until its transaction ends. The
    run's expiry skipped them (locked rows were taken to be "leaving pending anyway") and
    returned: the cancelled run's deliveries stayed pending for good, to be claimed later."""
    import threading

    from buzz_delivery.testing import CommunityFactory

    community = CommunityFactory()
    run, target = commit(community, 3)
    limits = override_settings(BUZZ_DELIVERY={"CONCURRENCY_LIMITS": {"workflow": 1}})
    locked, release = threading.Event(), threading.Event()
    found: dict[str, object] = {}

    def claimer() -> None:
        from django.db import transaction

        try:
            with transaction.atomic():
                found["claimed"] = services.claim_deliveries(community.id, target, limit=5)
                locked.set()
                assert release.wait(30)
        finally:
            connection.close()

    with limits:
        holder = services.claim_delivery(community.id, target)  # the workflow's one slot
        assert holder is not None
        thread = threading.Thread(target=claimer)
        thread.start()
        try:
            assert locked.wait(30)
            assert found["claimed"] == []  # no free slot: both candidates locked, left pending
            threading.Timer(0.3, release.set).start()  # the claim's transaction ends meanwhile
            expired = runs.expire_run_deliveries(community.id, run.id)
        finally:
            release.set()
            thread.join(30)

    assert expired == 2
    assert list(models.DeliveryQueue.objects.filter(community=community).values_list("id", flat=True)) == [
        holder.lease.delivery_id
    ]
