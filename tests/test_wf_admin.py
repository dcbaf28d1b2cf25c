"""The workflow engine's admin (SPEC section 11): read-only pages, the run page's DAG and
"why not running" lines, and fenced actions behind their own permissions."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.models import Approval, Run, Step
from buzz_delivery.workflows.services import decide_approval
from buzz_delivery.workflows.testing import function_step, run_until_idle, send_step
from tests.wf_support import start

pytestmark = pytest.mark.django_db


def client_with(*perms: str) -> Client:
    user = User.objects.create_user(f"u{User.objects.count()}", is_staff=True)
    for codename in ("view_run", "view_step", "view_approval", "view_definitionversion", *perms):
        user.user_permissions.add(Permission.objects.get(content_type__app_label="buzz_workflows", codename=codename))
    client = Client()
    client.force_login(user)
    return client


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


@pytest.fixture
def workflow(community):
    return WorkflowFactory(community=community)


def test_every_engine_page_renders_read_only(workflow):
    run = start(
        workflow,
        {
            "steps": [
                send_step("send", [random32(), random32()]),
                function_step("b", depends_on=["send"]),
                {"key": "ok", "kind": "approval", "deadline_seconds": 60},
            ]
        },
    )
    run_until_idle(workflow.community_id)
    client = client_with()
    for name in ("run", "step", "approval", "definitionversion"):
        response = client.get(reverse(f"admin:buzz_workflows_{name}_changelist"))
        assert response.status_code == 200, name
        assert reverse(f"admin:buzz_workflows_{name}_add").encode() not in response.content
    page = client.get(reverse("admin:buzz_workflows_run_change", args=[run.pk]))
    assert page.status_code == 200
    html = page.content.decode()
    assert "<svg" in html and "send" in html
    assert "waiting for 2 of 2 deliveries, 0 failed" in html
    assert "waiting for dependencies: 0 of 1 done" in html
    assert "waiting for approval since" in html
    assert client.post(reverse("admin:buzz_workflows_run_change", args=[run.pk]), {}).status_code == 403


def test_cancel_needs_its_permission_and_goes_through_the_service(workflow):
    run = start(workflow, {"steps": [function_step("a")]})
    url = reverse("admin:buzz_workflows_run_changelist")
    viewer = client_with()
    assert "cancel_runs" not in viewer.get(url).content.decode()
    response = viewer.post(url, {"action": "cancel_runs", "_selected_action": [run.pk]}, follow=True)
    assert Run.objects.get(pk=run.pk).state == "running"
    operator = client_with("cancel_engine_run")
    response = operator.post(url, {"action": "cancel_runs", "_selected_action": [run.pk]}, follow=True)
    assert Run.objects.get(pk=run.pk).state == "canceled"
    assert any("Canceled 1" in m for m in messages_of(response))
    response = operator.post(url, {"action": "cancel_runs", "_selected_action": [run.pk]}, follow=True)
    assert any("already canceled" in m for m in messages_of(response))


def test_restart_and_retry_failed_step_start_a_new_run(workflow):
    run = start(
        workflow,
        {"steps": [function_step("a"), function_step("b", "test.boom", depends_on=["a"], retry={"max_attempts": 1})]},
    )
    run_until_idle(workflow.community_id)
    operator = client_with("restart_engine_run", "retry_engine_step")
    step = run.steps.get(key="b")
    response = operator.post(
        reverse("admin:buzz_workflows_step_changelist"),
        {"action": "retry_failed_steps", "_selected_action": [step.pk]},
        follow=True,
    )
    assert any("Retried 1" in m for m in messages_of(response))
    restarted = Run.objects.get(restart_of_id=run.pk)
    assert dict(restarted.steps.values_list("key", "state")) == {"a": "succeeded", "b": "ready"}


def test_the_loser_of_an_approval_race_is_told_who_decided_first(workflow):
    start(workflow, {"steps": [{"key": "ok", "kind": "approval", "deadline_seconds": 60}]})
    run_until_idle(workflow.community_id)
    approval = Approval.objects.get()
    url = reverse("admin:buzz_workflows_approval_changelist")
    client_with().post(url, {"action": "approve", "_selected_action": [approval.pk]}, follow=True)
    assert Approval.objects.get().state == "pending"  # no decide_approval permission: nothing done
    decide_approval(approval.community_id, approval.id, "approved", "alice")
    response = client_with("decide_approval").post(
        url, {"action": "reject", "_selected_action": [approval.pk]}, follow=True
    )
    assert any("already approved by alice" in m for m in messages_of(response))
    assert Approval.objects.get().state == "approved"


def _plan(queryset) -> str:
    """The plan of ``queryset`` with sequential scans and sorts priced out: the one the planner
    takes on a big table (here every table is tiny, so a scan would always win)."""
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("SET LOCAL enable_sort = off")
    return queryset.explain()


def _changelist(client: Client, name: str, **params: str):
    response = client.get(reverse(f"admin:buzz_workflows_{name}_changelist"), params)
    assert response.status_code == 200, name
    return response


def test_engine_lists_are_served_newest_first_by_an_index_on_the_id(workflow):
    """At a million rows the lists sorted the whole table for each page (the primary keys lead
    with community_id) and every listed step or approval fetched its run by scanning the runs
    (14 s for the approvals list): wf_run_id_idx and wf_step_id_idx serve both."""
    run = start(workflow, {"steps": [function_step("a"), {"key": "ok", "kind": "approval", "deadline_seconds": 60}]})
    run_until_idle(workflow.community_id)
    client = client_with()
    runs = _changelist(client, "run").context["cl"]
    assert runs.result_list[0].pk == run.pk
    plan = _plan(runs.queryset[:100])
    assert "Index Scan Backward using wf_run_id_idx" in plan and "Sort" not in plan, plan
    steps = _changelist(client, "step").context["cl"]
    plan = _plan(steps.queryset[:100])
    assert "Index Scan Backward using wf_step_id_idx" in plan and "Sort" not in plan, plan
    assert "wf_run_id_idx" in plan, plan  # each listed step's run (the "run" column), by its id
    approvals = _changelist(client, "approval").context["cl"]
    assert "wf_run_id_idx" in _plan(approvals.queryset[:100])
    run_page = client.get(reverse("admin:buzz_workflows_run_change", args=[run.pk]))
    assert run_page.status_code == 200
    assert "wf_run_id_idx" in _plan(Run.objects.filter(pk=run.pk))


def test_step_and_approval_lists_cost_no_statement_per_row(workflow):
    approval_steps = [{"key": f"ok{i}", "kind": "approval", "deadline_seconds": 60} for i in range(3)]
    start(workflow, {"steps": approval_steps[:1]})
    run_until_idle(workflow.community_id)
    client = client_with()
    few = {}
    for name in ("run", "step", "approval"):
        with CaptureQueriesContext(connection) as ctx:
            _changelist(client, name)
        few[name] = len(ctx.captured_queries)
    for _ in range(3):
        start(workflow, {"steps": [function_step("a"), *approval_steps]})
    run_until_idle(workflow.community_id)
    assert Approval.objects.count() == 10 and Step.objects.count() == 13
    for name in ("run", "step", "approval"):
        with CaptureQueriesContext(connection) as ctx:
            response = _changelist(client, name)
        assert len(response.context["cl"].result_list) > 1
        assert len(ctx.captured_queries) == few[name], (name, [q["sql"] for q in ctx.captured_queries])
    assert "waiting for approval since" in _changelist(client, "step").content.decode()


def test_the_failed_filter_of_the_steps_and_runs_lists_reads_only_failed_rows(workflow):
    """Failed steps and runs are few and spread out: at a million rows the filter's capped count
    read the whole steps table (0.35 s) and a quarter of the runs'; wf_step_failed_idx and
    wf_run_failed_idx hold only them."""
    start(workflow, {"steps": [function_step("a"), function_step("b", "test.boom", retry={"max_attempts": 1})]})
    run_until_idle(workflow.community_id)
    client = client_with()
    cl = _changelist(client, "step", state__exact="failed").context["cl"]
    assert [step.key for step in cl.result_list] == ["b"]
    assert "wf_step_failed_idx" in _plan(cl.queryset[:100])
    assert "wf_step_failed_idx" in _plan(cl.queryset.order_by().values("pk")[:10_001])  # the capped count
    cl = _changelist(client, "run", state__exact="failed").context["cl"]  # the same for the runs
    assert len(cl.result_list) == 1
    assert "wf_run_failed_idx" in _plan(cl.queryset[:100])
    assert "wf_run_failed_idx" in _plan(cl.queryset.order_by().values("pk")[:10_001])


def test_the_approvals_queue_lists_pending_first_then_oldest_first(workflow):
    for _ in range(3):
        start(workflow, {"steps": [{"key": "ok", "kind": "approval", "deadline_seconds": 60}]})
    run_until_idle(workflow.community_id)
    oldest = Approval.objects.order_by("requested_at", "-pk").first()
    decide_approval(oldest.community_id, oldest.id, "approved", "alice")
    pending = Approval.objects.filter(state="pending").order_by("requested_at", "-pk")  # -pk: the list's tie-break
    cl = _changelist(client_with(), "approval").context["cl"]
    assert [a.pk for a in cl.result_list] == [*(a.pk for a in pending), oldest.pk]


def test_the_run_page_says_what_sleeps_waits_and_maps_wait_for(workflow):
    run = start(
        workflow,
        {
            "steps": [
                {"key": "nap", "kind": "sleep", "seconds": 600},
                {
                    "key": "paid",
                    "kind": "wait_event",
                    "event": "payment",
                    "event_key": "o-1",
                    "wait_timeout_seconds": 60,
                },
                {
                    "key": "each",
                    "kind": "map",
                    "over": {"$ref": "input.xs"},
                    "do": {"kind": "function", "function": "noop"},
                },
            ]
        },
        {"xs": [1, 2]},
    )
    from buzz_delivery.workflows import executor
    from buzz_delivery.workflows.services import claim_steps

    for claim in claim_steps(workflow.community_id, limit=10):
        executor.execute(claim)
    html = client_with().get(reverse("admin:buzz_workflows_run_change", args=[run.pk])).content.decode()
    assert "sleeping until" in html
    assert "waiting for event &#x27;payment&#x27; key &#x27;o-1&#x27;" in html and "then fail" in html
    assert "map: 0 of 2 items done" in html


def test_sending_the_awaited_event_needs_its_permission_and_resumes_each_step_once(workflow):
    runs = [
        start(workflow, {"steps": [{"key": "paid", "kind": "wait_event", "event": "payment", "event_key": "o-1"}]})
        for _ in range(2)
    ]
    other = start(workflow, {"steps": [function_step("a")]})
    run_until_idle(workflow.community_id)
    waiting = [Step.objects.get(run_id=r.pk, key="paid") for r in runs]
    done = Step.objects.get(run_id=other.pk, key="a")
    url = reverse("admin:buzz_workflows_step_changelist")
    viewer = client_with()
    viewer.post(url, {"action": "send_awaited_events", "_selected_action": [s.pk for s in waiting]}, follow=True)
    assert {s.state for s in Step.objects.filter(pk__in=[s.pk for s in waiting])} == {"waiting"}
    operator = client_with("send_workflow_event")
    response = operator.post(
        url, {"action": "send_awaited_events", "_selected_action": [*(s.pk for s in waiting), done.pk]}, follow=True
    )
    rows = Step.objects.filter(pk__in=[s.pk for s in waiting])
    assert {(s.state, s.output["via"]) for s in rows} == {("succeeded", "admin")}
    assert all([e["event"] for e in s.history].count("event") == 1 for s in rows)
    assert any("Sent the event of 2" in m and "not waiting for an event" in m for m in messages_of(response))
