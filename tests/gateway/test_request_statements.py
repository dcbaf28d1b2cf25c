"""Issue 29: a claim or a settle batch through the gateway pays no read of its own for the key's
enrollments. The statement that records the request's event id (the replay store) also reads
the active communities the key is enrolled in, and the views take them from there: a claim is
three statements (admission, claim, the messages), a settle batch two (admission, settle), each
its own transaction in autocommit, where they were four and three. The enrollment checks keep
their answers (a community the key is not enrolled in, or no longer active, is still a 403)."""

from __future__ import annotations

import os

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from buzz_delivery.gateway import services as gateway
from buzz_delivery.gateway.client import GatewayClient
from buzz_delivery.testing import CommunityFactory, advance_to
from tests.gateway.support import deliver, enroll
from tests.gateway.test_batch_one_transaction import signed_post

pytestmark = pytest.mark.django_db(transaction=True)

BASE = "http://testserver/gateway/v1"  # served in this process (django.test.Client)


def send(agent: GatewayClient, path: str, payload: dict) -> tuple[object, list[str]]:
    """POST a signed ``payload`` to ``path``; the response and the SQL statements it ran."""
    header, body = signed_post(agent, path, payload)
    with CaptureQueriesContext(connection) as captured:
        answer = Client().post("/gateway/v1" + path, body, content_type="application/json", HTTP_AUTHORIZATION=header)
    return answer, [q["sql"] for q in captured.captured_queries]


def reads_enrollments(statement: str) -> bool:
    return "buzz_gateway_enrollment" in statement


def test_a_claim_and_a_settle_batch_read_the_enrollments_only_in_the_admission_statement():
    community = CommunityFactory()
    agent = GatewayClient(BASE, os.urandom(32))
    enroll(agent, community)
    deliver(community, agent.pubkey, 3)

    answer, statements = send(agent, "/deliveries/claim", {"limit": 3, "wait_seconds": 0})
    assert answer.status_code == 200, answer.content
    claims = answer.json()["claims"]
    assert len(claims) == 3
    assert [reads_enrollments(s) for s in statements].count(True) == 1, statements
    assert reads_enrollments(statements[0]) and "buzz_gateway_seen_event" in statements[0]
    assert len(statements) == 3, statements  # admission, claim, messages

    items = [{"delivery_id": c["delivery"]["id"], "lease_generation": c["lease"]["lease_generation"]} for c in claims]
    path = f"/communities/{community.id}/deliveries/finish"
    answer, statements = send(agent, path, {"deliveries": items, "outcome": "finished"})
    assert answer.status_code == 200, answer.content
    assert [r["outcome"] for r in answer.json()["results"]] == ["settled"] * 3
    assert [reads_enrollments(s) for s in statements].count(True) == 1, statements
    assert len(statements) == 2, statements  # admission, settle


def test_a_batch_into_a_community_the_key_is_not_enrolled_in_or_that_is_not_active_is_still_a_403():
    mine, other, closing = CommunityFactory(), CommunityFactory(), CommunityFactory()
    agent = GatewayClient(BASE, os.urandom(32))
    enroll(agent, mine)
    enroll(agent, closing)
    (delivery,) = deliver(other, agent.pubkey, 1)
    item = {"deliveries": [{"delivery_id": str(delivery.id), "lease_generation": 1}], "outcome": "finished"}
    answer, _ = send(agent, f"/communities/{other.id}/deliveries/finish", item)
    assert (answer.status_code, answer.json()["code"]) == (403, "not_enrolled")
    answer, _ = send(agent, f"/communities/{other.id}/deliveries/renew", {"deliveries": item["deliveries"]})
    assert (answer.status_code, answer.json()["code"]) == (403, "not_enrolled")

    advance_to(closing, "quiescing")
    answer, _ = send(agent, f"/communities/{closing.id}/deliveries/finish", item)
    assert (answer.status_code, answer.json()["code"]) == (403, "not_enrolled")
    gateway.revoke(mine.id, agent.pubkey)
    answer, _ = send(agent, f"/communities/{mine.id}/deliveries/finish", item)
    assert answer.status_code == 403  # enrolled nowhere now: refused at the admission
