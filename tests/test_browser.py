"""The admin in a real headless Chromium (SPEC section 8): log in, filter the delivery list to
claimed, force-fail one delivery; follow the admin index to the dashboard and its throughput chart,
see the live workers list and the delivery list at 1400 pixels; a workflow run's DAG, an agent
run's journal, and the approvals queue deciding an approval once; save screenshots under
``artifacts/`` (git-ignored).

Needs the Debian package ``chromium`` (``/usr/bin/chromium``) and the Python package
``playwright`` (its driver only: Playwright never downloads a browser here). Skips, saying
which is missing, when either is absent. Run with ``pytest -m browser``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from django.contrib.auth.models import User

from buzz_delivery import models
from buzz_delivery.testing import CommunityFactory
from tests.operator_support import ROOT, claimed

CHROMIUM = Path(os.environ.get("BUZZ_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = ROOT / "artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = pytest.mark.browser


@pytest.fixture
def sync_playwright():
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the Python package playwright is not installed (pip install playwright)")
    return sync_playwright


@pytest.mark.django_db(transaction=True)
def test_an_operator_force_fails_a_claimed_delivery_in_a_real_browser(live_server, sync_playwright):
    # Database work happens before and after the browser runs: Playwright's sync API keeps an
    # event loop in this thread, where Django refuses ORM calls.
    User.objects.create_superuser("operator", "operator@example.com", "correct horse battery")
    community = CommunityFactory(name="acme")
    victim, lease = claimed(community, step_id="send_reply")
    bystander, _ = claimed(community, step_id="send_digest")
    ARTIFACTS.mkdir(exist_ok=True)
    list_url = f"{live_server.url}/admin/buzz_delivery/workflowagentdelivery/?status__exact=claimed"

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 900})
            page.goto(
                f"{live_server.url}/admin/login/?next=/admin/buzz_delivery/workflowagentdelivery/"
                "%3Fstatus__exact%3Dclaimed"
            )
            page.fill("#id_username", "operator")
            page.fill("#id_password", "correct horse battery")
            page.click("input[type=submit]")
            page.wait_for_url(list_url)
            assert page.locator("input[name=_selected_action]").count() == 2
            page.screenshot(path=str(ARTIFACTS / "admin_claimed_deliveries.png"), full_page=True)

            page.check(f"input[name=_selected_action][value='{victim.pk}']")
            page.select_option("select[name=action]", "force_fail_selected")
            page.click("button[name=index]")
            message = page.locator("ul.messagelist li").first.inner_text()
            remaining = page.locator("input[name=_selected_action]").count()
            page.screenshot(path=str(ARTIFACTS / "admin_force_failed.png"), full_page=True)

            page.goto(f"{live_server.url}/admin/buzz_delivery/workflowagentdelivery/dashboard/")
            dashboard_title = page.locator("h1").first.inner_text()
            page.screenshot(path=str(ARTIFACTS / "admin_dashboard.png"), full_page=True)
        finally:
            browser.close()

    assert message.startswith("Force-failed 1 delivery.")
    assert remaining == 1  # the list, still filtered to claimed, lost the failed row
    assert dashboard_title == "Delivery dashboard"
    after = models.WorkflowAgentDelivery.objects.get(pk=victim.pk)
    assert (after.status, after.failure_code) == ("failed", "operator_force_failed")
    assert after.lease_generation == lease.lease_generation + 1
    assert models.WorkflowAgentDelivery.objects.get(pk=bystander.pk).status == "claimed"
    assert (ARTIFACTS / "admin_force_failed.png").stat().st_size > 10_000


@pytest.mark.django_db(transaction=True)
def test_the_dashboard_chart_live_workers_and_the_delivery_list_at_1400_pixels(live_server, sync_playwright):
    import uuid

    from buzz_delivery import services
    from buzz_delivery.workflows.testing import RunFactory
    from tests.operator_support import pending, settled

    User.objects.create_superuser("operator", "operator@example.com", "correct horse battery")
    community = CommunityFactory(name="acme support (production)")
    for outcome in ("finished", "finished", "failed"):
        settled(community, outcome)
    claimed(community, step_id="send_reply")
    # Rows as wide as real ones get: a worker's holder name (host:pid:name), a long step id, a
    # failure code, a retry waiting for its next attempt.
    busy = pending(community, step_id="notify_customer_about_the_refund")
    services.claim_delivery(
        community.pk,
        bytes(busy.target_pubkey),
        delivery_id=busy.pk,
        holder="worker-host-1.eu-west.internal:424242:run_delivery_worker",
    )
    _, lease = claimed(community, step_id="escalate_to_a_human")
    services.finish_delivery(lease, "failed", failure_code="attempts_exhausted")
    _, lease = claimed(community, step_id="send_summary")
    services.finish_delivery(lease, "retry", failure_message="the mail server said try later")
    RunFactory()
    services.heartbeat_worker(
        services.WorkerIdentity(
            uuid.uuid4(), "delivery", "worker-host-1", 4242, "run_delivery_worker", "community=acme"
        )
    )
    ARTIFACTS.mkdir(exist_ok=True)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{live_server.url}/admin/login/?next=/admin/")
            page.fill("#id_username", "operator")
            page.fill("#id_password", "correct horse battery")
            page.click("input[type=submit]")
            page.wait_for_url(f"{live_server.url}/admin/")
            page.click("#buzz-delivery-dashboard-link a:text('Dashboard')")
            page.wait_for_url("**/dashboard/")
            chart = page.locator("#bd-throughput svg.bd-chart").bounding_box()
            page.screenshot(path=str(ARTIFACTS / "admin_dashboard_chart.png"), full_page=True)

            page.goto(f"{live_server.url}/admin/buzz_delivery/workerregistration/")
            workers = page.locator("#result_list tbody tr").all_inner_texts()
            page.screenshot(path=str(ARTIFACTS / "admin_live_workers.png"), full_page=True)

            page.goto(f"{live_server.url}/admin/buzz_delivery/workflowagentdelivery/")
            # Both sidebars open: the navigation sidebar and the filters.
            sidebars = page.evaluate(
                "() => [document.querySelector('#nav-sidebar').getBoundingClientRect().width,"
                " document.querySelector('#changelist-filter').getBoundingClientRect().width,"
                " document.querySelector('#main').classList.contains('shifted')]"
            )
            # The table would scroll inside its own box (.results) if it were wider than that box.
            widths = page.evaluate(
                "() => [document.querySelector('#result_list').scrollWidth,"
                " document.querySelector('#changelist .results').clientWidth,"
                " document.documentElement.scrollWidth]"
            )
            rows = page.locator("#result_list tbody tr").count()
            page.screenshot(path=str(ARTIFACTS / "admin_deliveries_1400.png"), full_page=True)
        finally:
            browser.close()

    assert chart is not None and chart["width"] > 300 and chart["height"] > 100
    assert len(workers) == 1 and "worker-host-1" in workers[0] and "4242" in workers[0]
    # With the navigation and filter sidebars open, the delivery table fits its box at 1400
    # pixels (it does not scroll sideways), and neither does the page.
    print(f"delivery table: {widths[0]} px in a {widths[1]} px box, page {widths[2]} px; sidebars {sidebars}")
    assert sidebars[0] > 200 and sidebars[1] > 150 and sidebars[2] is True
    assert rows == 7
    assert widths[0] <= widths[1], f"the delivery table is {widths[0]} px wide in a {widths[1]} px box"
    assert widths[2] <= 1400


@pytest.mark.django_db(transaction=True)
def test_a_run_dag_an_agent_journal_and_the_approvals_queue_deciding_once(
    live_server, sync_playwright, tmp_path, monkeypatch
):
    from buzz_delivery.agents.runtime import run_claim
    from buzz_delivery.agents.services import claim_agent_runs
    from buzz_delivery.testing import WorkflowFactory, random32
    from buzz_delivery.workflows.models import Approval
    from buzz_delivery.workflows.testing import function_step, run_until_idle, send_step
    from tests import agent_handlers as h
    from tests.agents_support import AGENT, new_run
    from tests.wf_support import start

    monkeypatch.setenv("AGENT_LEDGER", str(tmp_path / "ledger.txt"))
    User.objects.create_superuser("operator", "operator@example.com", "correct horse battery")
    community = CommunityFactory(name="acme")
    run = start(
        WorkflowFactory(community=community),
        {
            "steps": [
                send_step("send", [random32()]),
                function_step("after", depends_on=["send"]),
                {"key": "ok", "kind": "approval", "deadline_seconds": 600},
            ]
        },
    )
    run_until_idle(community.id)
    agent_run = new_run(community.id)
    (claim,) = claim_agent_runs(community.id, [AGENT], worker_id="w")
    run_claim(claim, h.four_calls_fail)
    approval = Approval.objects.get(community_id=community.id)
    ARTIFACTS.mkdir(exist_ok=True)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{live_server.url}/admin/login/?next=/admin/")
            page.fill("#id_username", "operator")
            page.fill("#id_password", "correct horse battery")
            page.click("input[type=submit]")
            page.wait_for_url(f"{live_server.url}/admin/")

            page.goto(f"{live_server.url}/admin/buzz_workflows/run/{run.pk}/change/")
            dag = page.locator("svg[aria-label='workflow run DAG']").bounding_box()
            dag_text = page.locator("svg[aria-label='workflow run DAG']").inner_html()
            page.screenshot(path=str(ARTIFACTS / "admin_run_dag.png"), full_page=True)

            page.goto(f"{live_server.url}/admin/buzz_agents/agentrun/{agent_run}/change/")
            journal = page.locator("#content-main").inner_text()
            page.screenshot(path=str(ARTIFACTS / "admin_agent_journal.png"), full_page=True)

            queue = f"{live_server.url}/admin/buzz_workflows/approval/"
            decisions = []
            for _ in range(2):  # the second try finds it decided
                page.goto(queue)
                page.check(f"input[name=_selected_action][value='{approval.pk}']")
                page.select_option("select[name=action]", "approve")
                page.click("button[name=index]")
                page.wait_for_load_state()
                decisions.append(page.locator("ul.messagelist").inner_text())
            page.screenshot(path=str(ARTIFACTS / "admin_approvals_decided.png"), full_page=True)
        finally:
            browser.close()

    assert dag is not None and dag["width"] > 100 and "send" in dag_text and "after" in dag_text
    assert "call effect" in journal and journal.count("compensation: compensated") == 3
    decided = Approval.objects.get(pk=approval.pk)
    assert (decided.state, decided.decided_by) == ("approved", "operator")
    assert "Approved 1" in decisions[0] and "already approved by operator" in decisions[1], decisions
