"""Backoff that listens (issue 29): every layer's exponential backoff has equal jitter (a delay
within [1/2, 1] of the computed one: bounds asserted, never exact values), and a failure's
``retry_after`` (a provider's Retry-After) holds the next attempt back at least that long."""

from __future__ import annotations

import math

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.test import override_settings

from buzz_delivery import backoff, services
from buzz_delivery.agents.services import reap_agent_runs
from buzz_delivery.backoff import RetryAfter
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import DeliveryFactory, EventFactory, WorkflowFactory, WorkflowRunFactory, random32
from buzz_delivery.worker import WorkerConfig, run_worker
from buzz_delivery.worker.handlers import settle_args_for
from buzz_delivery.workflows import workflow_function
from buzz_delivery.workflows.models import Step
from buzz_delivery.workflows.services import claim_steps
from buzz_delivery.workflows.services.steps import fail_step
from buzz_delivery.workflows.testing import function_step
from tests.agents_support import backdate_run_lease, claim, new_run
from tests.wf_support import start

pytestmark = pytest.mark.django_db


def deliver(community, target: bytes) -> WorkflowAgentDelivery:
    run = WorkflowRunFactory(community=community)
    return DeliveryFactory(
        binding__run=run, binding__message_event=EventFactory(community=community), binding__target_pubkey=target
    )


def delay_window(table: str, row_id, call) -> tuple[float, float]:
    """(low, high) seconds of a row's ``next_attempt_at`` after ``call()``, measured from the
    database clock read after and before the call: the delay itself lies within."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        (before,) = cursor.fetchone()
        call()
        cursor.execute("SELECT clock_timestamp()")
        (after,) = cursor.fetchone()
        cursor.execute(f"SELECT next_attempt_at FROM {table} WHERE id = %s", [row_id])
        (at,) = cursor.fetchone()
    return (at - after).total_seconds(), (at - before).total_seconds()


# --- deliveries --------------------------------------------------------------------------


@override_settings(BUZZ_DELIVERY={"RETRY_BACKOFF_BASE_SECONDS": 100, "RETRY_BACKOFF_CAP_SECONDS": 100})
def test_a_delivery_retry_waits_within_half_and_all_of_its_backoff_and_retries_spread(community):
    target = random32()
    highs = []
    for _ in range(8):
        delivery = deliver(community, target)
        (claimed,) = services.claim_deliveries(community.id, target, limit=1)
        low, high = delay_window(
            WorkflowAgentDelivery._meta.db_table,
            delivery.id,
            lambda c=claimed: services.finish_delivery(c.lease, "retry"),
        )
        assert high >= 50 and low <= 100, (low, high)
        highs.append(high)
    assert max(highs) - min(highs) > 0.5  # jittered: eight retries do not all come back together


def test_a_delivery_retry_after_holds_the_next_attempt_back_at_least_that_long(community):
    target = random32()
    delivery = deliver(community, target)
    (claimed,) = services.claim_deliveries(community.id, target, limit=1)
    low, high = delay_window(
        WorkflowAgentDelivery._meta.db_table,
        delivery.id,
        lambda: services.finish_delivery(claimed.lease, "retry", retry_after=500),
    )
    assert high >= 500 and low <= 500  # the backoff (2 s) is shorter: Retry-After wins


@pytest.mark.parametrize("value", [-1, math.inf, math.nan, "30", True, backoff.MAX_RETRY_AFTER_SECONDS + 1])
def test_a_bad_retry_after_is_refused_by_name_and_nothing_is_written(community, value):
    target = random32()
    delivery = deliver(community, target)
    (claimed,) = services.claim_deliveries(community.id, target, limit=1)
    before = WorkflowAgentDelivery.objects.values().get(id=delivery.id)
    with pytest.raises(ValidationError) as refused:
        services.finish_delivery(claimed.lease, "retry", retry_after=value)
    assert "retry_after" in refused.value.message_dict
    assert WorkflowAgentDelivery.objects.values().get(id=delivery.id) == before


def test_retry_after_with_another_outcome_is_refused_by_name(community):
    target = random32()
    deliver(community, target)
    (claimed,) = services.claim_deliveries(community.id, target, limit=1)
    with pytest.raises(ValidationError) as refused:
        services.finish_delivery(claimed.lease, "finished", retry_after=5)
    assert "retry_after" in refused.value.message_dict


class Weird(Exception):
    @property
    def retry_after(self):
        raise RuntimeError("a property that raises")


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (RetryAfter(30), 30.0),
        (RetryAfter(10**9), backoff.MAX_RETRY_AFTER_SECONDS),
        (RetryAfter(-5), None),
        (RetryAfter(math.nan), None),
        (Weird(), None),
        (ValueError("no attribute"), None),
    ],
)
def test_a_handlers_retry_after_is_carried_to_the_settle_and_an_unusable_one_ignored(exc, expected):
    args = settle_args_for(exc)
    assert (args.outcome, args.retry_after) == ("retry", expected)


def raise_retry_after(delivery):
    raise RetryAfter(400, "429 Too Many Requests")


@pytest.mark.django_db(transaction=True)
def test_the_delivery_worker_honours_its_handlers_retry_after(community):
    target = random32()
    delivery = deliver(community, target)
    config = WorkerConfig(
        community_id=community.id, target_pubkey=target, handler=raise_retry_after, max_deliveries=1, idle_exit=0.5,
        poll_interval=0.05,
    )  # fmt: skip
    summary = run_worker(config, handle_signals=False)
    assert summary["retried"] == 1
    with connection.cursor() as cursor:
        cursor.execute("SELECT extract(epoch FROM next_attempt_at - now()) FROM buzz_delivery_delivery WHERE id = %s",
                       [delivery.id])  # fmt: skip
        (wait,) = cursor.fetchone()
    assert 390 <= wait <= 400


# --- workflow function steps -------------------------------------------------------------


@workflow_function("test.rate_limited")
def rate_limited(input, context):
    raise RetryAfter(300, "the provider said 429")


def test_a_function_steps_retry_after_holds_its_next_attempt_back(workflow_of):
    workflow = workflow_of()
    start(workflow, {"steps": [function_step("a", "test.rate_limited", retry={"max_attempts": 3, "base_seconds": 1})]})
    from buzz_delivery.workflows import executor

    [claimed] = claim_steps(workflow.community_id, lease_seconds=30)
    low, high = delay_window(Step._meta.db_table, claimed.lease.step_id, lambda: executor.execute(claimed))
    assert high >= 300 and low <= 300


def test_a_failed_steps_backoff_is_jittered_within_its_bounds(workflow_of):
    workflow = workflow_of()
    highs = []
    for _ in range(6):
        start(workflow, {"steps": [function_step("a", "noop", retry={"max_attempts": 3, "base_seconds": 100})]})
        [claimed] = claim_steps(workflow.community_id, lease_seconds=30)
        low, high = delay_window(
            Step._meta.db_table, claimed.lease.step_id, lambda c=claimed: fail_step(c.lease, "boom")
        )
        assert high >= 50 and low <= 100, (low, high)
        highs.append(high)
    assert max(highs) - min(highs) > 0.5


def test_fail_step_refuses_a_bad_retry_after_by_name(workflow_of):
    workflow = workflow_of()
    start(workflow, {"steps": [function_step("a", "noop")]})
    [claimed] = claim_steps(workflow.community_id, lease_seconds=30)
    with pytest.raises(ValidationError) as refused:
        fail_step(claimed.lease, "boom", retry_after=-1)
    assert "retry_after" in refused.value.message_dict
    assert Step.objects.get(id=claimed.lease.step_id).state == "running"


# --- agent runs --------------------------------------------------------------------------


@override_settings(BUZZ_AGENTS={"RETRY_DELAY_SECONDS": 100, "RETRY_DELAY_MAX_SECONDS": 100})
def test_reclaimed_agent_runs_back_off_within_their_bounds_and_spread(community):
    runs = [new_run(community.id) for _ in range(6)]
    for run_id in runs:
        claim(community.id, run_id)
        backdate_run_lease(run_id)
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        (before,) = cursor.fetchone()
    assert reap_agent_runs().reclaimed == len(runs)  # one batch: one seed, a factor per run
    with connection.cursor() as cursor:
        cursor.execute("SELECT next_attempt_at FROM buzz_agents_run WHERE id = ANY(%s)", [runs])
        delays = [(at - before).total_seconds() for (at,) in cursor.fetchall()]
    assert all(50 - 1 <= d <= 100 + 5 for d in delays), delays
    assert max(delays) - min(delays) > 0.5


@pytest.fixture
def workflow_of(community):
    return lambda: WorkflowFactory(community=community)


def test_jitter_stays_within_its_documented_bounds():
    draws = [backoff.jittered(10.0) for _ in range(2000)]
    assert all(5.0 <= d <= 10.0 for d in draws)
    assert min(draws) < 6 and max(draws) > 9  # the whole window is used
