"""Engine waits (issue 33, SPEC 16): ``sleep`` steps (until a time or for a duration, no lease
held, woken by the maintenance or the orchestrator's poll on the database clock), ``wait_event``
steps and ``send_event`` (events before, during and after the wait; timeouts under each policy;
the key computed from the run), exactly once, through the fenced services."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.exceptions import ValidationError
from django.db import connection

from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.testing import CommunityFactory, WorkflowFactory, advance_to
from buzz_delivery.workflows.models import Run, SentEvent, Step
from buzz_delivery.workflows.services import Canceled, cancel_run, end_due_waits, send_event
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from buzz_delivery.workflows.testing import function_step, run_until_idle
from tests.wf_support import counts, run_state, start, states

pytestmark = pytest.mark.django_db


def step(run, key: str) -> Step:
    return Step.objects.get(community_id=run.community_id, run_id=run.pk, key=key)


def backdate_wait(run, key: str, seconds: float = 1) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_workflows_step SET wait_deadline = now() - make_interval(secs => %s),"
            " waiting_since = now() - interval '1 day' WHERE run_id = %s AND key = %s AND state = 'waiting'",
            [seconds, run.pk, key],
        )


def sleep_then(after: str = "after", **sleep: object) -> dict:
    return {"steps": [{"key": "nap", "kind": "sleep", **sleep}, function_step(after, "echo", depends_on=["nap"])]}


# --- sleep ---------------------------------------------------------------------------------


def test_a_sleep_parks_without_a_lease_until_the_maintenance_wakes_it(community):
    run = start(WorkflowFactory(community=community), sleep_then(seconds=600))
    run_until_idle(community.id)
    nap = step(run, "nap")
    assert (nap.state, nap.lease_until, nap.claimed_at, nap.on_timeout) == ("waiting", None, None, "continue")
    assert dt.timedelta(seconds=590) < nap.wait_deadline - nap.waiting_since <= dt.timedelta(seconds=600)
    assert reap_workflow_steps().woken == 0  # not due yet
    backdate_wait(run, "nap")
    result = reap_workflow_steps()
    assert (result.woken, result.wait_timed_out) == (1, 0)
    nap.refresh_from_db()
    assert (nap.state, nap.output, nap.wait_deadline) == ("succeeded", None, None)
    assert states(run)["after"] == "ready"
    run_until_idle(community.id)
    assert run_state(run) == "succeeded"


def test_the_orchestrators_poll_wakes_a_due_sleep_too(community):
    run = start(WorkflowFactory(community=community), sleep_then(seconds=600))
    run_until_idle(community.id)
    assert end_due_waits(community.id).woken == 0
    backdate_wait(run, "nap")
    assert end_due_waits(community.id).woken == 1
    assert end_due_waits(community.id).woken == 0  # once
    assert states(run) == {"nap": "succeeded", "after": "ready"}


def test_a_sleep_for_a_duration_from_the_input_and_until_a_time_from_a_dependency(community):
    run = start(
        WorkflowFactory(community=community),
        {
            "steps": [
                {"key": "nap", "kind": "sleep", "seconds": {"$ref": "input.delay"}},
                function_step("when", "echo", input={"at": "2000-01-01T00:00:00Z"}),
                {"key": "until", "kind": "sleep", "until": {"$ref": "steps.when.output.at"}, "depends_on": ["when"]},
            ]
        },
        {"delay": 90},
    )
    run_until_idle(community.id)
    nap = step(run, "nap")
    assert nap.state == "waiting" and dt.timedelta(seconds=85) < nap.wait_deadline - nap.waiting_since
    assert step(run, "until").state == "succeeded"  # a time already past: done at once, no wait


def test_a_sleep_until_a_time_to_come_waits_for_that_exact_time(community):
    at = dt.datetime(2999, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    run = start(WorkflowFactory(community=community), sleep_then(until=at.isoformat()))
    run_until_idle(community.id)
    assert step(run, "nap").wait_deadline == at


@pytest.mark.parametrize("delay", ["soon", -5, None, True])
def test_a_sleep_whose_duration_resolves_to_nonsense_fails_once(community, delay):
    run = start(WorkflowFactory(community=community), sleep_then(seconds={"$ref": "input.delay"}), {"delay": delay})
    run_until_idle(community.id)
    nap = step(run, "nap")
    assert (nap.state, nap.failure_code, nap.attempts) == ("failed", "sleep_invalid", 1)
    assert run_state(run) == "failed"


def test_cancel_while_sleeping_ends_the_step_once_and_the_wake_finds_nothing(community):
    run = start(WorkflowFactory(community=community), sleep_then(seconds=600))
    run_until_idle(community.id)
    assert isinstance(cancel_run(community.id, run.pk), Canceled)
    backdate_wait(run, "nap")
    assert reap_workflow_steps().woken == 0 and end_due_waits(community.id).woken == 0
    assert states(run) == {"nap": "canceled", "after": "canceled"}


# --- wait_event ----------------------------------------------------------------------------


def waiting_for(key: object = {"$ref": "input.order"}, **wait: object) -> dict:
    return {
        "steps": [
            {"key": "paid", "kind": "wait_event", "event": "payment", "event_key": key, **wait},
            function_step("ship", "echo", depends_on=["paid"], input={"p": {"$ref": "steps.paid.output"}}),
        ]
    }


def test_an_event_sent_during_the_wait_resumes_the_step_once_with_its_payload(community):
    workflow = WorkflowFactory(community=community)
    run = start(workflow, waiting_for(wait_timeout_seconds=600), {"order": "o-1"})
    other = start(workflow, waiting_for(wait_timeout_seconds=600), {"order": "o-2"})
    run_until_idle(community.id)
    paid = step(run, "paid")
    assert (paid.state, paid.event_name, paid.event_key, paid.lease_until) == ("waiting", "payment", "o-1", None)

    sent = send_event(community.id, "payment", "o-1", {"amount": 12})

    assert sent.resumed == 1
    paid.refresh_from_db()
    assert (paid.state, paid.output) == ("succeeded", {"amount": 12})
    assert [e["event"] for e in paid.history][-1] == "event"
    assert states(other)["paid"] == "waiting"  # another key
    assert send_event(community.id, "payment", "o-1", {"amount": 99}).resumed == 0  # once
    paid.refresh_from_db()
    assert paid.output == {"amount": 12}
    run_until_idle(community.id)
    assert step(run, "ship").output == {"p": {"amount": 12}}


def test_an_event_sent_before_the_wait_is_kept_and_taken_when_the_wait_starts(community):
    sent = send_event(community.id, "payment", "o-7", ["early"])
    assert sent.resumed == 0
    run = start(WorkflowFactory(community=community), waiting_for(), {"order": "o-7"})
    run_until_idle(community.id)
    paid = step(run, "paid")
    assert (paid.state, paid.output) == ("succeeded", ["early"])
    assert SentEvent.objects.get(community_id=community.id, name="payment", key="o-7").resumed == 1


def test_an_event_past_its_keeping_window_is_not_taken(community):
    send_event(community.id, "payment", "o-8", 1)
    SentEvent.objects.filter(community_id=community.id).update(expires_at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    run = start(WorkflowFactory(community=community), waiting_for(), {"order": "o-8"})
    run_until_idle(community.id)
    assert step(run, "paid").state == "waiting"
    assert reap_workflow_steps().events_pruned >= 1
    assert send_event(community.id, "payment", "o-8", 2).resumed == 1


def test_an_event_after_the_timeout_resumes_nothing(community):
    run = start(WorkflowFactory(community=community), waiting_for(wait_timeout_seconds=60), {"order": "o-9"})
    run_until_idle(community.id)
    backdate_wait(run, "paid")
    assert reap_workflow_steps().wait_timed_out == 1
    assert send_event(community.id, "payment", "o-9", 1).resumed == 0
    paid = step(run, "paid")
    assert (paid.state, paid.failure_code) == ("failed", "wait_timeout")
    assert run_state(run) == "failed"


@pytest.mark.parametrize(
    ("policy", "paid", "ship", "run_ends"),
    [
        ("fail", "failed", "canceled", "failed"),
        ("continue", "succeeded", "ready", "running"),
        ("skip_dependents", "skipped", "skipped", "succeeded"),
    ],
)
def test_a_timeout_does_what_the_policy_says(community, policy, paid, ship, run_ends):
    run = start(
        WorkflowFactory(community=community),
        waiting_for(wait_timeout_seconds=60, on_timeout=policy),
        {"order": "o"},
    )
    run_until_idle(community.id)
    backdate_wait(run, "paid")
    assert end_due_waits(community.id).timed_out == 1
    assert states(run) == {"paid": paid, "ship": ship}
    assert run_state(run) == run_ends
    if policy == "continue":
        assert step(run, "paid").output is None


def test_the_key_is_computed_from_parts_of_the_run(community):
    run = start(
        WorkflowFactory(community=community),
        waiting_for(["order", {"$ref": "input.n"}, {"$ref": "input.region"}]),
        {"n": 42, "region": "eu"},
    )
    run_until_idle(community.id)
    assert step(run, "paid").event_key == "order:42:eu"
    assert send_event(community.id, "payment", "order:42:eu", None).resumed == 1


def test_a_key_that_resolves_to_nothing_fails_the_step(community):
    run = start(WorkflowFactory(community=community), waiting_for(), {})
    run_until_idle(community.id)
    paid = step(run, "paid")
    assert (paid.state, paid.failure_code) == ("failed", "event_key_invalid")


def test_an_event_of_another_community_resumes_nothing_here(community):
    run = start(WorkflowFactory(community=community), waiting_for(), {"order": "x"})
    run_until_idle(community.id)
    assert send_event(CommunityFactory().id, "payment", "x", 1).resumed == 0
    assert step(run, "paid").state == "waiting"


def test_cancel_while_waiting_leaves_the_event_for_nobody(community):
    run = start(WorkflowFactory(community=community), waiting_for(), {"order": "c"})
    run_until_idle(community.id)
    cancel_run(community.id, run.pk)
    assert send_event(community.id, "payment", "c", 1).resumed == 0
    assert step(run, "paid").state == "canceled"


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("not-a-uuid", "payment", "k", 1), "community_id"),
        ((None, "bad name", "k", 1), "name"),
        ((None, "", "k", 1), "name"),
        ((None, "payment", "", 1), "key"),
        ((None, "payment", 5, 1), "key"),
        ((None, "payment", "k" * 501, 1), "key"),
        ((None, "payment", "k", float("nan")), "payload"),
        ((None, "payment", "k", {"x": "\x00"}), "payload"),
    ],
)
def test_bad_send_event_arguments_are_refused_by_name_and_nothing_is_written(community, args, field):
    args = (args[0] or community.id, *args[1:])
    before = {**counts(), "sent": SentEvent.objects.count()}
    with pytest.raises(ValidationError) as exc:
        send_event(*args)
    assert field in exc.value.message_dict
    assert {**counts(), "sent": SentEvent.objects.count()} == before


def test_a_fenced_community_takes_no_event(community):
    advance_to(community, "quiescing")
    with pytest.raises(CommunityNotWritable):
        send_event(community.id, "payment", "k", 1)
    assert SentEvent.objects.count() == 0


def test_a_run_of_many_waits_ends_when_each_got_its_event(community):
    run = start(
        WorkflowFactory(community=community),
        {"steps": [{"key": f"w{i}", "kind": "wait_event", "event": "tick", "event_key": str(i)} for i in range(3)]},
    )
    run_until_idle(community.id)
    for i in range(3):
        assert send_event(community.id, "tick", str(i), i).resumed == 1
    assert Run.objects.get(pk=run.pk).output == {"w0": 0, "w1": 1, "w2": 2}
