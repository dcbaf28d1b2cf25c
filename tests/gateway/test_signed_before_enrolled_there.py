"""Review of issue 29: an event signed before its key was enrolled cannot be used after the
enrollment (replay.py's admission rule). With the key enrolled elsewhere, such an event (held
back, never sent) was admitted, and the communities the admission returns included the one the
key was enrolled in only after it signed: it acted there. The list now holds only the
communities where the enrollment predates the signature, as the admission judges it."""

from __future__ import annotations

import json
import os
import time
import uuid

import httpx
import pytest

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import intake_event
from buzz_delivery.gateway import nip98
from buzz_delivery.gateway.client import GatewayClient
from buzz_delivery.gateway.models import Enrollment
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory
from tests.gateway.support import deliver, enroll

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("wait", [0, 1])  # 1: a long-poll, whose later rounds read the enrollments again
def test_an_event_signed_before_the_key_was_enrolled_in_a_community_does_not_act_there(wait, gateway_server):
    # Through the session's gunicorn: a long-poll served in this process would start the wake
    # hub's LISTEN connection here, which outlives the test and holds the test database open.
    before, later = CommunityFactory(), CommunityFactory()
    base = gateway_server.base
    agent = GatewayClient(base, os.urandom(32))
    enroll(agent, before)
    Enrollment.objects.filter(community_id=before.id).update(enrolled_at="2020-01-01T00:00:00Z")  # long before
    body = json.dumps({"limit": 5, "wait_seconds": wait}, separators=(",", ":")).encode()
    signed_at = int(time.time()) - 10  # within the window; held back, never sent
    event = nip98.sign_event(agent._key, base + "/deliveries/claim", "POST", body, created_at=signed_at)
    enroll(agent, later)  # enrolled_at: now, after the signature
    deliver(later, agent.pubkey, 1)
    answer = httpx.post(
        base + "/deliveries/claim", content=body, timeout=10 + wait,
        headers={"Content-Type": "application/json", "Authorization": nip98.encode_header(event)},
    )  # fmt: skip
    assert answer.status_code == 200, answer.content
    assert answer.json()["claims"] == []
    assert not WorkflowAgentDelivery.objects.filter(community_id=later.id, status="claimed").exists()


@pytest.mark.parametrize("wait", [0, 1])
def test_a_run_claim_signed_before_the_key_was_enrolled_in_a_community_claims_no_run_there(wait, gateway_server):
    """The agent-run routes keep to the same bound: the run claim (and every run route) judges
    enrollment by the communities the request's admission read, enrolled no later than it was
    signed; they read the enrollments afresh before."""
    before, later = CommunityFactory(), CommunityFactory()
    base = gateway_server.base
    agent = GatewayClient(base, os.urandom(32))
    enroll(agent, before)
    Enrollment.objects.filter(community_id=before.id).update(enrolled_at="2020-01-01T00:00:00Z")
    body = json.dumps(
        {"limit": 5, "wait_seconds": wait, "lease_seconds": None, "worker_id": None}, separators=(",", ":")
    ).encode()
    signed_at = int(time.time()) - 10
    event = nip98.sign_event(agent._key, base + "/runs/claim", "POST", body, created_at=signed_at)
    enroll(agent, later)
    intake_event(later.id, "test", uuid.uuid4().hex, {}, agent.pubkey, timeout_seconds=3600)
    answer = httpx.post(
        base + "/runs/claim", content=body, timeout=10 + wait,
        headers={"Content-Type": "application/json", "Authorization": nip98.encode_header(event)},
    )  # fmt: skip
    assert answer.status_code == 200, answer.content
    assert answer.json()["claims"] == []
    assert not AgentRun.objects.filter(community_id=later.id).exclude(state="pending").exists()
    assert agent.claim_runs(5) != []  # signed now: enrolled there when signed, it claims the run
