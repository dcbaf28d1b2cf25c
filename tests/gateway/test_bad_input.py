"""The bad-input matrix over every gateway endpoint: 400 naming the field (or 413), never a 500,
nothing written but the request's event id in the replay store (SPEC section 14)."""

from __future__ import annotations

import json

import httpx
import pytest

from buzz_delivery.gateway import nip98
from buzz_delivery.testing import CommunityFactory
from tests.gateway.support import deliver, delivery_state, enroll, new_agent, row_counts

pytestmark = pytest.mark.django_db(transaction=True)

D = "/communities/{c}/deliveries/{d}"
CLAIM, READ, RENEW, FINISH, ME = "/deliveries/claim", D, D + "/renew", D + "/finish", "/me"
GOOD_FINISH = {"lease_generation": 1, "outcome": "finished"}

# (route, method, body: JSON-able object, or bytes sent as is, expected field)
CASES = [
    # bad JSON and bodies that are not an object
    (CLAIM, "POST", b"{", "body"),
    (CLAIM, "POST", b"[1]", "body"),
    (CLAIM, "POST", b'"limit"', "body"),
    (CLAIM, "POST", b"\xff\xfe", "body"),
    (CLAIM, "POST", b'{"limit": NaN}', "body"),
    (CLAIM, "POST", b'{"limit": 1' + b"0" * 5000 + b"}", "body"),
    (CLAIM, "POST", b"[" * 100_00 + b"]" * 100_00, "body"),
    (RENEW, "POST", b"", "body"),
    (FINISH, "POST", b"null", "body"),
    # extra fields (the target can never be named)
    (CLAIM, "POST", {"target_pubkey": "00" * 32}, "target_pubkey"),
    (CLAIM, "POST", {"community_id": "x"}, "community_id"),
    (RENEW, "POST", {"lease_generation": 1, "target": "x"}, "target"),
    (FINISH, "POST", {**GOOD_FINISH, "status": "finished"}, "status"),
    # missing required fields
    (RENEW, "POST", {}, "lease_generation"),
    (FINISH, "POST", {"outcome": "finished"}, "lease_generation"),
    (FINISH, "POST", {"lease_generation": 1}, "outcome"),
    # wrong types
    (CLAIM, "POST", {"limit": "1"}, "limit"),
    (CLAIM, "POST", {"limit": 1.5}, "limit"),
    (CLAIM, "POST", {"limit": True}, "limit"),
    (CLAIM, "POST", {"limit": None}, "limit"),
    (CLAIM, "POST", {"wait_seconds": "soon"}, "wait_seconds"),
    (CLAIM, "POST", {"lease_seconds": [30]}, "lease_seconds"),
    (RENEW, "POST", {"lease_generation": "1"}, "lease_generation"),
    (RENEW, "POST", {"lease_generation": 1.0}, "lease_generation"),
    (RENEW, "POST", {"lease_generation": 1, "lease_seconds": {}}, "lease_seconds"),
    (FINISH, "POST", {"lease_generation": 1, "outcome": 1}, "outcome"),
    (FINISH, "POST", {"lease_generation": 1, "outcome": None}, "outcome"),
    (FINISH, "POST", {**GOOD_FINISH, "failure_code": 5}, "failure_code"),
    (FINISH, "POST", {**GOOD_FINISH, "failure_message": ["x"]}, "failure_message"),
    # out of range, wrong lengths
    (CLAIM, "POST", {"limit": 0}, "limit"),
    (CLAIM, "POST", {"limit": 101}, "limit"),
    (CLAIM, "POST", {"limit": 2**70}, "limit"),
    (CLAIM, "POST", {"wait_seconds": -1}, "wait_seconds"),
    (CLAIM, "POST", {"wait_seconds": 1e9}, "wait_seconds"),
    (CLAIM, "POST", {"lease_seconds": 0.5}, "lease_seconds"),
    (CLAIM, "POST", {"lease_seconds": 1e6}, "lease_seconds"),
    (RENEW, "POST", {"lease_generation": 0}, "lease_generation"),
    (RENEW, "POST", {"lease_generation": 2**63}, "lease_generation"),
    (RENEW, "POST", {"lease_generation": -5}, "lease_generation"),
    (FINISH, "POST", {"lease_generation": 1, "outcome": "done"}, "outcome"),
    (FINISH, "POST", {"lease_generation": 1, "outcome": "failed", "failure_code": "x" * 65}, "failure_code"),
    (FINISH, "POST", {"lease_generation": 1, "outcome": "failed", "failure_message": "x" * 10_001}, "failure_message"),
    # values the core refuses by name (combinations, text PostgreSQL cannot store)
    (FINISH, "POST", {**GOOD_FINISH, "failure_code": "x"}, "failure_code"),
    (FINISH, "POST", {**GOOD_FINISH, "failure_message": "x"}, "failure_message"),
    (FINISH, "POST", {"lease_generation": 1, "outcome": "failed", "failure_message": "a\x00b"}, "failure_message"),
    (FINISH, "POST", {"lease_generation": 1, "outcome": "retry", "failure_message": "\ud800"}, "failure_message"),
    # path segments
    ("/communities/nope/deliveries/{d}", "GET", None, "community_id"),
    ("/communities/{c}/deliveries/123", "GET", None, "delivery_id"),
    ("/communities/{c}/deliveries/x/renew", "POST", {"lease_generation": 1}, "delivery_id"),
    ("/communities/0/deliveries/{d}/finish", "POST", GOOD_FINISH, "community_id"),
    # a GET takes no body
    (READ, "GET", b"{}", "body"),
    (ME, "GET", b"x", "body"),
]


@pytest.fixture
def claimed(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    deliver(community, agent.pubkey, 2)
    (claim,) = agent.claim()
    return agent, community, claim


def send(agent, method: str, path: str, body) -> httpx.Response:
    raw = body if isinstance(body, bytes) else (b"" if body is None else json.dumps(body).encode())
    url = agent.base_url + path
    header = nip98.encode_header(nip98.sign_event(agent._key, url, method, raw))
    return httpx.request(method, url, content=raw, headers={"Authorization": header}, timeout=10)


@pytest.mark.parametrize(("route", "method", "body", "field"), CASES, ids=[f"{c[1]} {c[0]} {c[3]}" for c in CASES])
def test_bad_input_is_400_naming_the_field_and_writes_nothing(claimed, route, method, body, field):
    agent, community, claim = claimed
    path = route.format(c=community.id, d=claim.lease.delivery_id)
    before, state = row_counts(), delivery_state()
    response = send(agent, method, path, body)
    assert response.status_code == 400, response.text
    data = response.json()
    assert (data["code"], data["field"]) == ("bad_request", field), data
    assert field in data["message"]
    assert delivery_state() == state
    assert row_counts() == {**before, "seen": before["seen"] + 1}  # only the replay store


@pytest.mark.parametrize("route", [CLAIM, RENEW, FINISH, READ, ME])
def test_a_huge_body_is_413_on_every_endpoint_and_writes_nothing(claimed, route):
    agent, community, claim = claimed
    path = route.format(c=community.id, d=claim.lease.delivery_id)
    method = "GET" if route in (READ, ME) else "POST"
    before, state = row_counts(), delivery_state()
    response = send(agent, method, path, b"{" + b" " * 70_000 + b"}")
    assert (response.status_code, response.json()["code"]) == (413, "payload_too_large")
    assert row_counts() == before and delivery_state() == state


@pytest.mark.parametrize(("route", "wrong"), [(CLAIM, "GET"), (RENEW, "PUT"), (FINISH, "DELETE"), (READ, "POST")])
def test_a_wrong_method_is_405_with_allow(claimed, route, wrong):
    agent, community, claim = claimed
    path = route.format(c=community.id, d=claim.lease.delivery_id)
    before = row_counts()
    response = send(agent, wrong, path, None)
    assert (response.status_code, response.json()["code"]) == (405, "method_not_allowed")
    assert response.headers["Allow"] in ("GET", "POST")
    assert row_counts() == before
