"""What an operator reads at a glance on each admin page (issue 36): bounded JSON, short holder
keys, one time format on detail pages, actions only where they can succeed, approvals linked to
what asked for them and back, live pages that refresh themselves, and signals that read right."""

from __future__ import annotations

import re
import uuid

import pytest
from django.db import connection
from django.urls import reverse

from buzz_delivery import services
from buzz_delivery.testing import CommunityFactory, Expr, WorkflowFactory, random32, set_delivery_state
from tests.operator_support import claimed, pending

pytestmark = pytest.mark.django_db

STAMP = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}"


def _set_snapshots(delivery_id: object, trace: str, context: str) -> None:
    """Snapshots never change once committed: a legacy row, written with the triggers off."""
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL session_replication_role = replica")
        set_delivery_state(
            delivery_id, execution_trace=Expr("%s::jsonb", [trace]), trigger_context=Expr("%s::jsonb", [context])
        )
        cursor.execute("SET LOCAL session_replication_role = origin")


def test_a_stored_json_value_1000_deep_or_1_mb_large_renders_cut_with_a_note(admin_client, community):
    """Loading such a row through the ORM raised RecursionError in Python's JSON parser (a 500);
    the page reads each JSON field as the database's text, at most 20,000 characters of it."""
    delivery = pending(community)
    _set_snapshots(delivery.pk, "[" * 1000 + "]" * 1000, '{"blob": "' + "x" * 1_000_000 + '", "n": 1}')

    response = admin_client.get(reverse("admin:buzz_delivery_workflowagentdelivery_change", args=[delivery.pk]))

    assert response.status_code == 200
    html = response.content.decode()
    assert "Nested too deep to indent (2,000 characters)." in html
    assert "Truncated: the first 20,000 of 1,000,020 characters, as stored (not indented)." in html
    assert len(html) < 200_000


def test_json_is_indented_and_escaped_never_a_python_repr(admin_client, community):
    delivery = pending(community)
    _set_snapshots(delivery.pk, '{"reconciled": true, "html": "<b>"}', "null")

    html = admin_client.get(
        reverse("admin:buzz_delivery_workflowagentdelivery_change", args=[delivery.pk])
    ).content.decode()

    # jsonb keeps an object's keys shorter first
    assert "{\n  &quot;html&quot;: &quot;&lt;b&gt;&quot;,\n  &quot;reconciled&quot;: true\n}" in html
    assert "{'reconciled': True" not in html and "<b>" not in html.split("Snapshots")[1]


def test_a_gateway_holder_is_a_short_key_in_the_list_and_whole_on_the_page(admin_client, community):
    key = random32()
    delivery = pending(community, target_pubkey=key)
    services.claim_delivery(community.pk, key, delivery_id=delivery.pk, holder=f"gateway:{key.hex()}")

    listing = admin_client.get(reverse("admin:buzz_delivery_workflowagentdelivery_changelist")).content.decode()
    page = admin_client.get(
        reverse("admin:buzz_delivery_workflowagentdelivery_change", args=[delivery.pk])
    ).content.decode()

    short = f"gateway:{key.hex()[:8]}…{key.hex()[-4:]}"
    assert f'<code title="gateway:{key.hex()}">{short}</code>' in listing
    assert f">gateway:{key.hex()}<" in page


def test_detail_pages_write_times_in_the_one_format_and_say_the_zone_once(admin_client, community):
    delivery, _ = claimed(community)

    html = admin_client.get(
        reverse("admin:buzz_delivery_workflowagentdelivery_change", args=[delivery.pk])
    ).content.decode()

    claimed_at = re.search(r"Claimed at:</label>\s*<div class=\"readonly\">(.*?)</div>", html, re.S)
    assert claimed_at is not None and re.fullmatch(STAMP, claimed_at.group(1).strip()), claimed_at
    assert html.count('class="bd-time-note') == 1 and "YYYY-MM-DD HH:MM:SS</span>, UTC." in html
    assert "a.m." not in html and "p.m." not in html


def test_requeue_is_offered_only_in_an_active_community(admin_client):
    active, leaving = CommunityFactory(name="active"), CommunityFactory(name="leaving")
    pages = {}
    for community in (active, leaving):
        _, lease = claimed(community)
        services.finish_delivery(lease, "failed", failure_code="handler_error")
        pages[community.name] = lease.delivery_id
    services.advance_community(leaving.pk, "quiescing")

    def buttons(delivery_id: object) -> list[str]:
        html = admin_client.get(
            reverse("admin:buzz_delivery_workflowagentdelivery_change", args=[delivery_id])
        ).content.decode()
        return re.findall(r'name="action" value="(\w+)"', html)

    assert buttons(pages["active"]) == ["requeue_selected"]
    assert buttons(pages["leaving"]) == []  # the service would refuse it: the community is fenced


def test_a_bad_delivery_id_is_a_404_not_a_500(admin_client):
    assert admin_client.get("/admin/buzz_delivery/workflowagentdelivery/not-a-uuid/change/").status_code in (302, 404)


def test_approvals_link_what_asked_for_them_and_back(admin_client, community, tmp_path, monkeypatch):
    from buzz_delivery.agents.models import AgentRun
    from buzz_delivery.agents.services import claim_agent_runs, request_approval
    from buzz_delivery.workflows.models import Approval
    from buzz_delivery.workflows.testing import run_until_idle
    from tests.agents_support import AGENT, new_run
    from tests.wf_support import start

    run = start(WorkflowFactory(community=community), {"steps": [{"key": "ok", "kind": "approval",
                                                                  "deadline_seconds": 600}]})  # fmt: skip
    run_until_idle(community.id)
    engine = Approval.objects.get(run_id=run.pk)
    agent_run = new_run(community.id)
    (claim,) = claim_agent_runs(community.id, [AGENT], worker_id="w")
    asked = request_approval(claim.lease, prompt="may I?", deadline_seconds=600)
    assert AgentRun.objects.get(pk=agent_run).approval_id == asked.approval_id

    queue = admin_client.get(reverse("admin:buzz_workflows_approval_changelist")).content.decode()
    run_page = admin_client.get(reverse("admin:buzz_workflows_run_change", args=[run.pk])).content.decode()
    step_page = admin_client.get(reverse("admin:buzz_workflows_step_change", args=[engine.step_id])).content.decode()
    agent_page = admin_client.get(reverse("admin:buzz_agents_agentrun_change", args=[agent_run])).content.decode()
    found = admin_client.get(reverse("admin:buzz_workflows_approval_changelist"), {"q": str(agent_run)})

    assert reverse("admin:buzz_workflows_run_change", args=[run.pk]) in queue
    assert reverse("admin:buzz_workflows_step_change", args=[engine.step_id]) in queue
    assert reverse("admin:buzz_agents_agentrun_change", args=[agent_run]) in queue
    assert reverse("admin:buzz_workflows_approval_change", args=[engine.pk]) in run_page
    assert reverse("admin:buzz_workflows_approval_change", args=[engine.pk]) in step_page
    assert reverse("admin:buzz_workflows_approval_change", args=[asked.approval_id]) in agent_page
    assert [a.pk for a in found.context["cl"].result_list] == [asked.approval_id]


def test_the_approvals_list_costs_no_statement_per_row_and_probes_the_asking_agent_run_by_index(community):
    from buzz_delivery.agents.services import claim_agent_runs, request_approval
    from tests.agents_support import AGENT, new_run

    for _ in range(3):
        new_run(community.id)
    for claim in claim_agent_runs(community.id, [AGENT], worker_id="w", limit=3):
        request_approval(claim.lease, prompt="may I?", deadline_seconds=600)
    from django.contrib import admin

    from buzz_delivery.workflows.models import Approval

    queryset = admin.site._registry[Approval].get_queryset(None)
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        plan = queryset[:100].explain()
    assert "ag_run_approval_idx" in plan, plan


@pytest.mark.parametrize("live", [True, False])
def test_a_live_run_page_refreshes_itself_and_a_terminal_one_does_not(admin_client, community, live):
    from buzz_delivery.workflows.services import cancel_run
    from buzz_delivery.workflows.testing import function_step
    from tests.agents_support import new_run
    from tests.wf_support import start

    run = start(WorkflowFactory(community=community), {"steps": [function_step("a")]})
    agent_run = new_run(community.id)
    if not live:
        from buzz_delivery.agents.services import cancel_agent_run

        cancel_run(community.id, run.pk)
        cancel_agent_run(community.id, agent_run, reason="test")

    for url in (
        reverse("admin:buzz_workflows_run_change", args=[run.pk]),
        reverse("admin:buzz_agents_agentrun_change", args=[agent_run]),
    ):
        html = admin_client.get(url).content.decode()
        assert ('<meta http-equiv="refresh" content="5">' in html) is live, url
        assert ("reloads every 5 s until the run ends" in html) is live


def test_a_stale_worker_is_a_warning_and_a_long_silent_one_leaves_the_list(admin_client):
    workers = [services.WorkerIdentity(uuid.uuid4(), "delivery", f"host-{n}", 10 + n, "run_delivery_worker")
               for n in range(3)]  # fmt: skip
    for worker in workers:
        services.heartbeat_worker(worker)
    with connection.cursor() as cursor:
        for worker, age in zip(workers[1:], (120, 3600), strict=True):
            cursor.execute(
                "UPDATE buzz_delivery_worker SET last_heartbeat = now() - make_interval(secs => %s) WHERE id = %s",
                [age, worker.id],
            )

    html = admin_client.get(reverse("admin:buzz_delivery_workerregistration_changelist")).content.decode()

    assert "host-0" in html and "host-1" in html and "host-2" not in html  # gone after the prune age
    assert html.count('class="bd-warn"') == 1 and re.search(r"⚠ stale, silent 2 min 0\d s", html)
    assert 'class="bd-ok">live' in html and "icon-yes.svg" not in html
