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
from buzz_delivery.testing import CommunityFactory, Expr, set_delivery_state
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


# Every time the admin writes: ``YYYY-MM-DD HH:MM:SS``. A date-time written any other way (with
# microseconds or an offset, without seconds, ISO's T) matches TIME_LIKE but not TIME_FORMAT;
# a locale's format ("Dec. 3, 2026, 8:22 a.m.") matches LOCALE_DATE.
TIME_LIKE = r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:[+-]\d{2}:?\d{2}|Z)?"
TIME_FORMAT = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}"
LOCALE_DATE = r"\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? \d{1,2}, \d{4}|\b[ap]\.m\."
OUR_APPS = ("buzz_delivery", "buzz_workflows", "buzz_agents", "buzz_gateway", "buzz_tasks")

# What one page reports: nav and filter sidebars' widths, the page's and the results box's
# overflow, every element inside the results box (or a detail page's read-only values) wider
# than its own box, and the page's text without its JSON blocks (data, not the admin's times).
MEASURE = """() => {
  const rect = (sel) => { const e = document.querySelector(sel); return e ? e.getBoundingClientRect().width : 0; };
  const box = document.querySelector('#changelist .results');
  const scope = box ? [box, ...box.querySelectorAll('*')]
                    : [...document.querySelectorAll('#content-main .readonly, #content-main .readonly *')];
  const clipped = scope.filter(e => e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).display !== 'inline')
    .map(e => `${e.tagName.toLowerCase()}.${[...e.classList].join('.')} ${e.scrollWidth}>${e.clientWidth}`
              + ` "${(e.innerText || '').slice(0, 60)}"`);
  const copy = document.querySelector('#content').cloneNode(true);
  copy.querySelectorAll('pre.bd-json, svg').forEach(e => e.remove());
  return {nav: rect('#nav-sidebar'), filter: rect('#changelist-filter'), page: document.documentElement.scrollWidth,
          view: window.innerWidth, clipped: clipped, text: copy.innerText, status: document.title};
}"""


def _pages(live_url: str, samples: dict[str, object]) -> list[tuple[str, str, bool]]:
    """(name, url, has filters) for the admin index, the dashboard, and every list of our apps
    and one detail page of each (a sample row made by the test)."""
    from django.contrib import admin
    from django.urls import reverse

    pages = [
        ("index", f"{live_url}{reverse('admin:index')}", False),
        ("dashboard", f"{live_url}{reverse('admin:buzz_delivery_workflowagentdelivery_dashboard')}", False),
    ]
    for model in sorted(admin.site._registry, key=lambda m: m._meta.label):
        opts = model._meta
        if opts.app_label not in OUR_APPS:
            continue
        filters = bool(admin.site._registry[model].list_filter) or any(f.name == "community" for f in opts.fields)
        changelist = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
        pages.append((f"{opts.app_label}.{opts.model_name}", f"{live_url}{changelist}", filters))
        pk = samples.get(opts.label_lower)
        if pk is not None:
            url = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[pk])
            pages.append((f"{opts.app_label}.{opts.model_name}.detail", f"{live_url}{url}", False))
    return pages


@pytest.mark.django_db(transaction=True)
def test_every_admin_list_and_page_fits_1400_pixels_and_writes_one_time_format(
    live_server, sync_playwright, tmp_path, monkeypatch
):
    """Every list and one page of each model of every app, at 1400 pixels with the navigation
    and filter sidebars open, with rows as wide as real ones get (a gateway holder's 64-hex key,
    long step ids, a 1 MB and a 1,000-deep JSON value, a stale worker): no list's table is wider
    than its box, no cell wider than itself, no page scrolls sideways, every time is
    ``YYYY-MM-DD HH:MM:SS``; screenshots under artifacts/admin_1400/."""
    import re
    import uuid

    from django.core.management import call_command
    from django.db import connection

    from buzz_delivery import services
    from buzz_delivery.agents.models import AgentRun
    from buzz_delivery.agents.runtime import run_claim
    from buzz_delivery.agents.services import claim_agent_runs
    from buzz_delivery.gateway import services as gateway
    from buzz_delivery.models import Event, MaintenanceRun, Workflow, WorkflowRun
    from buzz_delivery.testing import WorkflowFactory, random32
    from buzz_delivery.workflows.models import Approval, DefinitionVersion, Run, Step
    from buzz_delivery.workflows.testing import function_step, run_until_idle, send_step
    from tests import agent_handlers as h
    from tests.agents_support import AGENT, new_run
    from tests.operator_support import pending, settled
    from tests.wf_support import start

    monkeypatch.setenv("AGENT_LEDGER", str(tmp_path / "ledger.txt"))
    User.objects.create_superuser("operator", "operator@example.com", "correct horse battery")
    community = CommunityFactory(name="acme support (production, europe-west)")
    fenced = CommunityFactory(name="leaving")
    for outcome in ("finished", "failed"):
        settled(community, outcome)
    agent_key = random32()
    held = pending(community, step_id="notify_customer_about_the_refund_of_order_4711", target_pubkey=agent_key)
    services.claim_delivery(community.pk, agent_key, delivery_id=held.pk, holder=f"gateway:{agent_key.hex()}")
    _, lease = claimed(community, step_id="escalate_to_a_human")
    services.finish_delivery(lease, "failed", failure_code="attempts_exhausted")
    _, lease = claimed(fenced, step_id="stranded")
    services.finish_delivery(lease, "failed", failure_code="handler_error")
    services.advance_community(fenced.pk, "quiescing")
    with connection.cursor() as cursor:  # stored values as large and as deep as a row may hold
        # (snapshots never change once committed, and the services refuse such values now: a
        # row from before that, written with the triggers off)
        cursor.execute("SET session_replication_role = replica")
        set_delivery_state(
            held.pk,
            execution_trace=Expr("%s::jsonb", ["[" * 1000 + "]" * 1000]),
            trigger_context=Expr("%s::jsonb", ['{"blob": "' + "x" * 1_000_000 + '"}']),
        )
        cursor.execute("SET session_replication_role = origin")
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
    (claim,) = claim_agent_runs(community.id, [AGENT], worker_id=f"gateway:{AGENT.hex()}")
    run_claim(claim, h.four_calls_fail)
    gateway.enroll(community.id, agent_key, enrolled_by="operator")
    live, stale = (
        services.WorkerIdentity(uuid.uuid4(), "delivery", "worker-host-1.eu-west.internal", 4242, "run_delivery_worker",
                                f"communities={community.id}")
        for _ in range(2)
    )  # fmt: skip
    services.heartbeat_worker(live)
    services.heartbeat_worker(stale)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE buzz_delivery_worker SET last_heartbeat = now() - interval '2 minutes' WHERE id = %s",
                       [stale.id])  # fmt: skip
    call_command("reap_deliveries", stdout=__import__("io").StringIO())
    samples = {
        "buzz_delivery.community": community.pk,
        "buzz_delivery.workflow": Workflow.objects.filter(community=community).first().pk,
        "buzz_delivery.workflowrun": run.pk,
        "buzz_delivery.event": Event.objects.filter(community=community).first().pk,
        "buzz_delivery.workflowagentdelivery": held.pk,
        "buzz_delivery.maintenancerun": MaintenanceRun.objects.first().pk,
        "buzz_delivery.workerregistration": stale.id,
        "buzz_workflows.definitionversion": DefinitionVersion.objects.first().pk,
        "buzz_workflows.run": run.pk,
        "buzz_workflows.step": Step.objects.filter(key="ok").first().pk,
        "buzz_workflows.approval": Approval.objects.first().pk,
        "buzz_agents.agentrun": AgentRun.objects.get(pk=agent_run).pk,
        "buzz_gateway.enrollment": __import__("buzz_delivery.gateway.models", fromlist=["Enrollment"])
        .Enrollment.objects.first()
        .pk,
    }
    assert Run.objects.filter(pk=run.pk).exists() and WorkflowRun.objects.filter(pk=run.pk).exists()
    pages = _pages(live_server.url, samples)
    assert len([p for p in pages if p[0].endswith(".detail")]) == len(samples)
    shots = ARTIFACTS / "admin_1400"
    shots.mkdir(parents=True, exist_ok=True)

    seen: dict[str, dict] = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
            page.goto(f"{live_server.url}/admin/login/?next=/admin/")
            page.fill("#id_username", "operator")
            page.fill("#id_password", "correct horse battery")
            page.click("input[type=submit]")
            page.wait_for_url(f"{live_server.url}/admin/")
            for name, url, _ in pages:
                response = page.goto(url)
                seen[name] = {"code": response.status if response else None, **page.evaluate(MEASURE)}
                page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
        finally:
            browser.close()

    problems = []
    for name, _, filtered in pages:
        got = seen[name]
        if got["code"] != 200:
            problems.append(f"{name}: HTTP {got['code']}")
            continue
        if got["nav"] < 200 and name != "index":  # the index is the navigation itself
            problems.append(f"{name}: the navigation sidebar is not open ({got['nav']} px)")
        if filtered and got["filter"] < 150:
            problems.append(f"{name}: no filter sidebar")
        if got["page"] > got["view"]:
            problems.append(f"{name}: the page scrolls sideways ({got['page']} px in {got['view']})")
        problems += [f"{name}: clipped {c}" for c in got["clipped"]]
        for stamp in re.findall(TIME_LIKE, got["text"]):
            if not re.fullmatch(TIME_FORMAT, stamp):
                problems.append(f"{name}: a time in another format: {stamp!r}")
        problems += [f"{name}: a locale's date: {m!r}" for m in re.findall(LOCALE_DATE, got["text"])]
    assert problems == [], "\n".join(problems)
    times = sum(len(re.findall(TIME_FORMAT, got["text"])) for got in seen.values())
    assert times > 30  # the check saw times on the pages, in the one format
    delivery = seen["buzz_delivery.workflowagentdelivery.detail"]["text"]
    assert f"gateway:{agent_key.hex()}" in delivery  # the detail page has the holder whole
    assert agent_key.hex() not in seen["buzz_delivery.workflowagentdelivery"]["text"]  # the list: short
    workers = seen["buzz_delivery.workerregistration"]["text"]
    assert "stale, silent" in workers and "live" in workers
    assert "Requeue" not in seen["buzz_delivery.workflowagentdelivery.detail"]["text"]
    assert (shots / "buzz_delivery.workflowagentdelivery.png").stat().st_size > 10_000
