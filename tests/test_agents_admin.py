"""The agent runs' admin (SPEC 12): read-only pages, the journal timeline, the cancel action
behind its own permission, agent approvals in the engine's queue."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.urls import reverse

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import claim_agent_runs
from tests import agent_handlers as h
from tests.agents_support import AGENT, new_run

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_LEDGER", str(tmp_path / "ledger.txt"))
    monkeypatch.delenv("AGENT_KILL", raising=False)


def client_with(*perms: str) -> Client:
    user = User.objects.create_user(f"u{User.objects.count()}", is_staff=True)
    for app, codename in (("buzz_agents", "view_agentrun"), ("buzz_workflows", "view_approval"), *perms):
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app, codename=codename))
    client = Client()
    client.force_login(user)
    return client


def test_a_run_page_shows_its_journal_as_a_timeline_with_compensations(community):
    run_id = new_run(community.id)
    (claim,) = claim_agent_runs(community.id, [AGENT], worker_id="w")
    run_claim(claim, h.four_calls_fail)
    client = client_with()
    listing = client.get(reverse("admin:buzz_agents_agentrun_changelist"))
    assert listing.status_code == 200
    assert reverse("admin:buzz_agents_agentrun_add").encode() not in listing.content
    html = client.get(reverse("admin:buzz_agents_agentrun_change", args=[run_id])).content.decode()
    assert "call effect" in html and "call explode" in html
    assert html.count("compensation: compensated") == 3
    assert "result: failed" in html


def test_agent_approvals_are_listed_in_the_engine_queue(community):
    run_id = new_run(community.id)
    (claim,) = claim_agent_runs(community.id, [AGENT], worker_id="w")
    assert run_claim(claim, h.approve_then_call) == "parked"
    client = client_with()
    assert client.get(reverse("admin:buzz_workflows_approval_changelist")).status_code == 200
    approval = AgentRun.objects.get(id=run_id).approval_id
    assert client.get(reverse("admin:buzz_workflows_approval_change", args=[approval])).status_code == 200
    html = client.get(reverse("admin:buzz_agents_agentrun_change", args=[run_id])).content.decode()
    assert "approval requested" in html


def test_cancel_needs_its_own_permission_and_goes_through_the_service(community):
    run_id = new_run(community.id)
    url = reverse("admin:buzz_agents_agentrun_changelist")
    data = {"action": "cancel_runs", "_selected_action": [str(run_id)]}
    client_with().post(url, data)
    assert AgentRun.objects.get(id=run_id).state == "pending"
    response = client_with(("buzz_agents", "cancel_agent_run")).post(url, data, follow=True)
    assert AgentRun.objects.get(id=run_id).state == "cancelled"
    again = client_with(("buzz_agents", "cancel_agent_run")).post(url, data, follow=True)
    assert any("already cancelled" in str(m) for m in again.context["messages"])
    assert response.status_code == 200


def _plan(queryset) -> str:
    """The plan of ``queryset`` with sequential scans and sorts priced out: the one the planner
    takes on a big table (here the table is tiny, so a scan would always win)."""
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("SET LOCAL enable_sort = off")
    return queryset.explain()


def test_the_list_is_served_newest_first_by_an_index_on_the_id(community):
    """At a million runs the list sorted the whole table for each page (0.8 s; the primary key
    leads with community_id) and the detail page scanned it for the id: ag_run_id_idx."""
    first, newest = new_run(community.id), new_run(community.id)
    client = client_with()
    response = client.get(reverse("admin:buzz_agents_agentrun_changelist"))
    cl = response.context["cl"]
    assert [run.pk for run in cl.result_list] == [newest, first]
    plan = _plan(cl.queryset[:100])
    assert "Index Scan Backward using ag_run_id_idx" in plan and "Sort" not in plan, plan
    assert "ag_run_id_idx" in _plan(AgentRun.objects.filter(pk=first))


@pytest.mark.parametrize(
    ("params", "index"),
    [
        ({"state__exact": "failed"}, "ag_run_failed_idx"),
        ({"state__exact": "waiting_approval"}, "ag_run_waiting_approval_idx"),
        ({"shadow__exact": "1"}, "ag_run_shadow_idx"),
    ],
)
def test_the_filters_on_rare_values_read_only_their_rows(community, params, index):
    """A few rows spread over the whole table: at a million runs each filter's capped count read
    all of it (0.25-0.3 s); a partial index holds only those rows."""
    new_run(community.id)
    response = client_with().get(reverse("admin:buzz_agents_agentrun_changelist"), params)
    assert response.status_code == 200
    cl = response.context["cl"]
    assert index in _plan(cl.queryset[:100])
    assert index in _plan(cl.queryset.order_by().values("pk")[:10_001])  # the capped count
