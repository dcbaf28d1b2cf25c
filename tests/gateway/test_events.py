"""The gateway's workflow events route (issue 33): a remote agent, enrolled in a community,
sends an event that resumes the steps of that community waiting for it; a key enrolled
elsewhere, or a bad field, is refused and nothing is written (SPEC 14, 16)."""

from __future__ import annotations

import httpx
import pytest
from jsonschema import Draft202012Validator

from buzz_delivery.testing import CommunityFactory, WorkflowFactory
from buzz_delivery.workflows.models import SentEvent, Step
from buzz_delivery.workflows.testing import run_until_idle
from tests.gateway.support import enroll, new_agent
from tests.wf_support import start

pytestmark = pytest.mark.django_db(transaction=True)


def waiting_run(community):
    run = start(
        WorkflowFactory(community=community),
        {"steps": [{"key": "paid", "kind": "wait_event", "event": "payment", "event_key": {"$ref": "input.order"}}]},
        {"order": "o-1"},
    )
    run_until_idle(community.id)
    return run


def test_an_enrolled_agent_sends_an_event_that_resumes_the_waiting_step(gateway_server):
    community = CommunityFactory()
    run = waiting_run(community)
    agent = new_agent(gateway_server)
    enroll(agent, community)

    response = agent.request(
        "POST", f"/communities/{community.id}/events", {"name": "payment", "key": "o-1", "payload": {"ok": True}}
    )

    assert response.status_code == 200, response.text
    assert response.json()["resumed"] == 1 and response.json()["kept_until"].endswith("Z")
    doc = httpx.get(gateway_server.base + "/openapi.json", timeout=10).json()
    Draft202012Validator({**doc, "$ref": "#/components/schemas/SendEventResponse"}).validate(response.json())
    step = Step.objects.get(run_id=run.pk, key="paid")
    assert (step.state, step.output) == ("succeeded", {"ok": True})
    assert agent.send_event(str(community.id), "payment", "o-1", 2)["resumed"] == 0  # once


def test_a_key_not_enrolled_there_is_refused_and_nothing_is_written(gateway_server):
    community = CommunityFactory()
    run = waiting_run(community)
    agent = new_agent(gateway_server)
    enroll(agent, CommunityFactory())  # elsewhere

    response = agent.request("POST", f"/communities/{community.id}/events", {"name": "payment", "key": "o-1"})

    assert (response.status_code, response.json()["code"]) == (403, "not_enrolled")
    assert Step.objects.get(run_id=run.pk, key="paid").state == "waiting"
    assert not SentEvent.objects.filter(community_id=community.id, sends__gt=0).exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "bad name", "key": "k"}, "name"),
        ({"name": "payment"}, "key"),
        ({"name": "payment", "key": "k", "extra": 1}, "extra"),
        ({"name": "payment", "key": ""}, "key"),
    ],
)
def test_a_bad_field_is_named_and_nothing_is_written(gateway_server, body, field):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)

    response = agent.request("POST", f"/communities/{community.id}/events", body)

    assert (response.status_code, response.json().get("field")) == (400, field), response.text
    assert not SentEvent.objects.filter(community_id=community.id).exists()
