"""The Django admin of buzz_delivery (SPEC section 8), through Django's test client."""

from __future__ import annotations

import re

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from buzz_delivery import models, services
from buzz_delivery.admin.paginators import EstimatedCountPaginator
from buzz_delivery.admin.search import hex_prefix_range
from buzz_delivery.testing import BindingFactory, CommunityFactory, DeliveryFactory, EventFactory, advance_to
from tests.operator_support import claimed, lapsed, pending, settled

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:buzz_delivery_workflowagentdelivery_changelist"
DASHBOARD = "admin:buzz_delivery_workflowagentdelivery_dashboard"
DELIVERY_TABLE = "buzz_delivery_delivery"


def changelist(client: Client, **params: str):
    return client.get(reverse(CHANGELIST), params)


def listed_ids(response) -> set[str]:
    """Delivery ids on a changelist page (from the action checkboxes)."""
    return set(re.findall(r'name="_selected_action" value="([0-9a-f-]{36})"', response.content.decode()))


def run_action(client: Client, action: str, *deliveries, **extra: str):
    data = {"action": action, "_selected_action": [str(d.pk) for d in deliveries], **extra}
    return client.post(reverse(CHANGELIST), data, follow=True)


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


@pytest.fixture
def viewer(db) -> Client:
    """A staff user who may view every buzz_delivery model but holds no operator permission."""
    user = User.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="buzz_delivery", codename__startswith="view_")
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def operator(db) -> Client:
    """A staff user with view permissions plus the three delivery operator permissions."""
    user = User.objects.create_user("operator", password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="buzz_delivery").filter(
            codename__in=["view_workflowagentdelivery", "requeue_delivery", "force_fail_delivery", "reap_deliveries"]
        )
    )
    client = Client()
    client.force_login(user)
    return client


# --- lists, filters, search, detail -----------------------------------------------------


def test_changelist_shows_deliveries_with_short_hex_targets(admin_client, community):
    delivery = pending(community)
    response = changelist(admin_client)
    assert response.status_code == 200
    body = response.content.decode()
    assert str(delivery.pk) in listed_ids(response)
    assert delivery.target_hex[:12] in body
    assert f">{delivery.target_hex}<" not in body  # the full key only as a tooltip / on the detail page
    assert "Dashboard" in body


def test_changelist_marks_expired_leases(admin_client, community):
    lapsed(community)
    claimed(community)
    body = changelist(admin_client).content.decode()
    assert body.count(">expired</strong>") == 1


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"status__exact": "claimed"}, {"running", "lapsed"}),
        ({"status__exact": "pending"}, {"waiting"}),
        ({"status__exact": "finished"}, {"done"}),
        ({"lease_expired": "yes"}, {"lapsed"}),
        ({"lease_expired": "no"}, {"running"}),
        ({"cause_kind__exact": "webhook"}, {"waiting", "running", "lapsed", "done"}),
        ({"cause_kind__exact": "event"}, set()),
    ],
)
def test_each_filter_narrows_the_list(admin_client, community, params, expected):
    made = {
        "waiting": pending(community),
        "running": claimed(community)[0],
        "lapsed": lapsed(community),
        "done": settled(community),
    }
    response = changelist(admin_client, **params)
    assert response.status_code == 200
    assert listed_ids(response) == {str(made[name].pk) for name in expected}


def test_community_filter_lists_communities_and_narrows_the_list(admin_client, community):
    other = CommunityFactory(name="zzz-other")
    mine, theirs = pending(community), pending(other)
    page = changelist(admin_client).content.decode()
    assert "zzz-other" in page

    response = changelist(admin_client, community=str(other.pk))

    assert listed_ids(response) == {str(theirs.pk)}
    assert str(mine.pk) not in listed_ids(response)


def test_a_malformed_community_filter_does_not_error(admin_client):
    response = changelist(admin_client, community="not-a-uuid")
    assert response.status_code in (200, 302)


@pytest.fixture
def searchable(community):
    first = pending(community, target_pubkey=bytes.fromhex("ab" * 32), step_id="send_reply")
    second = pending(community, target_pubkey=bytes.fromhex("abc1" + "00" * 30), step_id="send_digest")
    third = pending(community, target_pubkey=bytes.fromhex("ff" * 32), step_id="notify")
    return first, second, third


@pytest.mark.parametrize(
    ("term", "expected"),
    [
        ("ab", {0, 1}),
        ("abc", {1}),  # odd-length prefix
        ("ABAB", {0}),  # case-insensitive
        ("ab" * 32, {0}),  # a whole key
        ("ff", {2}),  # all-f prefix: open upper bound
        ("target:ff", {2}),
        ("send_reply", {0}),  # step, exact
        ("send_", {0, 1}),  # step, prefix
        ("step:notify", {2}),
        ("nothing-like-this", set()),
    ],
)
def test_search_by_target_hex_prefix_and_step(admin_client, searchable, term, expected):
    response = changelist(admin_client, q=term)
    assert response.status_code == 200
    assert listed_ids(response) == {str(searchable[i].pk) for i in expected}


def test_search_by_delivery_uuid_and_by_run_uuid(admin_client, community, searchable):
    first = searchable[0]
    event = models.Event.objects.get(community=community, event_id=first.message_event_id)
    same_run = DeliveryFactory(binding=BindingFactory(run=first.run, message_event=event))
    both = {str(first.pk), str(same_run.pk)}

    assert listed_ids(changelist(admin_client, q=str(first.pk))) == {str(first.pk)}
    assert listed_ids(changelist(admin_client, q=f"id:{first.pk}")) == {str(first.pk)}
    assert listed_ids(changelist(admin_client, q=str(first.run_id))) == both
    assert listed_ids(changelist(admin_client, q=first.run_id.hex)) == both  # undashed UUID
    assert listed_ids(changelist(admin_client, q=str(community.pk))) == set()  # not a delivery or run id


def test_hex_prefix_range_brackets_exactly_the_values_with_that_prefix():
    assert hex_prefix_range("ab") == (b"\xab", b"\xac")
    assert hex_prefix_range("abc") == (b"\xab\xc0", b"\xab\xd0")
    assert hex_prefix_range("a") == (b"\xa0", b"\xb0")
    assert hex_prefix_range("abff") == (b"\xab\xff", b"\xac")
    assert hex_prefix_range("ff") == (b"\xff", None)


def test_detail_page_shows_full_hex_and_every_field_read_only(admin_client, community):
    delivery, _ = claimed(community)
    url = reverse("admin:buzz_delivery_workflowagentdelivery_change", args=[delivery.pk])
    response = admin_client.get(url)
    body = response.content.decode()
    assert response.status_code == 200
    assert delivery.target_hex in body
    assert bytes(delivery.message_event_id).hex() in body
    assert bytes(delivery.definition_event_id).hex() in body
    form = body.split('id="content-main"')[1].split("</form>")[0]
    assert 'name="_save"' not in form and "<textarea" not in form and "<select" not in form
    # nothing editable: only the hidden fields of the action buttons' own forms
    visible = [
        t for t in re.findall(r"<input[^>]*>", form) if "csrfmiddlewaretoken" not in t and 'type="hidden"' not in t
    ]
    assert visible == []


def test_detail_page_links_the_message_event_with_a_preview_of_its_content(admin_client, community):
    delivery, _ = claimed(community)
    event = models.Event.objects.get(community_id=community.id, event_id=delivery.message_event_id)
    models.Event.objects.filter(community_id=community.id, event_id=event.event_id).update(
        content="hello <b>" + "x" * 300
    )
    body = admin_client.get(reverse("admin:buzz_delivery_workflowagentdelivery_change", args=[delivery.pk])).content
    body = body.decode()
    assert f'href="{reverse("admin:buzz_delivery_event_change", args=[event.pk])}"' in body
    assert "hello &lt;b&gt;" + "x" * 191 + "…" in body  # escaped, cut at 200 characters
    assert "x" * 192 not in body


def test_detail_page_buttons_take_the_action_that_applies_to_that_delivery_once(admin_client, viewer, community):
    delivery, _ = claimed(community)
    url = reverse("admin:buzz_delivery_workflowagentdelivery_change", args=[delivery.pk])
    body = admin_client.get(url).content.decode()
    assert 'value="force_fail_selected"' in body and 'value="requeue_selected"' not in body
    assert 'value="force_fail_selected"' not in viewer.get(url).content.decode()  # no permission, no button
    response = admin_client.post(
        reverse("admin:buzz_delivery_workflowagentdelivery_changelist"),
        {"action": "force_fail_selected", "_selected_action": [str(delivery.pk)], "index": "0"},
        follow=True,
    )
    assert response.status_code == 200
    delivery.refresh_from_db()
    assert delivery.status == "failed"
    body = admin_client.get(url).content.decode()
    assert 'value="requeue_selected"' in body and 'value="force_fail_selected"' not in body


# --- nothing can be added, changed or deleted -------------------------------------------


def test_no_delivery_can_be_added_changed_or_deleted_even_by_a_superuser(admin_client, community):
    delivery = pending(community)
    info = "admin:buzz_delivery_workflowagentdelivery"
    assert admin_client.get(reverse(f"{info}_add")).status_code == 403
    change = reverse(f"{info}_change", args=[delivery.pk])
    assert admin_client.post(change, {"status": "finished", "step_id": "x"}).status_code == 403
    assert admin_client.post(reverse(f"{info}_delete", args=[delivery.pk]), {"post": "yes"}).status_code == 403
    after = models.WorkflowAgentDelivery.objects.get(pk=delivery.pk)
    assert (after.status, after.step_id) == ("pending", delivery.step_id)


def test_deletion_state_cannot_be_edited_through_the_community_form(admin_client, community):
    url = reverse("admin:buzz_delivery_community_change", args=[community.pk])
    assert admin_client.post(url, {"deletion_state": "fenced", "name": "x"}).status_code == 403
    community.refresh_from_db()
    assert community.deletion_state == "active"


# --- actions ----------------------------------------------------------------------------


def test_force_fail_action_fails_claimed_deliveries_and_fences_the_holder(operator, community):
    delivery, lease = claimed(community)
    waiting = pending(community)

    response = run_action(operator, "force_fail_selected", delivery, waiting)

    after = models.WorkflowAgentDelivery.objects.get(pk=delivery.pk)
    assert (after.status, after.failure_code) == ("failed", "operator_force_failed")
    assert after.lease_generation == lease.lease_generation + 1
    assert isinstance(services.renew_delivery(lease), services.LeaseLost)
    assert models.WorkflowAgentDelivery.objects.get(pk=waiting.pk).status == "pending"
    (message,) = messages_of(response)
    assert message.startswith("Force-failed 1 delivery.") and "Skipped 1: 1 not claimed" in message
    entry = LogEntry.objects.get(object_id=str(delivery.pk))
    assert "Force-failed" in entry.get_change_message()


def test_requeue_action_returns_failed_deliveries_to_pending(operator, community):
    failed = settled(community, "failed")
    finished = settled(community, "finished")

    response = run_action(operator, "requeue_selected", failed, finished)

    after = models.WorkflowAgentDelivery.objects.get(pk=failed.pk)
    assert (after.status, after.lease_generation) == ("pending", failed.lease_generation + 1)
    assert models.WorkflowAgentDelivery.objects.get(pk=finished.pk).status == "finished"
    (message,) = messages_of(response)
    assert message.startswith("Requeued 1 delivery.") and "Skipped 1" in message
    assert LogEntry.objects.filter(object_id=str(failed.pk)).count() == 1


def test_requeue_in_a_fenced_community_is_skipped_with_the_reason(operator, community):
    failed = settled(community, "failed")
    advance_to(community, "quiescing")

    response = run_action(operator, "requeue_selected", failed)

    assert models.WorkflowAgentDelivery.objects.get(pk=failed.pk).status == "failed"
    (message,) = messages_of(response)
    assert "Requeued 0 deliveries." in message and "community not active" in message


def test_reap_now_action_reaps_expired_leases(operator, community):
    stale = lapsed(community)
    running, _ = claimed(community)

    response = run_action(operator, "reap_expired_now", stale)

    assert models.WorkflowAgentDelivery.objects.get(pk=stale.pk).status == "pending"
    assert models.WorkflowAgentDelivery.objects.get(pk=running.pk).status == "claimed"
    assert any("Reaped all communities: 1 reclaimed" in m for m in messages_of(response))
    assert LogEntry.objects.filter(object_id=str(stale.pk)).exists()


def test_reap_now_is_skipped_while_a_reap_run_holds_the_lease(operator, community):
    stale = lapsed(community)
    services.acquire_run_lease("reap_deliveries", 300, holder="cron:1:x")

    response = run_action(operator, "reap_expired_now", stale)

    assert models.WorkflowAgentDelivery.objects.get(pk=stale.pk).status == "claimed"
    assert any("a reap_deliveries run is active" in m for m in messages_of(response))


@pytest.mark.parametrize("action", ["requeue_selected", "force_fail_selected", "reap_expired_now"])
def test_a_user_without_the_permission_neither_sees_nor_runs_the_action(viewer, community, action):
    delivery, _ = claimed(community)
    backdate = lapsed(community)
    failed = settled(community, "failed")
    page = changelist(viewer).content.decode()
    assert f'value="{action}"' not in page

    run_action(viewer, action, delivery, backdate, failed)

    assert models.WorkflowAgentDelivery.objects.get(pk=delivery.pk).status == "claimed"
    assert models.WorkflowAgentDelivery.objects.get(pk=backdate.pk).status == "claimed"
    assert models.WorkflowAgentDelivery.objects.get(pk=failed.pk).status == "failed"
    assert not LogEntry.objects.exists()


def test_superuser_sees_every_operator_action(admin_client, community):
    pending(community)
    page = changelist(admin_client).content.decode()
    for action in ("requeue_selected", "force_fail_selected", "reap_expired_now"):
        assert f'value="{action}"' in page
    assert 'value="delete_selected"' not in page


def test_advance_lifecycle_asks_for_confirmation_then_moves_one_step(admin_client, community):
    url = reverse("admin:buzz_delivery_community_changelist")
    data = {"action": "advance_lifecycle", "_selected_action": [str(community.pk)]}

    confirm = admin_client.post(url, data)
    assert confirm.status_code == 200 and b"quiescing" in confirm.content
    community.refresh_from_db()
    assert community.deletion_state == "active"  # nothing moved yet

    done = admin_client.post(url, {**data, "post": "yes"}, follow=True)
    community.refresh_from_db()
    assert community.deletion_state == "quiescing"
    assert any(m.startswith("Moved 1 community.") for m in messages_of(done))


def test_advance_lifecycle_to_tombstone_is_skipped_while_rows_remain(admin_client, community):
    pending(community)
    advance_to(community, "fenced")
    url = reverse("admin:buzz_delivery_community_changelist")
    data = {"action": "advance_lifecycle", "_selected_action": [str(community.pk)], "post": "yes"}

    done = admin_client.post(url, data, follow=True)

    community.refresh_from_db()
    assert community.deletion_state == "fenced"
    # It names what purges (the admin has no purge action): an operator was left guessing.
    command = f"manage.py purge_community {community.pk}"
    assert any("Skipped 1" in m and "purge it first" in m and command in m for m in messages_of(done))


def test_advance_lifecycle_needs_the_change_community_permission(viewer, community):
    url = reverse("admin:buzz_delivery_community_changelist")
    viewer.post(url, {"action": "advance_lifecycle", "_selected_action": [str(community.pk)], "post": "yes"})
    community.refresh_from_db()
    assert community.deletion_state == "active"


# --- staying fast ------------------------------------------------------------------------


def unbounded_full_counts(queries: list[dict]) -> list[str]:
    """COUNT(*) statements over the delivery table with neither WHERE nor LIMIT."""
    found = []
    for query in queries:
        sql = query["sql"].upper()
        if "COUNT(" in sql and DELIVERY_TABLE.upper() in sql and "WHERE" not in sql and "LIMIT" not in sql:
            found.append(query["sql"])
    return found


def test_changelist_query_count_is_bounded_and_does_not_grow_with_rows(admin_client, community):
    pending(community)
    with CaptureQueriesContext(connection) as few:
        assert changelist(admin_client).status_code == 200
    for _ in range(20):
        claimed(community)
    with CaptureQueriesContext(connection) as many:
        assert changelist(admin_client).status_code == 200
    assert len(many.captured_queries) == len(few.captured_queries) <= 10
    assert unbounded_full_counts(many.captured_queries) == []
    (result_query,) = [q["sql"] for q in many.captured_queries if '"buzz_delivery_delivery"."step_id"' in q["sql"]]
    assert "execution_trace" not in result_query and "trigger_context" not in result_query
    assert not any("DISTINCT" in q["sql"] and "DATE_TRUNC" in q["sql"].upper() for q in many.captured_queries)


def test_unfiltered_changelist_counts_from_the_planner_estimate_on_a_big_table(admin_client, community, monkeypatch):
    for _ in range(12):
        pending(community)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {DELIVERY_TABLE}_record")
    monkeypatch.setattr(EstimatedCountPaginator, "exact_count_cap", 5)  # "big" = more than 5 rows

    with CaptureQueriesContext(connection) as ctx:
        response = changelist(admin_client)

    assert response.status_code == 200
    assert response.context["cl"].result_count == 12  # reltuples after ANALYZE
    counts = [q["sql"] for q in ctx.captured_queries if "COUNT(" in q["sql"].upper() and DELIVERY_TABLE in q["sql"]]
    assert counts == []
    assert any("reltuples" in q["sql"] for q in ctx.captured_queries)


def test_filtered_changelist_count_is_capped(admin_client, community, monkeypatch):
    for _ in range(8):
        pending(community)
    monkeypatch.setattr(EstimatedCountPaginator, "exact_count_cap", 5)

    with CaptureQueriesContext(connection) as ctx:
        response = changelist(admin_client, status__exact="pending")

    assert response.context["cl"].result_count >= 6  # past the cap: the planner's estimate, at least cap + 1
    counts = [q["sql"] for q in ctx.captured_queries if "COUNT(" in q["sql"].upper() and DELIVERY_TABLE in q["sql"]]
    assert counts and all("LIMIT 6" in sql for sql in counts)


def test_date_drilldown_links_work(admin_client, community):
    delivery = pending(community)
    created = delivery.created_at
    page = changelist(admin_client).content.decode()
    assert f"created_at__year={created.year}" in page
    response = changelist(
        admin_client,
        created_at__year=str(created.year),
        created_at__month=str(created.month),
        created_at__day=str(created.day),
    )
    assert str(delivery.pk) in listed_ids(response)


# --- dashboard ----------------------------------------------------------------------------


def test_dashboard_shows_status_counts_lapsed_leases_and_settled_rate(admin_client, community):
    pending(community)
    lapsed(community)
    for _ in range(3):
        settled(community)

    response = admin_client.get(reverse(DASHBOARD))

    assert response.status_code == 200
    board = response.context["dashboard"]
    assert (board.pending, board.claimed, board.lapsed_leases) == (1, 1, 1)
    assert board.settled_last_hour == 3
    assert board.oldest_pending_age is not None
    (row,) = [c for c in board.communities if c.id == str(community.pk)]
    assert (row.pending, row.claimed, row.lapsed) == (1, 1, 1)
    body = response.content.decode()
    assert 'id="bd-lapsed"' in body and "Reap expired leases now" in body


def test_dashboard_reap_button_reaps_for_a_permitted_user_only(operator, viewer, community):
    stale = lapsed(community)
    assert viewer.post(reverse(DASHBOARD), {"reap": "1"}).status_code == 403
    assert models.WorkflowAgentDelivery.objects.get(pk=stale.pk).status == "claimed"

    response = operator.post(reverse(DASHBOARD), {"reap": "1"}, follow=True)

    assert models.WorkflowAgentDelivery.objects.get(pk=stale.pk).status == "pending"
    assert any("1 reclaimed" in m for m in messages_of(response))


def test_dashboard_needs_the_view_permission(db, community):
    user = User.objects.create_user("nobody", password="pw", is_staff=True)
    client = Client()
    client.force_login(user)
    assert client.get(reverse(DASHBOARD)).status_code == 403


def test_dashboard_query_count_is_bounded(admin_client, community):
    for _ in range(5):
        lapsed(community)
    with CaptureQueriesContext(connection) as ctx:
        assert admin_client.get(reverse(DASHBOARD)).status_code == 200
    # about ten for the deliveries and the request, at most four per other layer shown (workflow
    # runs, agent runs: rows per state and started per minute)
    assert len(ctx.captured_queries) <= 18
    assert unbounded_full_counts(ctx.captured_queries) == []


# --- the other models ----------------------------------------------------------------------


@pytest.mark.parametrize("model", ["community", "workflow", "workflowrun", "event"])
def test_other_lists_and_detail_pages_render_read_only(admin_client, community, model):
    delivery = pending(community)
    obj = {
        "community": community,
        "workflow": delivery.workflow,
        "workflowrun": delivery.run,
        "event": models.Event.objects.get(community=community, event_id=delivery.message_event_id),
    }[model]
    assert admin_client.get(reverse(f"admin:buzz_delivery_{model}_changelist")).status_code == 200
    detail = admin_client.get(reverse(f"admin:buzz_delivery_{model}_change", args=[obj.pk]))
    assert detail.status_code == 200 and 'name="_save"' not in detail.content.decode()
    assert admin_client.get(reverse(f"admin:buzz_delivery_{model}_add")).status_code == 403


def test_event_list_shows_short_hex_and_detail_shows_full_hex(admin_client, community):
    event = EventFactory(community=community)
    hex_id = bytes(event.event_id).hex()
    assert hex_id[:12] in admin_client.get(reverse("admin:buzz_delivery_event_changelist")).content.decode()
    found = admin_client.get(reverse("admin:buzz_delivery_event_changelist"), {"q": hex_id[:7]})
    assert hex_id[:12] in found.content.decode()
    detail = admin_client.get(reverse("admin:buzz_delivery_event_change", args=[event.pk])).content.decode()
    assert hex_id in detail and bytes(event.pubkey).hex() in detail
