"""The engine's per-run work on the database (issue 31, workflows migration 0027): a start is
one statement (one autocommit transaction) once its process has seen the workflow's latest
version, still pinned to the version latest when it runs; and the run row gets one version
fewer, the last step counted in the UPDATE that ends the run, whatever ends it."""

from __future__ import annotations

import os

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from buzz_delivery import services
from buzz_delivery.models import WorkflowAgentDelivery, WorkflowRun
from buzz_delivery.services import Cause, Settled
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows import executor
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.services import (
    cached,
    claim_steps,
    complete_step,
    fail_step,
    publish_definition,
    start_run,
)
from buzz_delivery.workflows.services import runs as runs_service
from buzz_delivery.workflows.testing import diamond, function_step, run_until_idle, send_step
from tests.citus_support import CITUS_MODE

pytestmark = pytest.mark.django_db(transaction=True)


def _start(workflow) -> Run:
    return start_run(workflow.community_id, workflow.id, {}, cause=Cause.event(os.urandom(32)))


def _run_versions_written() -> int:
    """Rows of the run table this transaction UPDATEd so far (each a new row version)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_get_xact_tuples_updated('buzz_workflows_run'::regclass)")
        return int(cursor.fetchone()[0])


def _assert_run_versions_since(before: int, expected: int) -> None:
    """This transaction wrote ``expected`` run row versions since ``before``. On the cluster the
    counts are kept by the workers holding the rows (tests/citus_mode.py ``_ROW_VERSIONS``): the
    outcomes are checked there, the counts here only."""
    if not CITUS_MODE:
        assert _run_versions_written() - before == expected


def _claims(community_id) -> dict:
    """Every ready step of the community claimed, by key."""
    return {c.step.key: c for c in claim_steps(community_id, limit=100, lease_seconds=30)}


def _claim(community_id, key: str):
    [(found_key, found)] = _claims(community_id).items()
    assert found_key == key
    return found


def test_a_start_is_one_statement_once_its_process_saw_the_latest_version(community):
    """It was two autocommit statements on every start: the latest version read, then the
    insert; the insert now checks the version its process last saw is still the latest."""
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, diamond())
    _start(workflow)  # the first start in this process reads which version is the latest
    with CaptureQueriesContext(connection) as queries:
        run = _start(workflow)
    sent = [q["sql"] for q in queries.captured_queries]
    assert len(sent) == 1, sent
    assert cached.CREATE_RUN.function + "(" in sent[0]
    assert (run.state, run.steps_left, run.definition.version) == ("running", 4, 1)


def test_a_version_published_since_the_process_looked_is_the_one_a_start_pins(community):
    """Another process publishes version 2 (this one's cache still says 1): the start's
    statement refuses version 1 and writes nothing, the start reads and pins version 2."""
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, diamond())
    first = _start(workflow)
    second_version = publish_definition(community.id, workflow.id, {"steps": [function_step("only")]})
    runs_service._LATEST[(community.id, workflow.id)] = first.definition  # as another process left it
    with CaptureQueriesContext(connection) as queries:
        run = _start(workflow)
    assert len(queries.captured_queries) >= 3  # refused, the latest read, the start
    assert run.definition_id == second_version.pk and run.steps_total == 1
    assert list(Step.objects.filter(community_id=community.id, run_id=run.pk).values_list("key", flat=True)) == ["only"]
    assert WorkflowRun.objects.filter(community_id=community.id).count() == 2  # the refused one wrote no run
    assert Run.objects.filter(community_id=community.id).count() == 2
    assert _start(workflow).definition_id == second_version.pk  # and it is remembered


def test_an_idempotent_start_still_returns_the_first_run(community):
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, diamond())
    cause = Cause.event(os.urandom(32))
    first = start_run(community.id, workflow.id, {"a": 1}, cause=cause, idempotency_key="k")
    again = start_run(community.id, workflow.id, {"a": 1}, cause=cause, idempotency_key="k")
    assert again.pk == first.pk and Run.objects.filter(community_id=community.id).count() == 1


def test_the_last_step_is_counted_in_the_update_that_ends_the_run(community):
    """Ending the diamond's last step wrote the run row twice (the count, then the end)."""
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, diamond())
    run = _start(workflow)
    complete_step(_claim(community.id, "step1").lease, None)
    middle = _claims(community.id)
    for key in ("step2", "step3"):
        with transaction.atomic():
            before = _run_versions_written()
            complete_step(middle[key].lease, {"k": key})
            _assert_run_versions_since(before, 1)  # counted, the run still running
    with transaction.atomic():
        before = _run_versions_written()
        assert complete_step(_claim(community.id, "step4").lease, {"done": True}) == Settled("succeeded")
        _assert_run_versions_since(before, 1)
    ended = Run.objects.get(community_id=community.id, run_id=run.pk)
    assert (ended.state, ended.steps_left, ended.output) == ("succeeded", 0, {"step4": {"done": True}})


@pytest.mark.parametrize(("on_error", "state"), [("fail_run", "failed"), ("continue", "succeeded")])
def test_a_last_step_that_fails_is_counted_in_the_end_too(community, on_error, state):
    workflow = WorkflowFactory(community=community)
    publish_definition(
        community.id,
        workflow.id,
        {"steps": [function_step("a"), function_step("b", depends_on=["a"], on_error=on_error)]},
    )
    run = _start(workflow)
    complete_step(_claim(community.id, "a").lease, None)
    with transaction.atomic():
        before = _run_versions_written()
        fail_step(_claim(community.id, "b").lease, "boom", retryable=False)
        # The end (and, for a failed run, the service clearing its deliveries_to_expire mark
        # once its pending deliveries are expired): one version fewer than the count, then these.
        _assert_run_versions_since(before, (2 if state == "failed" else 1))
    ended = Run.objects.get(community_id=community.id, run_id=run.pk)
    assert (ended.state, ended.steps_left) == (state, 0)
    if state == "failed":
        assert ended.failure_code == "step_failed"


def test_a_fail_run_step_with_others_open_cancels_them_and_counts_every_one(community):
    """Not the last step: the run's end cancels the open ones, each counted (steps_left 0)."""
    workflow = WorkflowFactory(community=community)
    publish_definition(
        community.id, workflow.id, {"steps": [function_step("a"), function_step("b"), function_step("c")]}
    )
    run = _start(workflow)
    fail_step(_claims(community.id)["a"].lease, "boom", retryable=False)  # b and c held, running
    ended = Run.objects.get(community_id=community.id, run_id=run.pk)
    assert (ended.state, ended.steps_left) == ("failed", 0)
    assert sorted(Step.objects.filter(community_id=community.id, run_id=run.pk).values_list("state", flat=True)) == [
        "canceled",
        "canceled",
        "failed",
    ]


def test_the_fan_in_of_the_last_delivery_ends_the_run_in_one_run_version(community):
    workflow = WorkflowFactory(community=community)
    targets = sorted(random32() for _ in range(2))
    publish_definition(community.id, workflow.id, {"steps": [send_step("send", targets)]})
    run = _start(workflow)
    run_until_idle(community.id)
    leases = [
        services.claim_delivery(community.id, bytes(d.target_pubkey), delivery_id=d.id, lease_seconds=30).lease
        for d in WorkflowAgentDelivery.objects.filter(run_id=run.pk).order_by("target_pubkey")
    ]
    with transaction.atomic():
        before = _run_versions_written()
        assert services.finish_deliveries(leases, "finished") == [Settled("finished")] * 2
        _assert_run_versions_since(before, 1)  # the step counted and the run ended at once
    ended = Run.objects.get(community_id=community.id, run_id=run.pk)
    assert (ended.state, ended.steps_left) == ("succeeded", 0)


def test_a_child_runs_failure_ends_its_parent_whose_other_steps_are_open(community):
    """The child's last step counted in its end (``counted`` 1), the parent's ``fail_run`` step
    with another step still open (``counted`` 0): the parent's end is called, whatever ``counted``
    (a call inside ``IF NOT end_run(...) AND counted = 1`` was folded away when ``counted`` was 0:
    the parent stayed running, found by tests/test_wf_model_based_kinds.py)."""
    parent_workflow = WorkflowFactory(community=community)
    child_workflow = WorkflowFactory(community=community)
    publish_definition(community.id, child_workflow.id, {"steps": [function_step("c")]})
    publish_definition(
        community.id,
        parent_workflow.id,
        {
            "steps": [
                {"key": "sub", "kind": "sub_workflow", "workflow": str(child_workflow.id), "on_error": "fail_run"},
                function_step("later", depends_on=["sub"]),
            ]
        },
    )
    for _ in range(3):  # a few times: a plan-time fold shows on some executions of the trigger only
        parent = _start(parent_workflow)
        executor.execute(_claim(community.id, "sub"))  # parks the step and starts the child run
        child = Run.objects.get(community_id=community.id, parent_run_id=parent.pk)
        fail_step(_claim(community.id, "c").lease, "boom", retryable=False)
        ended_child = Run.objects.get(community_id=community.id, run_id=child.pk)
        assert (ended_child.state, ended_child.steps_left) == ("failed", 0)
        ended = Run.objects.get(community_id=community.id, run_id=parent.pk)
        assert (ended.state, ended.steps_left, ended.failure_code) == ("failed", 0, "step_failed")
        assert dict(Step.objects.filter(community_id=community.id, run_id=parent.pk).values_list("key", "state")) == {
            "sub": "failed",
            "later": "canceled",
        }
