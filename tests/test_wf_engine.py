"""The workflow engine end to end in one process (SPEC section 11): runs advance through their
DAG in the transactions that end their steps; retries, on_error, conditions, restart."""

from __future__ import annotations

import pytest

from buzz_delivery.services import AlreadyTerminal, LeaseLost, Settled
from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows import executor
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.services import (
    claim_steps,
    complete_step,
    fail_step,
    get_run,
    renew_step,
    restart_run,
)
from buzz_delivery.workflows.testing import diamond, function_step, run_until_idle
from tests.wf_support import backdate_step_lease, run_state, start, states

pytestmark = pytest.mark.django_db


@pytest.fixture
def workflow(community):
    return WorkflowFactory(community=community)


def test_a_diamond_runs_to_success_in_dependency_order(workflow):
    run = start(workflow, diamond("test.record"))
    assert states(run) == {"step1": "ready", "step2": "pending", "step3": "pending", "step4": "pending"}
    assert run_until_idle(workflow.community_id) == 4
    view = get_run(workflow.community_id, run.pk)
    assert view.state == "succeeded"
    assert {s.key: s.state for s in view.steps} == dict.fromkeys(["step1", "step2", "step3", "step4"], "succeeded")
    assert view.run.steps_left == 0
    assert view.run.output == {"step4": {"key": "step4"}}


def test_inputs_resolve_from_the_run_input_and_ancestor_outputs(workflow):
    definition = {
        "steps": [
            function_step("a", "test.record", input={"x": {"$ref": "input.x"}}),
            function_step("b", "test.record", depends_on=["a"], input={"got": {"$ref": "steps.a.output.x"}, "k": 1}),
        ]
    }
    run = start(workflow, definition, {"x": 42})
    run_until_idle(workflow.community_id)
    assert get_run(workflow.community_id, run.pk).step("b").output == {"key": "b", "got": 42, "k": 1}


def test_a_false_condition_skips_the_step_and_its_dependents(workflow):
    definition = {
        "steps": [
            function_step("check", "test.flag", input={"ok": {"$ref": "input.ok"}}),
            function_step("go", "noop", depends_on=["check"], when={"ref": "steps.check.output.ok", "equals": True}),
            function_step("after", "noop", depends_on=["go"]),
            function_step("other", "noop", depends_on=["check"], when={"ref": "input.ok", "equals": True, "not": True}),
        ]
    }
    run = start(workflow, definition, {"ok": False})
    run_until_idle(workflow.community_id)
    view = get_run(workflow.community_id, run.pk)
    assert {s.key: (s.state, s.skip_reason) for s in view.steps} == {
        "check": ("succeeded", None),
        "go": ("skipped", "condition_false"),
        "after": ("skipped", "dependency_not_succeeded"),
        "other": ("succeeded", None),
    }
    assert view.state == "succeeded"


def test_a_failing_function_is_retried_with_backoff_then_fails_the_run(workflow):
    definition = {
        "steps": [
            function_step("a", "test.boom", retry={"max_attempts": 2, "base_seconds": 0}),
            function_step("b", "noop", depends_on=["a"]),
        ]
    }
    run = start(workflow, definition)
    [claim] = claim_steps(workflow.community_id, lease_seconds=30)
    assert executor.execute(claim) == Settled("ready")
    step = Step.objects.get(id=claim.lease.step_id)
    assert (step.state, step.attempts, step.failure_code) == ("ready", 1, "function_error")
    [claim] = claim_steps(workflow.community_id, lease_seconds=30)
    assert claim.lease.attempts == 2
    assert executor.execute(claim) == Settled("failed")
    step.refresh_from_db()
    assert (step.state, step.failure_code) == ("failed", "attempts_exhausted")
    run.refresh_from_db()
    assert (run.state, run.failure_code) == ("failed", "step_failed")
    assert states(run) == {"a": "failed", "b": "canceled"}


def test_the_backoff_gate_holds_a_retried_step_back(workflow):
    start(workflow, {"steps": [function_step("a", "test.boom", retry={"max_attempts": 3, "base_seconds": 600})]})
    [claim] = claim_steps(workflow.community_id, lease_seconds=30)
    assert executor.execute(claim) == Settled("ready")
    assert claim_steps(workflow.community_id, lease_seconds=30) == []


@pytest.mark.parametrize(
    ("on_error", "dependent", "run_end"),
    [
        ("continue", "succeeded", "succeeded"),
        ("skip_dependents", "skipped", "succeeded"),
        ("fail_run", "canceled", "failed"),
    ],
)
def test_on_error_policies(workflow, on_error, dependent, run_end):
    definition = {
        "steps": [
            function_step("a", "test.boom", retry={"max_attempts": 1}, on_error=on_error),
            function_step("b", "noop", depends_on=["a"]),
            function_step("c", "noop"),
        ]
    }
    run = start(workflow, definition)
    run_until_idle(workflow.community_id)
    assert states(run)["b"] == dependent
    assert run_state(run) == run_end


@pytest.mark.parametrize(
    ("function", "code"),
    [
        ("test.huge", "output_too_large"),
        ("test.not_json", "output_not_json"),
        ("missing.function", "function_not_registered"),
    ],
)
def test_bad_output_or_a_missing_function_fails_the_step_with_a_code_not_the_worker(workflow, function, code):
    run = start(workflow, {"steps": [function_step("a", function, retry={"max_attempts": 3})]})
    run_until_idle(workflow.community_id)
    step = get_run(workflow.community_id, run.pk).step("a")
    assert (step.state, step.failure_code, step.attempts) == ("failed", code, 1)


def test_an_async_def_function_step_is_awaited_and_its_output_and_failures_recorded(workflow):
    definition = {
        "steps": [
            function_step("ok", "test.async_wait", input={"sleep": 0.05}),
            function_step("boom", "test.async_boom", retry={"max_attempts": 1}, on_error="continue"),
            function_step("refused", "test.async_permanent", retry={"max_attempts": 3}, on_error="continue"),
        ]
    }
    run = start(workflow, definition)
    run_until_idle(workflow.community_id)
    got = get_run(workflow.community_id, run.pk)
    assert (got.step("ok").state, got.step("ok").output) == ("succeeded", {"awaited": True, "step": "ok"})
    boom = got.step("boom")
    assert (boom.state, boom.failure_code) == ("failed", "attempts_exhausted")  # retryable, one attempt
    assert "RuntimeError: async boom" in boom.failure_message
    refused = got.step("refused")
    assert (refused.state, refused.failure_code, refused.attempts) == ("failed", "async_refused", 1)


def test_stale_holder_matrix_for_steps(workflow):
    """A reclaimed step's old holder gets LeaseLost on renew, complete and fail; the true
    holder's retry of its completion is AlreadyTerminal (SPEC 4.5, repeated for steps)."""
    from buzz_delivery.workflows.services.maintenance import reap_workflow_steps

    start(workflow, {"steps": [function_step("a", retry={"max_attempts": 3})]})
    [old] = claim_steps(workflow.community_id, lease_seconds=30)
    backdate_step_lease(old.lease.step_id)
    assert renew_step(old.lease, 30) == LeaseLost()
    result = reap_workflow_steps()
    assert result.reclaimed == 1
    [new] = claim_steps(workflow.community_id, lease_seconds=30)
    assert new.lease.lease_generation == old.lease.lease_generation + 2
    assert renew_step(old.lease, 30) == LeaseLost()
    assert complete_step(old.lease, {"stale": True}) == LeaseLost()
    assert fail_step(old.lease, "boom") == LeaseLost()
    assert isinstance(renew_step(new.lease, 30), type(renew_step(new.lease, 30)))
    assert complete_step(new.lease, {"ok": 1}) == Settled("succeeded")
    assert complete_step(new.lease, {"ok": 2}) == AlreadyTerminal("succeeded")
    assert fail_step(new.lease, "late") == AlreadyTerminal("succeeded")
    assert complete_step(old.lease, {"stale": True}) == LeaseLost()
    step = Step.objects.get(id=new.lease.step_id)
    assert (step.state, step.output, step.attempts) == ("succeeded", {"ok": 1}, 2)


def test_an_expired_lease_cannot_complete_even_before_it_is_reclaimed(workflow):
    start(workflow, {"steps": [function_step("a")]})
    [claim] = claim_steps(workflow.community_id, lease_seconds=30)
    backdate_step_lease(claim.lease.step_id)
    assert complete_step(claim.lease, {}) == LeaseLost()


def test_lapsed_leases_count_as_attempts_and_exhaust(workflow):
    from buzz_delivery.workflows.services.maintenance import reap_workflow_steps

    run = start(workflow, {"steps": [function_step("a", retry={"max_attempts": 2})]})
    for expected in ("reclaimed", "exhausted"):
        [claim] = claim_steps(workflow.community_id, lease_seconds=30)
        backdate_step_lease(claim.lease.step_id)
        result = reap_workflow_steps()
        assert getattr(result, expected) == 1
    step = get_run(workflow.community_id, run.pk).step("a")
    assert (step.state, step.failure_code, step.attempts) == ("failed", "attempts_exhausted", 2)
    assert run_state(run) == "failed"


def test_a_step_timeout_fails_the_running_step(workflow):
    from buzz_delivery.workflows.services.maintenance import reap_workflow_steps

    run = start(workflow, {"steps": [function_step("a", timeout_seconds=5, retry={"max_attempts": 3})]})
    [claim] = claim_steps(workflow.community_id, lease_seconds=300)
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_workflows_step SET claimed_at = buzz_delivery_plus_seconds(claimed_at, -10) WHERE id = %s",
            [claim.lease.step_id],
        )
    assert reap_workflow_steps().timed_out == 1
    step = get_run(workflow.community_id, run.pk).step("a")
    assert (step.state, step.failure_code) == ("failed", "step_timeout")
    assert complete_step(claim.lease, {}) == LeaseLost()


def test_restart_from_failure_keeps_succeeded_outputs_and_reruns_the_rest(workflow):
    definition = {
        "steps": [
            function_step("a", "test.record"),
            function_step("b", "test.flag", depends_on=["a"]),
            function_step("c", "test.boom", depends_on=["b"], retry={"max_attempts": 1}),
            function_step("d", "noop", depends_on=["c"]),
        ]
    }
    old = start(workflow, definition)
    run_until_idle(workflow.community_id)
    assert run_state(old) == "failed"
    new = restart_run(workflow.community_id, old.pk)
    assert new.restart_of_id == old.pk and new.definition_id == old.definition_id
    assert states(new) == {"a": "succeeded", "b": "succeeded", "c": "ready", "d": "pending"}
    assert get_run(workflow.community_id, new.pk).step("a").output == {"key": "a"}
    assert states(old) == {"a": "succeeded", "b": "succeeded", "c": "failed", "d": "canceled"}
    fresh = restart_run(workflow.community_id, old.pk, from_failure=False)
    assert states(fresh) == {"a": "ready", "b": "pending", "c": "pending", "d": "pending"}


def test_a_run_pins_its_version(workflow):
    run = start(workflow, {"steps": [function_step("a")]})
    start(workflow, {"steps": [function_step("a"), function_step("b")]})
    run_until_idle(workflow.community_id)
    assert states(run) == {"a": "succeeded"}
    assert Run.objects.get(pk=run.pk).definition.version == 1


def test_sub_workflow_runs_a_child_and_resumes_the_parent_with_its_output(workflow):
    child_wf = WorkflowFactory(community=workflow.community)
    from buzz_delivery.workflows.services import publish_definition

    publish_definition(
        workflow.community_id,
        child_wf.id,
        {"steps": [function_step("inner", "test.record", input={"v": {"$ref": "input.v"}})]},
    )
    definition = {
        "steps": [
            {"key": "sub", "kind": "sub_workflow", "workflow": str(child_wf.id), "input": {"v": {"$ref": "input.v"}}},
            function_step(
                "after", "test.record", depends_on=["sub"], input={"got": {"$ref": "steps.sub.output.inner.v"}}
            ),
        ]
    }
    run = start(workflow, definition, {"v": 7})
    run_until_idle(workflow.community_id)
    view = get_run(workflow.community_id, run.pk)
    assert view.state == "succeeded"
    child = Run.objects.get(parent_run_id=run.pk)
    assert (child.depth, child.parent_step_key, child.state) == (1, "sub", "succeeded")
    assert view.step("after").output == {"key": "after", "got": 7}
