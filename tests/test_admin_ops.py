"""The operators' admin additions (issue 17): failure code as a column and a filter, time in
status and next attempt in the delivery list, the dashboard linked from the admin index, and
one time format with seconds in every buzz list."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from buzz_delivery import services
from buzz_delivery.testing import insert_delivery_rows
from tests.operator_support import backdate_finished, claimed, pending

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:buzz_delivery_workflowagentdelivery_changelist"
STAMP = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}"


def rows_of(response) -> list[str]:
    """The changelist's result rows, as HTML."""
    return rows_of_html(response.content.decode())


def rows_of_html(html: str) -> list[str]:
    body = html[html.index("<tbody>") : html.index("</tbody>")]
    return re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)


def test_the_failure_code_is_a_column_and_a_filter(admin_client, community):
    bad, lease = claimed(community)
    services.finish_delivery(lease, "failed", failure_code="bad_payload")
    _other, lease = claimed(community)
    services.finish_delivery(lease, "failed", failure_code="quota_gone")
    pending(community)

    listing = admin_client.get(reverse(CHANGELIST))
    filtered = admin_client.get(reverse(CHANGELIST), {"failure_code": "bad_payload"})

    html = listing.content.decode()
    assert "Failure code" in html and "bad_payload" in html and "quota_gone" in html
    # the filter offers the codes seen and the system's own, without counting the table
    assert "?failure_code=bad_payload" in html and "?failure_code=attempts_exhausted" in html
    assert [str(bad.id)[-12:] in row for row in rows_of(filtered)] == [True]


def test_time_in_status_and_next_attempt_are_in_the_list(admin_client, community):
    done, lease = claimed(community)
    services.finish_delivery(lease, "finished")
    backdate_finished(done.id, 3723)  # settled 1 h 02 min 03 s ago
    retried, lease = claimed(community)
    services.finish_delivery(lease, "retry")
    retried.refresh_from_db()

    html = admin_client.get(reverse(CHANGELIST)).content.decode()

    assert "In status" in html and "Lease until / next attempt" in html
    (done_row,) = [row for row in rows_of_html(html) if str(done.id)[-12:] in row]
    assert re.search(r"1 h 02 min 0[34] s", done_row), done_row
    (retried_row,) = [row for row in rows_of_html(html) if str(retried.id)[-12:] in row]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT to_char(%s::timestamptz AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')", [retried.next_attempt_at]
        )
        (shown,) = cursor.fetchone()
    assert f"next attempt {shown}" in retried_row


def test_the_admin_index_links_to_the_dashboard_for_those_who_may_see_it(admin_client, db):
    dashboard = reverse("admin:buzz_delivery_workflowagentdelivery_dashboard")
    stranger = User.objects.create_user("stranger", password="pw", is_staff=True)
    stranger.user_permissions.set(Permission.objects.filter(codename="view_user"))
    other = Client()
    other.force_login(stranger)

    assert f'href="{dashboard}"' in admin_client.get(reverse("admin:index")).content.decode()
    assert f'href="{dashboard}"' not in other.get(reverse("admin:index")).content.decode()


@pytest.mark.parametrize(
    "url_name",
    [
        "admin:buzz_delivery_community_changelist",
        "admin:buzz_delivery_workflow_changelist",
        "admin:buzz_delivery_event_changelist",
        "admin:buzz_workflows_run_changelist",
        "admin:buzz_agents_agentrun_changelist",
    ],
)
def test_every_buzz_list_shows_times_with_seconds_in_one_format(admin_client, community, url_name):
    from buzz_delivery.workflows.testing import RunFactory
    from tests.agents_support import new_run

    pending(community)  # a workflow, a run and an event of the community too
    RunFactory()
    new_run(community.id)

    html = admin_client.get(reverse(url_name)).content.decode()

    cells = re.findall(r'<td class="field-(?:created_at|state_changed_at|finished_at)[^"]*">(.*?)</td>', html)
    assert cells, f"no time column found on {url_name}"
    for cell in cells:
        assert cell in ("—", "-") or re.fullmatch(STAMP, cell), cell
    assert "a.m." not in html and "p.m." not in html


def test_the_dashboard_shows_every_layer_and_a_server_drawn_throughput_chart(admin_client, community):
    from buzz_delivery.workflows.testing import RunFactory
    from tests.agents_support import new_run
    from tests.operator_support import settled

    for _ in range(3):
        settled(community)
    RunFactory()
    RunFactory()
    new_run(community.id)

    response = admin_client.get(reverse("admin:buzz_delivery_workflowagentdelivery_dashboard"))

    assert response.status_code == 200
    board = response.context["dashboard"]
    layers = {layer.title: layer for layer in board.states}
    assert layers["Workflow runs"].counts["running"] == 2 and not layers["Workflow runs"].estimated
    assert layers["Agent runs"].counts["pending"] == 1
    assert sum(board.throughput["deliveries settled"]) == 3
    assert sum(board.throughput["workflow runs started"]) == 2
    assert sum(board.throughput["agent runs started"]) == 1
    assert all(len(values) == 60 for values in board.throughput.values())
    html = response.content.decode()
    chart = html[html.index('id="bd-throughput"') :]
    svg = chart[chart.index("<svg") : chart.index("</svg>")]
    assert 'class="bd-chart"' in svg
    assert re.search(r'<polyline points="[^"]+" [^>]*data-series="deliveries settled" data-total="3"', svg)
    assert 'data-series="workflow runs started" data-total="2"' in svg
    assert "<script" not in html.split('id="bd-throughput"')[1].split("</div>")[0]  # drawn on the server
    # nothing is fetched from another origin: no script, style or image by an absolute URL
    # (a bare "cdn" search once matched a CSRF token's random letters in CI)
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", html, re.IGNORECASE)


def test_uuid7_floor_orders_before_every_id_made_from_that_millisecond():
    import datetime as dt

    from buzz_delivery.admin.dashboard import uuid7_floor
    from buzz_delivery.models import new_uuid7

    before = dt.datetime.now(dt.UTC) - dt.timedelta(milliseconds=5)
    made = new_uuid7()

    assert uuid7_floor(before) < made
    assert uuid7_floor(dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)) > made


def settled_copies(template_id, n: int = 20_000) -> None:
    """``n`` finished copies of one delivery (no failure code), then ANALYZE: a table at scale."""
    insert_delivery_rows(
        ["id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id",
         "message_event_id", "cause_kind", "cause_webhook_invocation_id", "status", "finished_at", "attempt"],
        """SELECT gen_random_uuid(), community_id, workflow_id, run_id, 'bulk-' || g, target_pubkey,
                  definition_event_id, message_event_id, 'webhook', gen_random_uuid(), 'finished', now(), 1
           FROM buzz_delivery_delivery, generate_series(1, %s) AS g WHERE id = %s""",
        [n, template_id],
    )  # fmt: skip
    with connection.cursor() as cursor:  # the view joins both (issue 31, stage 2)
        cursor.execute("ANALYZE buzz_delivery_delivery_record, buzz_delivery_delivery_queue")


def test_the_failure_code_filter_reads_its_partial_index_among_many_rows(community):
    from buzz_delivery.models import WorkflowAgentDelivery

    template, lease = claimed(community)
    services.finish_delivery(lease, "failed", failure_code="bad_payload")
    settled_copies(template.id)  # many settled rows without a code, like a real table
    listed = WorkflowAgentDelivery.objects.filter(failure_code="bad_payload").order_by("-created_at", "-pk")[:100]

    plan = listed.explain()

    assert "delivery_failure_code_idx" in plan, plan
    assert [d.id for d in listed] == [template.id]


def test_the_delivery_list_and_the_failure_code_filter_read_the_age_index_among_many_rows(community, rf):
    # Its predicate (models.CREATED_FLOOR) keeps the claim off it; the admin states it.
    from django.contrib import admin as django_admin
    from django.test.utils import CaptureQueriesContext

    from buzz_delivery.admin.filters import FailureCodeFilter
    from buzz_delivery.models import WorkflowAgentDelivery

    template, _lease = claimed(community)
    settled_copies(template.id)
    model_admin = django_admin.site._registry[WorkflowAgentDelivery]
    listed = model_admin.get_queryset(rf.get("/")).order_by("-created_at", "-pk")[:100]
    with CaptureQueriesContext(connection) as queries:  # the filter reads the newest rows' codes
        FailureCodeFilter(rf.get("/"), {}, WorkflowAgentDelivery, model_admin)
    (newest,) = [q["sql"] for q in queries.captured_queries if "failure_code" in q["sql"]]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + newest)
        filter_plan = "\n".join(line for (line,) in cursor.fetchall())

    assert "delivery_created_idx" in listed.explain()
    assert "delivery_created_idx" in filter_plan, filter_plan


@pytest.mark.parametrize(
    ("params", "owner"),
    [
        ({"status__exact": "claimed"}, "buzz_delivery_delivery_queue"),
        ({"status__exact": "pending"}, "buzz_delivery_delivery_queue"),
        ({"lease_expired": "yes"}, "buzz_delivery_delivery_queue"),
        ({"lease_expired": "no"}, "buzz_delivery_delivery_queue"),
    ],
)
def test_the_live_state_filters_read_the_queue_not_the_views_merged_status(admin_client, params, owner):
    """Issue 31, stage 2 (``bench/results/queue-design-plan.md`` 2.4): through the view, whose
    status merges the queue's and the record's (a CASE over the LEFT JOIN), a list by a live
    status probes the queue for every row it walks until a page matches. The live filters
    narrow by id, read from the queue (``filters.by_state``: why the terminal ones do not)."""
    from django.urls import reverse

    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(reverse("admin:buzz_delivery_workflowagentdelivery_changelist"), params)
    assert response.status_code == 200
    # The page's listing (ordered; Django 6.1 leaves out its LIMIT on an empty page, and quotes
    # the subquery's alias where 5.2 does not).
    (listing,) = [q["sql"] for q in queries.captured_queries if " ORDER BY " in q["sql"] and owner in q["sql"]]

    subquery = rf'"buzz_delivery_delivery"\."id" IN \(SELECT "?U0"?\."id" AS "id" FROM "{owner}" "?U0"?'
    assert re.search(subquery, listing), listing
    where = listing.rsplit(' FROM "buzz_delivery_delivery" ', 1)[1].split(" WHERE ", 1)[1]  # the list's own
    assert '"buzz_delivery_delivery"."status"' not in where, listing
    assert '"buzz_delivery_delivery"."lease_until"' not in where, listing


def test_the_date_links_read_the_ends_of_the_age_index_among_many_rows(admin_client, community):
    # The date hierarchy's two ends of created_at must state the index's predicate too, or they
    # scan the table (found in review after migration 0015); and be ORDER BY ... LIMIT 1 reads,
    # as MIN/MAX through the view joining the live queue scan every row (issue 31, stage 2).
    from django.test.utils import CaptureQueriesContext
    from django.urls import reverse

    template, _lease = claimed(community)
    settled_copies(template.id)
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(reverse("admin:buzz_delivery_workflowagentdelivery_changelist"))
    assert response.status_code == 200
    probes = [
        q["sql"] for q in queries.captured_queries
        if q["sql"].endswith(("ORDER BY 1 ASC LIMIT 1", "ORDER BY 1 DESC LIMIT 1")) and "created_at" in q["sql"]
    ]  # fmt: skip
    assert len(probes) == 2, [q["sql"] for q in queries.captured_queries]
    for probe in probes:
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN " + probe)
            plan = "\n".join(line for (line,) in cursor.fetchall())

        assert "delivery_created_idx" in plan, plan
        assert "Seq Scan" not in plan, plan


def test_each_throughput_line_has_its_own_axis_so_a_few_runs_show_beside_many_deliveries():
    """On one axis scaled to 5,000 deliveries a minute, 3 workflow runs drew a flat line at 0.
    Each series gets its panel and its own axis: the small line reaches the top of its panel."""
    import datetime as dt

    from buzz_delivery.admin.chart import PANEL_HEIGHT, TOP, Series, line_chart

    svg = line_chart(
        [Series("deliveries settled", [5000] * 60), Series("workflow runs started", [0] * 59 + [3])],
        first_minute=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        title="t",
    )

    panels = re.findall(r'<g class="bd-panel" data-panel="([^"]+)" data-max="(\d+)">', svg)
    assert panels == [("deliveries settled", "5000"), ("workflow runs started", "5")]
    runs = re.search(r'<polyline points="([^"]+)"[^>]*data-series="workflow runs started"', svg)
    assert runs is not None
    ys = [float(point.split(",")[1]) for point in runs.group(1).split()]
    top_of_panel, floor = PANEL_HEIGHT + TOP, 2 * PANEL_HEIGHT - 8
    assert ys[-1] < floor - 0.5 * (floor - top_of_panel)  # 3 of 5: above the middle of its panel
