"""send_message steps, fan-in on every settle path, cancel, approvals, fences and purge
(SPEC section 11), in one process."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from buzz_delivery import services
from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.models import Event, WorkflowAgentDelivery
from buzz_delivery.services import AlreadyTerminal, LeaseLost, Settled
from buzz_delivery.testing import CommunityFactory, WorkflowFactory, advance_to, backdate, random32, set_delivery_state
from buzz_delivery.workflows import executor
from buzz_delivery.workflows.models import Approval, Run
from buzz_delivery.workflows.services import (
    AlreadyDecided,
    Canceled,
    Decided,
    Expired,
    cancel_run,
    claim_steps,
    complete_step,
    decide_approval,
    get_run,
    renew_step,
)
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from buzz_delivery.workflows.testing import function_step, run_until_idle, send_step
from tests.wf_support import ENGINE_MODELS, run_state, start, states

pytestmark = pytest.mark.django_db


@pytest.fixture
def workflow(community):
    return WorkflowFactory(community=community)


def deliveries(run):
    return list(WorkflowAgentDelivery.objects.filter(run_id=run.pk).order_by("target_pubkey"))


def settle_all(run, outcome="finished"):
    for d in deliveries(run):
        claim = services.claim_delivery(d.community_id, bytes(d.target_pubkey), delivery_id=d.id, lease_seconds=30)
        if claim is not None:
            assert services.finish_delivery(claim.lease, outcome) == Settled(outcome)


def test_send_message_commits_one_delivery_per_target_and_parks_the_step(workflow):
    targets = [random32() for _ in range(3)]
    run = start(workflow, {"steps": [send_step("send", targets), function_step("after", depends_on=["send"])]})
    run_until_idle(workflow.community_id)
    step = get_run(workflow.community_id, run.pk).step("send")
    assert (step.state, step.expected, step.delivered_terminal) == ("waiting", 3, 0)
    rows = deliveries(run)
    assert sorted(bytes(d.target_pubkey) for d in rows) == sorted(targets)
    version = Run.objects.get(pk=run.pk).definition
    assert {bytes(d.definition_event_id) for d in rows} == {bytes(version.definition_event_id)}
    assert {d.step_id for d in rows} == {"send"}
    assert {d.cause_kind for d in rows} == {"event"}


def test_send_message_writes_its_message_event_once_and_reuses_one_that_exists(workflow):
    """The message event is written with the deliveries; a step whose event is there already
    (without deliveries: here written beforehand) carries that one, and no second is written."""
    targets = [random32() for _ in range(2)]
    first = start(workflow, {"steps": [send_step("send", targets, content="first")]})
    second = start(workflow, {"steps": [send_step("send", targets, content="second")]})
    there = Event.objects.create(
        community_id=workflow.community_id,
        event_id=executor.message_event_id(second.pk, "send"),
        created_at=timezone.now(),
        kind=1,
        pubkey=bytes(32),
        content="written before",
    )
    run_until_idle(workflow.community_id)
    for run, content in ((first, "first"), (second, "written before")):
        event_id = executor.message_event_id(run.pk, "send")
        events = Event.objects.filter(community_id=workflow.community_id, event_id=event_id)
        assert [e.content for e in events] == [content]
        assert {bytes(d.message_event_id) for d in deliveries(run)} == {event_id}
        assert get_run(workflow.community_id, run.pk).step("send").state == "waiting"
    assert Event.objects.get(pk=there.pk).content == "written before"


def test_each_settle_is_counted_and_the_last_one_advances_the_run(workflow):
    targets = [random32() for _ in range(3)]
    run = start(workflow, {"steps": [send_step("send", targets), function_step("after", depends_on=["send"])]})
    run_until_idle(workflow.community_id)
    first, *rest = deliveries(run)
    claim = services.claim_delivery(first.community_id, bytes(first.target_pubkey), lease_seconds=30)
    services.finish_delivery(claim.lease, "finished")
    assert get_run(workflow.community_id, run.pk).step("send").delivered_terminal == 1
    assert states(run)["after"] == "pending"
    for d in rest:
        claim = services.claim_delivery(d.community_id, bytes(d.target_pubkey), lease_seconds=30)
        services.finish_delivery(claim.lease, "finished")
    step = get_run(workflow.community_id, run.pk).step("send")
    assert (step.state, step.delivered_terminal, step.delivered_failed, step.output) == (
        "succeeded",
        3,
        0,
        {"delivered": 3, "failed": 0},
    )
    assert states(run)["after"] == "ready"
    run_until_idle(workflow.community_id)
    assert run_state(run) == "succeeded"


def test_failures_beyond_the_tolerance_fail_the_step(workflow):
    targets = [random32() for _ in range(3)]
    run = start(workflow, {"steps": [send_step("send", targets, tolerate_failures=1)]})
    run_until_idle(workflow.community_id)
    a, b, c = deliveries(run)
    for d, outcome in ((a, "failed"), (b, "finished")):
        claim = services.claim_delivery(d.community_id, bytes(d.target_pubkey), lease_seconds=30)
        services.finish_delivery(claim.lease, outcome)
    assert states(run)["send"] == "waiting"
    claim = services.claim_delivery(c.community_id, bytes(c.target_pubkey), lease_seconds=30)
    services.finish_delivery(claim.lease, "failed")
    step = get_run(workflow.community_id, run.pk).step("send")
    assert (step.state, step.failure_code, step.delivered_failed) == ("failed", "deliveries_failed", 2)
    assert run_state(run) == "failed"


def test_operator_force_fail_and_requeue_are_counted_both_ways(workflow):
    targets = [random32() for _ in range(2)]
    run = start(workflow, {"steps": [send_step("send", targets, tolerate_failures=2)]})
    run_until_idle(workflow.community_id)
    a, _b = deliveries(run)
    claim = services.claim_delivery(a.community_id, bytes(a.target_pubkey), lease_seconds=30)
    assert services.force_fail_delivery(a.community_id, a.id).done
    step = get_run(workflow.community_id, run.pk).step("send")
    assert (step.delivered_terminal, step.delivered_failed) == (1, 1)
    assert services.requeue_delivery(a.community_id, a.id).done
    step.refresh_from_db()
    assert (step.delivered_terminal, step.delivered_failed) == (0, 0)
    assert services.finish_delivery(claim.lease, "finished") == LeaseLost()
    settle_all(run)
    step.refresh_from_db()
    assert (step.state, step.delivered_terminal, step.delivered_failed) == ("succeeded", 2, 0)


def test_the_reaper_exhausting_a_delivery_is_counted(workflow):
    target = random32()
    run = start(workflow, {"steps": [send_step("send", [target], tolerate_failures=1)]})
    run_until_idle(workflow.community_id)
    [d] = deliveries(run)
    set_delivery_state(d.id, max_attempts=1)
    services.claim_delivery(d.community_id, target, lease_seconds=30)
    backdate(d.id, lease_until=3600)
    assert services.reap_expired_deliveries() >= 1
    step = get_run(workflow.community_id, run.pk).step("send")
    assert (step.state, step.delivered_failed) == ("succeeded", 1)
    assert run_state(run) == "succeeded"


def test_cancel_while_a_step_is_claimed_and_deliveries_are_pending(workflow):
    targets = [random32() for _ in range(3)]
    run = start(
        workflow,
        {
            "steps": [
                send_step("send", targets),
                function_step("slow"),
                function_step("after", depends_on=["send", "slow"]),
            ]
        },
    )
    claims = claim_steps(workflow.community_id, limit=10, lease_seconds=30)
    by_key = {c.step.key: c for c in claims}
    executor.execute(by_key["send"])
    held = by_key["slow"]
    d0 = deliveries(run)[0]
    agent = services.claim_delivery(d0.community_id, bytes(d0.target_pubkey), delivery_id=d0.id, lease_seconds=30)
    outcome = cancel_run(workflow.community_id, run.pk)
    assert outcome == Canceled(runs=1, deliveries=2)
    assert run_state(run) == "canceled"
    assert states(run) == {"send": "canceled", "slow": "canceled", "after": "canceled"}
    assert renew_step(held.lease, 30) == LeaseLost()
    assert complete_step(held.lease, {}) == LeaseLost()
    assert sorted(d.status for d in deliveries(run)) == ["claimed", "expired", "expired"]
    assert services.finish_delivery(agent.lease, "finished") == Settled("finished")  # the agent's own lease
    assert get_run(workflow.community_id, run.pk).step("send").delivered_terminal == 0  # counted by nobody
    assert cancel_run(workflow.community_id, run.pk) == AlreadyTerminal("canceled")
    assert claim_steps(workflow.community_id, limit=10, lease_seconds=30) == []


def test_cancel_reaches_child_runs(workflow):
    child_wf = WorkflowFactory(community=workflow.community)
    from buzz_delivery.workflows.services import publish_definition

    target = random32()
    publish_definition(workflow.community_id, child_wf.id, {"steps": [send_step("inner", [target])]})
    run = start(workflow, {"steps": [{"key": "sub", "kind": "sub_workflow", "workflow": str(child_wf.id)}]})
    run_until_idle(workflow.community_id)
    child = Run.objects.get(parent_run_id=run.pk)
    assert states(child) == {"inner": "waiting"}
    assert cancel_run(workflow.community_id, run.pk) == Canceled(runs=2, deliveries=1)
    child.refresh_from_db()
    assert child.state == "canceled" and states(child) == {"inner": "canceled"}
    assert [d.status for d in deliveries(child)] == ["expired"]


def approval_run(workflow, **fields):
    run = start(
        workflow,
        {
            "steps": [
                {"key": "ok", "kind": "approval", "deadline_seconds": 600, "prompt": "ship?", **fields},
                function_step("after", depends_on=["ok"]),
            ]
        },
    )
    run_until_idle(workflow.community_id)
    return run, Approval.objects.get(run_id=run.pk)


def test_an_approved_approval_resumes_the_step_once(workflow):
    run, approval = approval_run(workflow)
    assert states(run)["ok"] == "waiting" and approval.state == "pending"
    outcome = decide_approval(workflow.community_id, approval.id, "approved", "alice")
    assert isinstance(outcome, Decided) and outcome.decided_by == "alice"
    second = decide_approval(workflow.community_id, approval.id, "rejected", "bob")
    assert isinstance(second, AlreadyDecided) and (second.state, second.decided_by) == ("approved", "alice")
    step = get_run(workflow.community_id, run.pk).step("ok")
    assert (step.state, step.output) == ("succeeded", {"decision": "approved", "decided_by": "alice"})
    assert states(run)["after"] == "ready"


def test_a_rejection_fails_the_step(workflow):
    run, approval = approval_run(workflow)
    assert isinstance(decide_approval(workflow.community_id, approval.id, "reject", "bob"), Decided)
    assert get_run(workflow.community_id, run.pk).step("ok").failure_code == "approval_rejected"
    assert run_state(run) == "failed"


def test_an_expired_approval_cannot_be_decided(workflow):
    run, approval = approval_run(workflow)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_workflows_approval SET deadline_at = buzz_delivery_plus_seconds(requested_at, 1),"
            " requested_at = buzz_delivery_plus_seconds(requested_at, -3600) WHERE id = %s",
            [approval.id],
        )
        cursor.execute(
            "UPDATE buzz_workflows_approval SET deadline_at = buzz_delivery_plus_seconds(requested_at, 1)"
            " WHERE id = %s",
            [approval.id],
        )
    assert isinstance(decide_approval(workflow.community_id, approval.id, "approved", "alice"), Expired)
    result = reap_workflow_steps()
    assert result.approvals_expired == 1
    assert get_run(workflow.community_id, run.pk).step("ok").failure_code == "approval_expired"
    assert isinstance(decide_approval(workflow.community_id, approval.id, "approved", "alice"), Expired)


def test_bad_decisions_are_refused_by_name(workflow):
    _run, approval = approval_run(workflow)
    for kwargs, field in (
        ({"decision": "maybe"}, "decision"),
        ({"decided_by": " "}, "decided_by"),
        ({"approval_id": "nope"}, "approval_id"),
    ):
        args = {
            "community_id": workflow.community_id,
            "approval_id": approval.id,
            "decision": "approved",
            "decided_by": "alice",
            **kwargs,
        }
        with pytest.raises(ValidationError) as exc:
            decide_approval(**args)
        assert field in exc.value.message_dict
    assert Approval.objects.get(id=approval.id).state == "pending"


def test_a_fenced_community_does_not_advance_and_does_not_block_others(workflow):
    other = WorkflowFactory(community=CommunityFactory())
    target = random32()
    run = start(workflow, {"steps": [send_step("send", [target]), function_step("after", depends_on=["send"])]})
    healthy = start(other, {"steps": [function_step("a"), function_step("b", depends_on=["a"])]})
    run_until_idle(workflow.community_id)
    [d] = deliveries(run)
    claim = services.claim_delivery(d.community_id, target, lease_seconds=30)
    advance_to(workflow.community, "fenced")
    assert services.finish_delivery(claim.lease, "finished") == LeaseLost()
    assert claim_steps(workflow.community_id, lease_seconds=30) == []
    with pytest.raises(CommunityNotWritable):
        cancel_run(workflow.community_id, run.pk)
    assert run_until_idle(other.community_id) == 2
    assert run_state(healthy) == "succeeded"
    assert states(run) == {"send": "waiting", "after": "pending"}
    assert reap_workflow_steps().total == 0


def test_purge_removes_every_engine_row_of_the_community_and_nothing_else(workflow):
    other = WorkflowFactory(community=CommunityFactory())
    for wf in (workflow, other):
        start(
            wf, {"steps": [send_step("send", [random32()]), {"key": "ok", "kind": "approval", "deadline_seconds": 60}]}
        )
        run_until_idle(wf.community_id)
    before = {m: m._base_manager.filter(community_id=other.community_id).count() for m in ENGINE_MODELS}
    assert all(before.values())
    advance_to(workflow.community, "fenced")
    result = services.purge_community(workflow.community_id)
    assert result.tombstoned
    assert result.deleted["buzz_workflows.Step"] == 2 and result.deleted["buzz_workflows.Approval"] == 1
    for model in ENGINE_MODELS:
        assert model._base_manager.filter(community_id=workflow.community_id).count() == 0
    assert {m: m._base_manager.filter(community_id=other.community_id).count() for m in ENGINE_MODELS} == before


def test_the_tombstone_move_is_refused_while_engine_rows_are_left(workflow):
    start(workflow, {"steps": [function_step("a")]})
    advance_to(workflow.community, "fenced")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT set_config('buzz_delivery.purge_community', %s, true),"
            " set_config('buzz_delivery.purge_fence_generation', %s, true)",
            [
                str(workflow.community_id),
                str(workflow.community.__class__.objects.get(id=workflow.community_id).fence_generation),
            ],
        )
        for table in ("buzz_delivery_delivery_record", "buzz_delivery_event"):
            cursor.execute(f"DELETE FROM {table} WHERE community_id = %s", [workflow.community_id])
    from django.db import DatabaseError, transaction

    with pytest.raises(DatabaseError, match="workflow engine rows"), transaction.atomic(), connection.cursor() as c:
        c.execute(
            "UPDATE buzz_delivery_community SET deletion_state = 'tombstone' WHERE id = %s", [workflow.community_id]
        )


def test_terminal_steps_and_runs_never_change_state_even_through_raw_sql(workflow):
    from django.db import DatabaseError, transaction

    run = start(workflow, {"steps": [function_step("a")]})
    run_until_idle(workflow.community_id)
    for sql in (
        "UPDATE buzz_workflows_step SET state = 'ready', finished_at = NULL WHERE run_id = %s",
        "UPDATE buzz_workflows_run SET state = 'running', finished_at = NULL WHERE run_id = %s",
    ):
        with (
            pytest.raises(DatabaseError, match="terminal state never changes"),
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            cursor.execute(sql, [run.pk])


def test_a_wait_timeout_ends_a_waiting_step(workflow):
    run = start(workflow, {"steps": [send_step("send", [random32()], wait_timeout_seconds=1)]})
    run_until_idle(workflow.community_id)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_workflows_step SET wait_deadline = now() - interval '1 second',"
            " waiting_since = now() - interval '1 hour' WHERE run_id = %s",
            [run.pk],
        )
    assert reap_workflow_steps().wait_timed_out == 1
    assert get_run(workflow.community_id, run.pk).step("send").failure_code == "wait_timeout"
    assert run_state(run) == "failed"


def test_a_run_past_its_deadline_fails_and_its_pending_deliveries_expire(workflow):
    from buzz_delivery.services import Cause
    from buzz_delivery.workflows.services import publish_definition, start_run

    publish_definition(workflow.community_id, workflow.id, {"steps": [send_step("send", [random32(), random32()])]})
    run = start_run(workflow.community_id, workflow.id, {}, cause=Cause.event(random32()), deadline_seconds=60)
    assert run.deadline_at is not None
    run_until_idle(workflow.community_id)
    assert reap_workflow_steps().runs_timed_out == 0
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_workflows_run SET deadline_at = now() - interval '1 second' WHERE run_id = %s", [run.pk]
        )
    assert reap_workflow_steps().runs_timed_out == 1
    run.refresh_from_db()
    assert (run.state, run.failure_code) == ("failed", "run_deadline")
    assert states(run) == {"send": "canceled"}
    assert [d.status for d in deliveries(run)] == ["expired", "expired"]


def test_a_step_failing_the_run_expires_the_runs_pending_deliveries(workflow):
    run = start(
        workflow,
        {"steps": [send_step("send", [random32()]), function_step("bad", "test.boom", retry={"max_attempts": 1})]},
    )
    claims = {c.step.key: c for c in claim_steps(workflow.community_id, limit=10, lease_seconds=30)}
    executor.execute(claims["send"])  # the deliveries are committed and pending
    executor.execute(claims["bad"])  # fails the run
    assert run_state(run) == "failed"
    assert [(d.status, d.failure_code) for d in deliveries(run)] == [("expired", "run_canceled")]


def test_deliveries_left_pending_by_a_run_failed_in_the_fan_in_trigger_are_expired_by_the_maintenance(workflow):
    bad, other = random32(), random32()
    run = start(workflow, {"steps": [send_step("a", [bad]), send_step("b", [other])]})
    run_until_idle(workflow.community_id)
    claim = services.claim_delivery(workflow.community_id, bad, lease_seconds=30)
    services.finish_delivery(claim.lease, "failed")  # step a fails under fail_run inside the trigger
    run.refresh_from_db()
    assert (run.state, run.deliveries_to_expire) == ("failed", True)
    left = WorkflowAgentDelivery.objects.get(run_id=run.pk, target_pubkey=other)
    assert left.status == "pending"
    result = reap_workflow_steps()
    assert result.deliveries_expired == 1
    left = WorkflowAgentDelivery.objects.get(run_id=run.pk, target_pubkey=other)
    assert (left.status, left.failure_code) == ("expired", "run_canceled")
    run.refresh_from_db()
    assert run.deliveries_to_expire is False
    assert reap_workflow_steps().deliveries_expired == 0


def test_a_sub_workflow_step_that_times_out_cancels_its_child_run(workflow):
    """The parent gave up waiting: its child run must not go on (sending, waiting for
    approvals) under a run that no longer waits for it, nor outlive a parent that succeeded."""
    from buzz_delivery.workflows.services import publish_definition

    child_wf = WorkflowFactory(community=workflow.community)
    publish_definition(workflow.community_id, child_wf.id, {"steps": [send_step("inner", [random32()])]})
    sub = {"key": "sub", "kind": "sub_workflow", "workflow": str(child_wf.id), "wait_timeout_seconds": 60}
    run = start(workflow, {"steps": [{**sub, "on_error": "continue"}]})
    run_until_idle(workflow.community_id)
    child = Run.objects.get(parent_run_id=run.pk)
    assert states(child) == {"inner": "waiting"}
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_workflows_step SET wait_deadline = now() - interval '1 second',"
            " waiting_since = now() - interval '1 hour' WHERE run_id = %s",
            [run.pk],
        )
    assert reap_workflow_steps().wait_timed_out == 1
    assert get_run(workflow.community_id, run.pk).step("sub").failure_code == "wait_timeout"
    assert run_state(run) == "succeeded"
    child.refresh_from_db()
    assert (child.state, states(child)) == ("canceled", {"inner": "canceled"})
    assert [(d.status, d.failure_code) for d in deliveries(child)] == [("expired", "run_canceled")]


def test_send_message_reads_only_what_its_deliveries_bind_to_of_its_run(workflow):
    """The send reads its run's workflow, version, cause, trace context and priority in one
    narrow statement, not the run's input and output (issue 31: the ORM read every column of
    the run for every send)."""
    targets = [random32() for _ in range(2)]
    run = start(workflow, {"steps": [send_step("send", targets)]}, {"big": "x" * 1000})
    (claim,) = claim_steps(workflow.community_id, limit=1, lease_seconds=30)

    with CaptureQueriesContext(connection) as ctx:
        assert executor.execute(claim) == Settled("waiting")

    reads = [q["sql"] for q in ctx.captured_queries if "buzz_workflows_run" in q["sql"] and "SELECT" in q["sql"]]
    assert reads and not any('"input"' in sql or ".input" in sql or "r.output" in sql for sql in reads), reads
    assert len([d for d in deliveries(run) if d.cause_kind == "event"]) == 2
