"""Regressions found by an adversarial review of the state machine, each reproduced first.

- the write fence under REPEATABLE READ (a snapshot older than the lifecycle move);
- lock_delivery_identity under REPEATABLE READ (a snapshot older than the lock);
- a generation moved backwards, or a binding/snapshot rewritten, by a stale ``save()`` or raw SQL;
- two producers committing the same identities in different orders (deadlock);
- a repeated ``retry`` settle by the same holder.
"""

from __future__ import annotations

import threading

import psycopg
import pytest
from django.db import connection, transaction

from buzz_delivery import services
from buzz_delivery.exceptions import DeliveryWriteRefused, NotInTransaction
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import DeliveryFactory, advance_to, random32
from tests.conftest import BARRIER_TIMEOUT


def _conninfo() -> str:
    db = connection.settings_dict
    return f"host={db['HOST']} port={db['PORT']} user={db['USER']} dbname={db['NAME']}"


@pytest.mark.django_db(transaction=True)
def test_a_repeatable_read_writer_whose_snapshot_predates_the_fence_is_refused(community, make_binding):
    delivery = DeliveryFactory(binding=make_binding())
    with psycopg.connect(_conninfo()) as writer:
        writer.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        writer.execute("SELECT 1 FROM buzz_delivery_delivery LIMIT 1")  # the snapshot is taken here
        advance_to(community, "quiescing")
        with pytest.raises((psycopg.errors.SerializationFailure, psycopg.errors.RaiseException)) as caught:
            writer.execute("UPDATE buzz_delivery_delivery_record SET attempt = attempt WHERE id = %s", [delivery.id])
        assert caught.value.sqlstate in ("40001", "BD001")
        writer.rollback()


@pytest.mark.django_db(transaction=True)
def test_lock_delivery_identity_refuses_repeatable_read(community, run):
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        with pytest.raises(NotInTransaction, match="READ COMMITTED"):
            services.lock_delivery_identity(community.id, run.id, "send_message")


@pytest.mark.django_db
def test_saving_a_delivery_instance_is_refused(make_binding):
    delivery = DeliveryFactory(binding=make_binding())
    with pytest.raises(DeliveryWriteRefused):
        delivery.save()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "assignment",
    [
        "lease_generation = lease_generation - 1",
        "step_id = 'other_step'",
        "target_pubkey = %(other)s",
        "execution_trace = '{}'::jsonb",
        "trigger_context = NULL",
    ],
)
def test_the_database_refuses_rewriting_history_of_a_delivery(make_binding, assignment):
    delivery = DeliveryFactory(binding=make_binding(), trigger_context={"a": 1})
    claim = services.claim_delivery(delivery.community_id, bytes(delivery.target_pubkey), lease_seconds=30)
    assert claim is not None and claim.lease.lease_generation == 1
    with pytest.raises(Exception) as caught, transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE buzz_delivery_delivery_record SET {assignment} WHERE id = %(id)s",
            {"id": delivery.id, "other": random32()},
        )
    assert getattr(caught.value.__cause__, "sqlstate", None) == "BD003"
    row = WorkflowAgentDelivery.objects.get(id=delivery.id)
    assert (row.lease_generation, row.step_id, row.trigger_context) == (1, delivery.step_id, {"a": 1})


@pytest.mark.django_db(transaction=True)
def test_producers_committing_the_same_identities_in_opposite_orders_do_not_deadlock(make_binding, message_event):
    bindings = [make_binding() for _ in range(400)]
    orders = [bindings, list(reversed(bindings))]
    results: dict[int, object] = {}
    barrier = threading.Barrier(2, timeout=BARRIER_TIMEOUT)

    def produce(i: int) -> None:
        try:
            barrier.wait()
            results[i] = len(services.commit_deliveries(message_event.community_id, message_event, orders[i]))
        except Exception as exc:  # recorded, asserted below
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results.values()) == [0, 400], results  # type: ignore[type-var]


@pytest.mark.django_db
def test_a_repeated_retry_by_the_same_holder_is_settled_again_not_lost(make_binding):
    delivery = DeliveryFactory(binding=make_binding())
    claim = services.claim_delivery(delivery.community_id, bytes(delivery.target_pubkey), lease_seconds=30)
    assert services.finish_delivery(claim.lease, "retry") == services.Settled("pending")
    assert services.finish_delivery(claim.lease, "retry") == services.Settled("pending")
    assert isinstance(services.finish_delivery(claim.lease, "finished"), services.LeaseLost)
