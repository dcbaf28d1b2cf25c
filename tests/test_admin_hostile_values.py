"""The admin renders any stored value and any request (issue 27): JSON nested deeper than Python
can load or print (stored before the gateway bounded it, or by raw SQL), a path id that is not a
UUID, a NUL in a filter. Never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.test import Client
from django.urls import reverse

from buzz_delivery.agents.services import claim_agent_runs, journal_call
from buzz_delivery.testing import DeliveryFactory, EventFactory, Expr, WorkflowRunFactory, set_delivery_state
from tests.agents_support import AGENT, new_run

pytestmark = pytest.mark.django_db

DEEP = 5000  # lists inside lists: Python's json cannot load or dump this (RecursionError)


def deep_json() -> str:
    return "[" * DEEP + "]" * DEEP


@pytest.fixture
def operator() -> Client:
    user = User.objects.create_superuser("op", password="x")
    client = Client(raise_request_exception=False)
    client.force_login(user)
    return client


@contextmanager
def _triggers_off() -> Iterator[None]:
    """Write as no service would (a value stored before the bounds, or by hand): triggers off, for
    the block's transaction (``SET LOCAL``: Citus carries it to the shards, where the
    triggers run; a session ``SET`` stays on the coordinator)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL session_replication_role = replica")
        yield
        cursor.execute("SET LOCAL session_replication_role = origin")


def _raw(statement: str, params: list) -> None:
    """One raw statement with the triggers off (:func:`_triggers_off`)."""
    with _triggers_off(), connection.cursor() as cursor:
        cursor.execute(statement, params)


def test_an_agent_run_page_shows_deeply_nested_input_output_and_journal_values(community, operator):
    run_id = new_run(community.id)
    (claim,) = claim_agent_runs(community.id, [AGENT], worker_id="w")
    journal_call(claim.lease, "t", {"q": 1})
    _raw("UPDATE buzz_agents_run SET input = %s::jsonb, output = %s::jsonb WHERE id = %s", [deep_json()] * 2 + [run_id])
    _raw(
        "UPDATE buzz_agents_journal SET args = %s::jsonb, output = %s::jsonb, compensation = %s::jsonb"
        " WHERE run_id = %s",
        [deep_json()] * 3 + [run_id],
    )
    page = operator.get(reverse("admin:buzz_agents_agentrun_change", args=[run_id]))
    assert page.status_code == 200
    assert "Nested too deep" in page.content.decode()
    assert operator.get(reverse("admin:buzz_agents_agentrun_changelist")).status_code == 200


def test_a_delivery_page_and_an_event_page_show_deeply_nested_snapshots_and_tags(community, operator):
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    delivery = DeliveryFactory(binding__run=run, binding__message_event=event)
    with _triggers_off():
        set_delivery_state(
            delivery.id,
            execution_trace=Expr("%s::jsonb", [deep_json()]),
            trigger_context=Expr("%s::jsonb", [deep_json()]),
        )
    _raw("UPDATE buzz_delivery_event SET tags = %s::jsonb WHERE event_id = %s", [deep_json(), event.event_id])
    assert (
        operator.get(reverse("admin:buzz_delivery_workflowagentdelivery_change", args=[delivery.id])).status_code == 200
    )
    assert operator.get(reverse("admin:buzz_delivery_event_change", args=[event.pk])).status_code == 200


def test_engine_run_and_step_pages_show_deeply_nested_input_and_output(community, operator):
    from buzz_delivery.services import Cause
    from buzz_delivery.testing import WorkflowFactory, random32
    from buzz_delivery.workflows.models import Run, Step
    from buzz_delivery.workflows.services import publish_definition, start_run

    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, {"steps": [{"key": "a", "kind": "function", "function": "noop"}]})
    run_id = start_run(community.id, workflow.id, {}, cause=Cause.event(random32())).pk
    _raw(
        "UPDATE buzz_workflows_run SET input = %s::jsonb, output = %s::jsonb WHERE run_id = %s",
        [deep_json()] * 2 + [run_id],
    )
    _raw("UPDATE buzz_workflows_step SET when_cond = %s::jsonb WHERE run_id = %s", [deep_json(), run_id])
    step = Step.objects.only("id").get(run_id=run_id)
    assert Run.objects.filter(pk=run_id).exists()
    assert operator.get(reverse("admin:buzz_workflows_run_change", args=[run_id])).status_code == 200
    assert operator.get(reverse("admin:buzz_workflows_step_change", args=[step.pk])).status_code == 200
    for name in ("run", "step", "definitionversion", "schedule"):
        assert operator.get(reverse(f"admin:buzz_workflows_{name}_changelist")).status_code == 200, name


@pytest.mark.parametrize("object_id", ["not-a-uuid", "1", "%00", "' OR 1=1 --"])
def test_a_delivery_page_for_an_id_that_is_not_a_uuid_is_a_404_or_redirect_not_a_500(operator, object_id):
    response = operator.get(reverse("admin:buzz_delivery_workflowagentdelivery_changelist") + f"{object_id}/change/")
    assert response.status_code in (302, 404), response.status_code


@pytest.mark.parametrize(
    "query",
    [
        "failure_code=a%00b",
        "status=claimed%00",
        "status__exact=%00",
        "q=%00",
        "community__id__exact=%00",
        "cause_kind=%00",
    ],
)
def test_a_nul_in_a_delivery_list_filter_is_ignored_not_a_500(community, operator, query):
    DeliveryFactory(binding__run=WorkflowRunFactory(community=community))
    response = operator.get(reverse("admin:buzz_delivery_workflowagentdelivery_changelist") + "?" + query)
    assert response.status_code in (200, 302), response.status_code
