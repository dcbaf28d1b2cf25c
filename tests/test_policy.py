"""Delivery policy (SPEC section 6): retry backoff, attempt limits, TTL, and the claim's
bounds and index under load. Time passing is simulated by moving columns with raw SQL."""

from __future__ import annotations

import datetime as dt
import re
import threading
import uuid

import pytest
from django.db import connection, connections
from django.test import override_settings

from buzz_delivery import models, services
from buzz_delivery.services import Claim, Settled, cached, sql
from buzz_delivery.testing import (
    BindingFactory,
    DeliveryFactory,
    Expr,
    backdate,
    insert_delivery_rows,
    random32,
    set_delivery_state,
)
from tests.conftest import backdate_lease, db_clock
from tests.plan_support import generic_explain

pytestmark = pytest.mark.django_db

DELIVERY = models.DeliveryRecord._meta.db_table


def db_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def execute(statement: str, params: list) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


def unblock_retry(delivery_id: uuid.UUID) -> None:
    """Stand-in for the backoff passing."""
    backdate(delivery_id, next_attempt_at=1)


def row(delivery_id: uuid.UUID) -> models.WorkflowAgentDelivery:
    return models.WorkflowAgentDelivery.objects.get(id=delivery_id)


@pytest.fixture
def target() -> bytes:
    return random32()


@pytest.fixture
def commit_one(make_binding, target):
    """Commit one delivery for ``target`` (keyword arguments go to commit_deliveries)."""

    def commit(**kwargs) -> uuid.UUID:
        return DeliveryFactory(binding=make_binding(target_pubkey=target), **kwargs).id

    return commit


def claim(community, target, **kwargs) -> Claim | None:
    return services.claim_delivery(community.id, target, **kwargs)


# --- retry and backoff ---------------------------------------------------------------------


def test_a_retried_delivery_is_not_claimable_before_its_next_attempt_and_is_after(community, target, commit_one):
    delivery_id = commit_one()
    first = claim(community, target)
    assert services.finish_delivery(first.lease, "retry") == Settled("pending")
    assert row(delivery_id).next_attempt_at > db_now()

    assert claim(community, target) is None
    unblock_retry(delivery_id)
    second = claim(community, target)

    assert second is not None and second.lease.delivery_id == delivery_id
    assert (second.lease.lease_generation, second.delivery.attempt) == (2, 2)
    assert row(delivery_id).next_attempt_at is None


@override_settings(
    BUZZ_DELIVERY={"RETRY_BACKOFF_BASE_SECONDS": 2, "RETRY_BACKOFF_CAP_SECONDS": 10, "MAX_ATTEMPTS": None}
)
def test_the_retry_backoff_doubles_with_each_attempt_up_to_the_cap(community, target, commit_one):
    delivery_id = commit_one()
    backoffs = []
    for _ in range(6):
        lease = claim(community, target).lease
        before = db_clock()
        assert services.finish_delivery(lease, "retry") == Settled("pending")
        after = db_clock()
        waits = row(delivery_id).next_attempt_at - before, row(delivery_id).next_attempt_at - after
        # The retry statement's clock lies between the two readings; the delay itself is the
        # doubled, capped backoff with equal jitter: within [1/2, 1] of it (buzz_delivery.backoff).
        backoffs.append((waits[1].total_seconds(), waits[0].total_seconds()))
        unblock_retry(delivery_id)
    for (low, high), expected in zip(backoffs, [2, 4, 8, 10, 10, 10], strict=True):
        assert expected / 2 <= high and low <= expected, (backoffs, expected)


# --- attempt limits ------------------------------------------------------------------------


def test_a_lease_lapsing_on_the_last_allowed_attempt_fails_the_delivery_at_the_next_reap(community, target, commit_one):
    delivery_id = commit_one()  # MAX_ATTEMPTS defaults to 3
    assert row(delivery_id).max_attempts == 3
    results = []
    for _ in range(3):
        lease = claim(community, target).lease
        backdate_lease(lease.delivery_id)
        results.append(services.reap())

    assert [(r.reclaimed, r.exhausted) for r in results] == [(1, 0), (1, 0), (0, 1)]
    ended = row(delivery_id)
    assert (ended.status, ended.failure_code, ended.attempt) == ("failed", "attempts_exhausted", 3)
    assert ended.finished_at is not None and ended.lease_generation == 6
    assert claim(community, target) is None


def test_a_retry_on_the_last_allowed_attempt_fails_the_delivery_with_its_message(community, target, commit_one):
    delivery_id = commit_one()
    for _ in range(2):
        assert services.finish_delivery(claim(community, target).lease, "retry") == Settled("pending")
        unblock_retry(delivery_id)
    last = claim(community, target)
    assert last.delivery.attempt == 3

    assert services.finish_delivery(last.lease, "retry", failure_message="upstream down") == Settled("failed")
    ended = row(delivery_id)
    assert (ended.status, ended.failure_code, ended.failure_message) == (
        "failed", "attempts_exhausted", "upstream down",
    )  # fmt: skip
    assert ended.next_attempt_at is None and ended.finished_at is not None
    assert services.finish_delivery(last.lease, "retry") == services.AlreadyTerminal("failed")


@override_settings(BUZZ_DELIVERY={"MAX_ATTEMPTS": None})
def test_without_max_attempts_a_delivery_is_retried_and_reclaimed_without_limit(community, target, commit_one):
    delivery_id = commit_one()
    assert row(delivery_id).max_attempts is None
    for _ in range(4):
        backdate_lease(claim(community, target).lease.delivery_id)
        assert services.reap().reclaimed == 1
    for _ in range(4):
        assert services.finish_delivery(claim(community, target).lease, "retry") == Settled("pending")
        unblock_retry(delivery_id)

    assert (row(delivery_id).status, row(delivery_id).attempt) == ("pending", 8)
    assert claim(community, target) is not None


def test_max_attempts_is_fixed_on_each_delivery_when_it_is_committed(community, target, commit_one):
    with override_settings(BUZZ_DELIVERY={"MAX_ATTEMPTS": 1}):
        once = commit_one()
    delivery_id = commit_one()  # default 3
    assert (row(once).max_attempts, row(delivery_id).max_attempts) == (1, 3)

    assert services.finish_delivery(claim(community, target, delivery_id=once).lease, "retry") == Settled("failed")


# --- TTL -------------------------------------------------------------------------------------


def test_a_pending_delivery_past_its_deadline_is_not_claimed_and_expires_at_the_next_reap(
    community, target, commit_one
):
    delivery_id = commit_one(expires_at=db_now() + dt.timedelta(hours=1))
    backdate(delivery_id, expires_at=1)

    assert claim(community, target) is None
    result = services.reap()

    assert (result.expired, result.reclaimed) == (1, 0)
    ended = row(delivery_id)
    assert (ended.status, ended.failure_code, ended.lease_generation) == ("expired", "delivery_expired", 1)
    assert ended.finished_at is not None


def test_a_lapsed_lease_past_the_deadline_expires_instead_of_returning_to_pending(community, target, commit_one):
    delivery_id = commit_one(expires_at=db_now() + dt.timedelta(hours=1))
    lease = claim(community, target).lease
    backdate_lease(delivery_id)
    backdate(delivery_id, expires_at=1)

    result = services.reap()

    assert (result.expired, result.reclaimed, result.exhausted) == (1, 0, 0)
    ended = row(delivery_id)
    assert (ended.status, ended.failure_code, ended.lease_generation) == ("expired", "delivery_expired", 2)
    assert isinstance(services.finish_delivery(lease, "finished"), services.LeaseLost)


@pytest.mark.django_db(transaction=True)  # now() must move: no test-wide transaction
def test_a_delivery_committed_to_expire_soon_expires_once_the_deadline_passes(community, target, commit_one):
    delivery_id = commit_one(expires_at=db_now() + dt.timedelta(seconds=0.3))
    assert services.reap().expired == 0
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_sleep(0.4)")
    assert services.reap().expired == 1
    assert row(delivery_id).status == "expired"


def test_a_claim_or_renew_never_grants_a_lease_past_the_deadline(community, target, commit_one):
    deadline = db_now() + dt.timedelta(seconds=20)
    delivery_id = commit_one(expires_at=deadline)

    won = claim(community, target, lease_seconds=60)
    renewed = services.renew_delivery(won.lease, 120)

    assert won.lease.lease_until == deadline == row(delivery_id).lease_until
    assert renewed.lease_until == deadline
    assert row(delivery_id).lease_until == deadline


def test_a_lease_shorter_than_the_time_left_is_not_cut(community, target, commit_one):
    delivery_id = commit_one(expires_at=db_now() + dt.timedelta(hours=1))
    before = db_now()
    won = claim(community, target, lease_seconds=30)
    assert won.lease.lease_until < row(delivery_id).expires_at
    assert won.lease.lease_until >= before + dt.timedelta(seconds=30)


# --- claim bounds and index ---------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_concurrent_batch_claims_never_exceed_their_limit_nor_share_a_row_and_take_the_oldest(
    community, run, message_event, target
):
    bindings = [BindingFactory(run=run, message_event=message_event, target_pubkey=target) for _ in range(60)]
    created = services.commit_deliveries(community.id, message_event, bindings)
    oldest_first = sorted(created)  # one commit: one created_at, so the claim order is the id order
    threads, limit = 8, 4
    barrier = threading.Barrier(threads, timeout=20)
    round_done = threading.Barrier(threads, timeout=20)
    first_round: list[list[uuid.UUID]] = [[] for _ in range(threads)]
    batches: list[list[uuid.UUID]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []

    def claimer(i: int) -> None:
        try:
            barrier.wait()
            first = services.claim_deliveries(community.id, target, limit=limit)
            first_round[i] = [c.lease.delivery_id for c in first]
            round_done.wait()  # the first round is 8 claims at once; then free-for-all
            batch = first
            while batch:
                batches[i].append([c.lease.delivery_id for c in batch])
                batch = services.claim_deliveries(community.id, target, limit=limit)
        except Exception as exc:
            errors.append(exc)
            barrier.abort()  # release the other claimers instead of leaving them waiting
            round_done.abort()
        finally:
            connections.close_all()

    workers = [threading.Thread(target=claimer, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors

    all_batches = [b for per_thread in batches for b in per_thread]
    assert all(1 <= len(b) <= limit for b in all_batches)
    claimed = [i for b in all_batches for i in b]
    assert len(claimed) == len(set(claimed)) == 60
    assert sorted(i for ids in first_round for i in ids) == oldest_first[: threads * limit]
    assert all(b == sorted(b) for b in all_batches)
    assert set(
        models.WorkflowAgentDelivery.objects.filter(id__in=claimed).values_list("lease_generation", flat=True)
    ) == {1}


def test_the_claim_query_cannot_scan_the_oldest_pending_age_index_nor_the_admins_age_index(
    community, target, commit_one
):
    # The metrics' index holds every pending row fleet-wide: with few pending rows in the
    # statistics the planner chose it for the claim (scan them all, then sort) over the polling
    # index (a CI run). Its predicate now says what the claim's WHERE does not imply. Without the
    # polling index (dropped in this test's transaction) the claim must still not fall back to it.
    commit_one()
    execute(f"ANALYZE {DELIVERY}", [])
    execute(f"ANALYZE {sql.QUEUE}", [])
    execute("DROP INDEX delivery_queue_poll_idx", [])  # issue 31, stage 2: the claim reads the queue
    params = {"community_id": community.id, "target_pubkey": target, "limit": 1, "lease_seconds": 60.0,
              "delivery_id": None, "holder": None}  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("EXPLAIN " + sql.claim_oldest_pending(by_id=False, by_binding=False), params)
        plan = "\n".join(line for (line,) in cursor.fetchall())

    # The live rows' age index (the admin's and the dashboard's lists of the queue) is no claim path.
    assert "delivery_queue_created_idx" not in plan, plan
    assert "delivery_created_idx" not in plan, plan


def copies(template: uuid.UUID, n: int, *, finished: bool) -> None:
    """``n`` copies of one delivery (pending, or finished), then ANALYZE: a table at scale. Their
    ``created_at`` are a millisecond apart, oldest first, as a producer's commits would be."""
    settled = (["status", "finished_at", "attempt"], ", 'finished', now(), 1") if finished else ([], "")
    insert_delivery_rows(
        ["id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id",
         "message_event_id", "cause_kind", "cause_webhook_invocation_id", "created_at", *settled[0]],
        f"""SELECT gen_random_uuid(), community_id, workflow_id, run_id, 'bulk-' || g, target_pubkey,
                   definition_event_id, message_event_id, cause_kind, gen_random_uuid(),
                   now() - make_interval(secs => (%s - g) / 1000.0){settled[1]}
            FROM {DELIVERY}, generate_series(1, %s) AS g WHERE id = %s""",
        [n, n, template],
    )  # fmt: skip
    execute(f"ANALYZE {DELIVERY}", [])
    execute(f"ANALYZE {sql.QUEUE}", [])


def claim_plan(community: models.Community, target: bytes, *, limit: int, generic: bool = False) -> str:
    """The planner's plan for a claim of ``limit`` of ``target``'s deliveries (EXPLAIN only);
    ``generic``: the plan the claim's PL/pgSQL function caches (``services.cached``)."""
    params = {"community_id": community.id, "target_pubkey": target, "limit": limit, "lease_seconds": 60.0,
              "delivery_id": None, "holder": None}  # fmt: skip
    if generic:
        return "\n".join(line for (line,) in generic_explain(cached.CLAIM, params))
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql.claim_oldest_pending(by_id=False, by_binding=False), params)
        return "\n".join(line for (line,) in cursor.fetchall())


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_the_claim_walks_the_polling_index_with_statistics_from_when_every_row_was_pending(
    community, target, commit_one, generic
):
    # A worker's drain: statistics taken while 20,000 rows were pending, then half of them
    # settled. With a plain index on created_at the planner walked it past every settled row
    # (9 ms a claim of 50 instead of 2.4, issue 16); it must take the polling index.
    copies(commit_one(), 20000, finished=False)
    set_delivery_state(
        Expr(f"id IN (SELECT id FROM {DELIVERY} WHERE community_id = %s ORDER BY created_at, id LIMIT 10000)",
             [community.id]),
        status="finished", finished_at=Expr("now()"), attempt=1,
    )  # fmt: skip
    plan = claim_plan(community, target, limit=50, generic=generic)

    assert "delivery_queue_poll_idx" in plan, plan
    assert "delivery_queue_created_idx" not in plan, plan


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_the_claim_query_walks_the_pending_poll_index_among_many_terminal_rows(community, target, commit_one, generic):
    for _ in range(3):
        commit_one()
    copies(commit_one(), 20000, finished=True)
    plan = claim_plan(community, target, limit=1, generic=generic)

    # Issue 31, stage 2: the terminal rows are not in the queue the claim walks (any index of its
    # four rows will do); their records are read by key only (the claimed one's).
    assert "Seq Scan on buzz_delivery_delivery" not in plan, plan
    assert set(re.findall(r"Index Scan using (\w+) on buzz_delivery_delivery_record", plan)) == {
        "buzz_delivery_delivery_pkey"
    }, plan
