"""The settle tally (core migration 0039, issue 31): every statement that moves records from a live
status to a terminal one writes one row per (community, status) with ``n`` the records it moved,
through the record's AFTER UPDATE statement trigger; every terminal path counts exactly once, in the
tally and in ``buzz_deliveries_settled_last_minute``; moves that reach no terminal write nothing.
The record's terminal UPDATE is a HOT update (no index names what it writes); the pruner deletes the
tally's rows past what its readers count, the purge a community's."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection, transaction
from django.test import override_settings

from buzz_delivery import models, services
from buzz_delivery.admin.dashboard import SETTLED_PER_MINUTE
from buzz_delivery.services import runs, singleton
from buzz_delivery.testing import DeliveryFactory, advance_to, random32, set_delivery_state
from tests.conftest import backdate_lease
from tests.operator_support import claimed, pending
from tests.test_metrics import scrape

pytestmark = pytest.mark.django_db

TALLY = models.SETTLE_TALLY_TABLE
RECORD = models.DELIVERY_RECORD_TABLE
ONE_ATTEMPT = override_settings(BUZZ_DELIVERY={"MAX_ATTEMPTS": 1})


def tally(community: models.Community) -> list[tuple[str, int]]:
    """The community's tally rows, (status, n), oldest first."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT status, n FROM {TALLY} WHERE community_id = %s ORDER BY at, status", [community.id])
        return cursor.fetchall()


def settled_last_minute() -> dict[str, float]:
    return {dict(labels)["status"]: v for labels, v in scrape()["buzz_deliveries_settled_last_minute"].items()}


def counted_once(community: models.Community, status: str, n: int = 1) -> None:
    assert tally(community) == [(status, n)]
    assert settled_last_minute()[status] == n


def test_a_batch_finish_writes_one_row_for_its_statement(community, make_binding):
    target = random32()
    for _ in range(4):
        DeliveryFactory(binding=make_binding(target_pubkey=target))
    claims = services.claim_deliveries(community.id, target, limit=4, lease_seconds=30)
    outcomes = services.finish_deliveries([c.lease for c in claims])
    assert all(isinstance(o, services.Settled) for o in outcomes)
    counted_once(community, "finished", 4)


def test_a_mixed_batch_settle_writes_one_row_per_status_and_a_retry_counts_nothing(community, make_binding):
    target = random32()
    for _ in range(4):
        DeliveryFactory(binding=make_binding(target_pubkey=target))
    leases = [c.lease for c in services.claim_deliveries(community.id, target, limit=4, lease_seconds=30)]
    outcomes = services.settle_deliveries(
        [
            services.Settle(leases[0], "finished"),
            services.Settle(leases[1], "finished"),
            services.Settle(leases[2], "failed", failure_code="bad"),
            services.Settle(leases[3], "retry"),
        ]
    )
    assert all(isinstance(o, services.Settled) for o in outcomes)
    assert sorted(tally(community)) == [("failed", 1), ("finished", 2)]
    assert settled_last_minute() == {"finished": 2, "failed": 1, "expired": 0}


@pytest.mark.parametrize("outcome", ["finished", "failed"])
def test_a_single_finish_or_fail_counts_once(community, outcome):
    _, lease = claimed(community)
    assert isinstance(services.finish_delivery(lease, outcome), services.Settled)
    counted_once(community, outcome)


def test_a_retry_to_pending_counts_nothing_and_one_that_exhausts_counts_failed(community):
    _, lease = claimed(community)
    assert isinstance(services.finish_delivery(lease, "retry"), services.Settled)
    assert tally(community) == []
    with ONE_ATTEMPT:
        _, last = claimed(community)
    assert isinstance(services.finish_delivery(last, "retry"), services.Settled)
    counted_once(community, "failed")


def test_a_stale_settle_returns_nothing_and_writes_no_row(community):
    delivery, lease = claimed(community)
    backdate_lease(delivery.pk)
    services.reap()  # back to pending, generation + 1: the lease is fenced
    assert isinstance(services.finish_delivery(lease, "finished"), services.LeaseLost)
    assert all(isinstance(o, services.LeaseLost) for o in services.finish_deliveries([lease]))
    assert tally(community) == []


def test_the_reapers_exhaustion_and_ttl_expiry_count_once_each(community):
    with ONE_ATTEMPT:
        exhausted, _ = claimed(community)
    backdate_lease(exhausted.pk)
    overdue = pending(community)
    set_delivery_state(overdue.pk, expires_at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    services.reap()
    assert sorted(tally(community)) == [("expired", 1), ("failed", 1)]
    assert settled_last_minute() == {"finished": 0, "failed": 1, "expired": 1}


def test_run_expiry_counts_its_deliveries_once(community, run, make_binding):
    for _ in range(3):
        DeliveryFactory(binding=make_binding())
    assert runs.expire_run_deliveries(community.id, run.id) == 3
    counted_once(community, "expired", 3)


def test_force_fail_counts_once_and_a_requeue_counts_nothing_new(community):
    delivery, _ = claimed(community)
    assert services.force_fail_delivery(community.id, delivery.pk, failure_message="x").done
    counted_once(community, "failed")
    assert services.requeue_delivery(community.id, delivery.pk).done
    counted_once(community, "failed")


def test_a_singleton_supersede_counts_the_holder_expired(community, message_event, make_binding):
    target = random32()
    services.commit_deliveries(community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="k")
    result = services.commit_deliveries(
        community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="k", on_conflict="replace"
    )
    assert isinstance(result.outcomes[0], singleton.Replaced)
    counted_once(community, "expired")


def test_the_record_is_at_the_models_fillfactor():
    """Migration 0039 writes the fillfactor as a literal: the model's constant says the same."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", [RECORD])
        assert cursor.fetchone() == ([f"fillfactor={models.DELIVERY_RECORD_FILLFACTOR}"],)


def test_the_terminal_update_of_the_record_is_hot(community, make_binding):
    target = random32()
    for _ in range(20):
        DeliveryFactory(binding=make_binding(target_pubkey=target))
    counters = "SELECT pg_stat_get_xact_tuples_updated(%s::regclass), pg_stat_get_xact_tuples_hot_updated(%s::regclass)"
    with transaction.atomic(), connection.cursor() as cursor:
        leases = [c.lease for c in services.claim_deliveries(community.id, target, limit=20, lease_seconds=30)]
        cursor.execute(counters, [RECORD, RECORD])
        before = cursor.fetchone()
        assert all(isinstance(o, services.Settled) for o in services.finish_deliveries(leases))
        cursor.execute(counters, [RECORD, RECORD])
        after = cursor.fetchone()
    # Every one of the 20 terminal versions written on its page, no index entry (was 0 of 20).
    assert (after[0] - before[0], after[1] - before[1]) == (20, 20)


def test_a_tally_row_dated_ahead_is_not_counted(community):
    """The readers bound the window above: a row dated past the database clock (a tenant role may
    write its community's rows) would otherwise be counted for good, the pruner never reaching it."""
    _, lease = claimed(community)
    services.finish_delivery(lease, "finished")
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {TALLY} (id, community_id, at, status, n)"
            " VALUES (gen_random_uuid(), %s, 'infinity', 'finished', 1000)",
            [community.id],
        )
    assert settled_last_minute()["finished"] == 1
    with connection.cursor() as cursor:  # the dashboard's chart of the last hour
        cursor.execute(SETTLED_PER_MINUTE)
        assert [(status, n) for _, status, n in cursor.fetchall()] == [("finished", 1)]


def test_the_pruner_deletes_tally_rows_past_the_readers_window_only(community):
    _, lease = claimed(community)
    services.finish_delivery(lease, "finished")
    _, lease = claimed(community)
    services.finish_delivery(lease, "failed")
    keep = models.SETTLE_TALLY_KEEP.total_seconds()
    with connection.cursor() as cursor:  # the failure was tallied just past the window
        cursor.execute(
            f"UPDATE {TALLY} SET at = buzz_delivery_plus_seconds(at, -%s)"
            " WHERE community_id = %s AND status = 'failed'",
            [keep + 60, community.id],
        )
    result = services.prune_deliveries({"finished": dt.timedelta(days=1)})
    assert (result.total, result.tally) == (0, 1)
    assert tally(community) == [("finished", 1)]


def test_the_purge_deletes_the_communitys_tally_rows(community):
    _, lease = claimed(community)
    services.finish_delivery(lease, "finished")
    other = models.Community.objects.create(name="bystander")
    _, lease = claimed(other)
    services.finish_delivery(lease, "finished")
    advance_to(community, "fenced")
    purged = services.purge_community(community.id)
    assert purged.deleted["buzz_delivery.SettleTally"] == 1
    assert tally(community) == []
    assert tally(other) == [("finished", 1)]
