"""renew_delivery and finish_delivery (SPEC sections 4.4, 4.5 and 9): generation fencing,
the database clock, settle-once and the idempotent retry of the true holder."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid

import pytest
from django.db import connection

from buzz_delivery import models, services
from buzz_delivery.services import AlreadyTerminal, Lease, LeaseLost, Renewed, Settled
from buzz_delivery.testing import frozen_db_clock, random32
from tests.conftest import backdate_lease, db_clock

pytestmark = pytest.mark.django_db


def db_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def stored(lease: Lease) -> models.WorkflowAgentDelivery:
    return models.WorkflowAgentDelivery.objects.get(id=lease.delivery_id)


@pytest.fixture
def claimed(community, message_event, make_binding):
    """Commit one delivery and return a function that claims it (its current lease)."""
    binding = make_binding()
    (delivery_id,) = services.commit_deliveries(community.id, message_event, [binding])

    def claim() -> Lease:
        won = services.claim_delivery(community.id, binding.target_pubkey, delivery_id=delivery_id)
        assert won is not None
        return won.lease

    return claim


def lose_to_reaper(lease: Lease) -> None:
    backdate_lease(lease.delivery_id)
    assert services.reap_expired_deliveries() == 1


@pytest.fixture
def third_generation_lease(claimed) -> Lease:
    """A current lease at generation 3 (claim, reap, claim), so generation - 1 is a valid token."""
    lose_to_reaper(claimed())
    lease = claimed()
    assert lease.lease_generation == 3
    return lease


@pytest.mark.parametrize("offset", [-1, +1])
def test_a_renew_with_another_generation_is_lease_lost(third_generation_lease, offset):
    lease = third_generation_lease
    before = stored(lease).lease_until
    forged = dataclasses.replace(lease, lease_generation=lease.lease_generation + offset)

    assert isinstance(services.renew_delivery(forged, lease_seconds=120), LeaseLost)

    assert stored(lease).lease_until == before
    assert isinstance(services.renew_delivery(lease, lease_seconds=120), Renewed)


@pytest.mark.parametrize("offset", [-1, +1])
@pytest.mark.parametrize("outcome", ["finished", "failed"])
def test_a_finish_with_another_generation_is_lease_lost_and_changes_nothing(third_generation_lease, offset, outcome):
    lease = third_generation_lease
    forged = dataclasses.replace(lease, lease_generation=lease.lease_generation + offset)

    assert services.finish_delivery(forged, outcome) == LeaseLost()

    row = stored(lease)
    assert (row.status, row.lease_generation, row.finished_at) == ("claimed", 3, None)
    assert services.finish_delivery(lease, outcome) == Settled(status=outcome)


@pytest.mark.parametrize("field", ["community_id", "target_pubkey"])
def test_a_lease_naming_another_community_or_target_is_lease_lost(claimed, field):
    lease = claimed()
    forged = dataclasses.replace(lease, **{field: uuid.uuid4() if field == "community_id" else random32()})

    assert services.renew_delivery(forged) == LeaseLost()
    assert services.finish_delivery(forged, "finished") == LeaseLost()
    assert stored(lease).status == "claimed"


def test_a_renew_extends_the_lease_from_the_database_clock_and_keeps_the_generation(claimed):
    lease = claimed()
    before = db_clock()

    renewed = services.renew_delivery(lease, lease_seconds=250)

    after = db_clock()
    assert isinstance(renewed, Renewed)
    assert before + dt.timedelta(seconds=250) <= renewed.lease_until <= after + dt.timedelta(seconds=250)
    assert renewed.lease == dataclasses.replace(lease, lease_until=renewed.lease_until)
    row = stored(lease)
    assert row.lease_until == renewed.lease_until
    assert row.lease_generation == lease.lease_generation == 1
    assert row.attempt == 1


def test_repeated_renews_never_bump_the_generation(claimed):
    lease = claimed()

    for seconds in (20, 300, 15, 60):
        outcome = services.renew_delivery(lease, lease_seconds=seconds)
        assert isinstance(outcome, Renewed)
        assert outcome.lease.lease_generation == 1
        lease = outcome.lease

    assert stored(lease).lease_generation == 1
    assert services.finish_delivery(lease, "finished") == Settled(status="finished")


def test_a_renew_may_shorten_the_lease(claimed):
    lease = claimed()
    services.renew_delivery(lease, lease_seconds=300)
    before = db_clock()

    shortened = services.renew_delivery(lease, lease_seconds=15).lease_until

    assert before + dt.timedelta(seconds=15) <= shortened <= db_clock() + dt.timedelta(seconds=15)


def test_an_expired_but_unreaped_lease_can_neither_renew_nor_finish(claimed):
    lease = claimed()
    backdate_lease(lease.delivery_id, seconds=1)

    assert services.renew_delivery(lease) == LeaseLost()
    assert services.finish_delivery(lease, "finished") == LeaseLost()
    assert services.finish_delivery(lease, "failed") == LeaseLost()

    row = stored(lease)
    assert (row.status, row.lease_generation, row.finished_at) == ("claimed", 1, None)


def test_a_lease_ending_exactly_at_the_database_now_is_still_current(claimed):
    lease = claimed()
    with frozen_db_clock():  # two statements share a clock only when it stands still
        backdate_lease(lease.delivery_id, seconds=0)  # lease_until = now()

        assert isinstance(services.renew_delivery(lease), Renewed)
        backdate_lease(lease.delivery_id, seconds=0)
        assert services.finish_delivery(lease, "finished") == Settled(status="finished")


def test_the_reaper_fences_the_prior_holder_and_every_new_claim_bumps_the_generation_again(claimed):
    first = claimed()
    assert first.lease_generation == 1
    lose_to_reaper(first)
    row = stored(first)
    assert (row.status, row.lease_generation, row.lease_until, row.claimed_at) == ("pending", 2, None, None)

    assert services.renew_delivery(first) == LeaseLost()
    assert services.finish_delivery(first, "finished") == LeaseLost()

    second = claimed()
    assert second.lease_generation == first.lease_generation + 2
    lose_to_reaper(second)
    third = claimed()
    assert third.lease_generation == first.lease_generation + 4
    assert stored(third).attempt == 3

    for stale in (first, second):
        assert services.renew_delivery(stale) == LeaseLost()
        assert services.finish_delivery(stale, "failed") == LeaseLost()
    assert services.finish_delivery(third, "finished") == Settled(status="finished")


@pytest.mark.parametrize(("first", "second"), [("finished", "failed"), ("failed", "finished")])
def test_a_settled_delivery_is_terminal_once_and_the_holders_retry_gets_the_recorded_status(claimed, first, second):
    lease = claimed()
    assert services.finish_delivery(lease, first) == Settled(status=first)
    settled_row = stored(lease)

    assert services.finish_delivery(lease, first) == AlreadyTerminal(status=first)
    assert services.finish_delivery(lease, second) == AlreadyTerminal(status=first)
    assert services.renew_delivery(lease) == LeaseLost()

    row = stored(lease)
    assert row.status == first
    assert row.finished_at == settled_row.finished_at
    assert row.lease_generation == 1
    assert (row.lease_until, row.claimed_at) == (None, None)


def test_a_failed_finish_records_its_failure_code_and_message(claimed):
    lease = claimed()

    outcome = services.finish_delivery(
        lease, "failed", failure_code="handler_crashed", failure_message="ValueError: boom"
    )

    assert outcome == Settled(status="failed")
    row = stored(lease)
    assert (row.status, row.failure_code, row.failure_message) == ("failed", "handler_crashed", "ValueError: boom")
    assert db_now() <= row.finished_at <= db_clock()  # the settle statement's database clock
    # The idempotent retry does not overwrite what was recorded.
    assert services.finish_delivery(lease, "failed", failure_code="other") == AlreadyTerminal(status="failed")
    assert stored(lease).failure_code == "handler_crashed"


def test_a_finished_delivery_records_no_failure(claimed):
    lease = claimed()

    services.finish_delivery(lease, "finished")

    row = stored(lease)
    assert (row.status, row.failure_code, row.failure_message) == ("finished", None, None)


@pytest.mark.parametrize("newer_outcome", ["finished", "failed"])
@pytest.mark.parametrize("stale_outcome", ["finished", "failed"])
def test_a_stale_holder_finishing_after_a_newer_holder_settled_gets_lease_lost_never_already_terminal(
    claimed, newer_outcome, stale_outcome
):
    stale = claimed()
    lose_to_reaper(stale)
    newer = claimed()
    assert services.finish_delivery(newer, newer_outcome) == Settled(status=newer_outcome)

    assert services.finish_delivery(stale, stale_outcome) == LeaseLost()
    assert services.finish_delivery(newer, stale_outcome) == AlreadyTerminal(status=newer_outcome)
    assert stored(newer).status == newer_outcome


def test_a_lease_rebuilt_from_its_fields_settles_the_delivery(claimed):
    lease = claimed()
    rebuilt = Lease(
        community_id=str(lease.community_id),
        delivery_id=str(lease.delivery_id),
        target_pubkey=bytearray(lease.target_pubkey),
        lease_generation=lease.lease_generation,
        lease_until=lease.lease_until,
    )

    assert rebuilt == lease
    assert services.finish_delivery(rebuilt, "finished") == Settled(status="finished")


def test_renew_and_finish_each_run_one_statement_on_the_hot_path(claimed, django_assert_num_queries):
    lease = claimed()

    with django_assert_num_queries(1):
        assert isinstance(services.renew_delivery(lease), Renewed)
    with django_assert_num_queries(1):
        assert services.finish_delivery(lease, "finished") == Settled(status="finished")
