"""The admin in a real headless Chromium (SPEC section 8): log in, filter the delivery list to
claimed, force-fail one delivery, and save screenshots under ``artifacts/`` (git-ignored).

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
