"""The gateway through a real gunicorn process and a real HTTP client (SPEC section 14)."""

from __future__ import annotations

import base64
import json
import os
import time

import httpx
import pytest

from buzz_delivery.gateway import nip98
from buzz_delivery.gateway import services as gateway
from buzz_delivery.gateway.client import GatewayHTTPError, RemoteLease
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory, advance_to
from tests.conftest import backdate_lease
from tests.gateway.support import (
    LONG_WAIT,
    WAKE_TEST_ENV,
    assert_woken_by_a_commit,
    deliver,
    delivery_state,
    enroll,
    long_poll_in_background,
    new_agent,
    row_counts,
    start_server,
    stop_server,
    wait_for_long_polls,
)

pytestmark = pytest.mark.django_db(transaction=True)


def signed(agent, http_method, path, content=b"", **sign):
    """Send a request whose signature covers what ``sign`` says (key/url/method/body/created_at),
    or carries ``sign["header"]`` as is."""
    url = agent.base_url + path
    event = nip98.sign_event(
        sign.get("key", agent._key), sign.get("url", url), sign.get("method", http_method),
        sign.get("body", content), created_at=sign.get("created_at"),
    )  # fmt: skip
    header = sign["header"] if "header" in sign else nip98.encode_header(event)
    return httpx.request(http_method, url, content=content, headers={"Authorization": header}, timeout=10)


def test_the_whole_delivery_path_claim_read_renew_finish(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    (delivery,) = deliver(community, agent.pubkey)
    assert agent.me() == {"pubkey": agent.pubkey.hex(), "communities": [str(community.id)]}

    (claim,) = agent.claim(limit=5, lease_seconds=30)
    assert claim.delivery["id"] == str(delivery.id) and claim.delivery["status"] == "claimed"
    assert claim.delivery["target_pubkey"] == agent.pubkey.hex()
    assert claim.delivery["message"]["event_id"] == bytes(delivery.message_event_id).hex()
    assert claim.lease.lease_generation == 1 and claim.lease.lease_until.endswith("Z")
    assert agent.read(str(community.id), str(delivery.id))["status"] == "claimed"

    renewed = agent.renew(claim.lease, 60)
    assert renewed.outcome == "renewed" and renewed.lease.lease_until > claim.lease.lease_until
    settled = agent.finish(claim.lease, "finished")
    assert (settled.outcome, settled.status) == ("settled", "finished")
    # The same holder's repeat is an idempotent 200 with the recorded status.
    again = agent.finish(claim.lease, "failed", failure_code="late")
    assert (again.outcome, again.status) == ("already_terminal", "finished")
    row = WorkflowAgentDelivery.objects.get(id=delivery.id)
    assert row.status == "finished" and row.lease_generation == 1
    # The gateway claims as the agent: its key is the holder and the actor of the history.
    holder = f"gateway:{agent.pubkey.hex()}"
    assert row.claimed_by == holder
    assert [(e["event"], e["actor"], e.get("renewals")) for e in row.history] == [
        ("claim", holder, None),
        ("settle", holder, 1),
    ]
    assert agent.claim() == []


def test_a_lost_lease_is_409_with_the_typed_outcome(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    (delivery,) = deliver(community, agent.pubkey)
    (claim,) = agent.claim()
    backdate_lease(delivery.id)
    response = agent.request(
        "POST", f"/communities/{community.id}/deliveries/{delivery.id}/renew", {"lease_generation": 1}
    )
    assert response.status_code == 409
    assert response.json()["code"] == "lease_lost" and response.json()["outcome"] == "lease_lost"
    assert agent.finish(claim.lease, "finished").outcome == "lease_lost"
    assert WorkflowAgentDelivery.objects.get(id=delivery.id).status == "claimed"


def test_one_claim_spans_every_community_the_key_is_enrolled_in_and_only_those(gateway_server):
    a, b, c = CommunityFactory(), CommunityFactory(), CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, a)
    enroll(agent, b)
    mine = {d.id for d in deliver(a, agent.pubkey, 2) + deliver(b, agent.pubkey, 2)}
    deliver(c, agent.pubkey, 2)  # addressed to the key, but it is not enrolled in c
    claims = agent.claim(limit=10)
    assert {c.lease.delivery_id for c in claims} == {str(i) for i in mine}
    assert agent.claim(limit=10) == []


def test_isolation_between_communities_and_between_agents(gateway_server):
    a, b = CommunityFactory(), CommunityFactory()
    alice, bob, carol = (new_agent(gateway_server) for _ in range(3))
    enroll(alice, a)
    enroll(bob, a)
    enroll(carol, b)
    (in_b,) = deliver(b, carol.pubkey)
    (bobs,) = deliver(a, bob.pubkey)
    carol_claim = carol.claim()[0]
    bob_claim = bob.claim()[0]
    before = delivery_state()
    assert alice.claim(limit=10) == []
    for target, community, lease, status in (
        (in_b, b, carol_claim.lease, 403),  # alice is not enrolled in b: 403, nothing about b's rows
        (bobs, a, bob_claim.lease, 404),  # bob's delivery in a: looks exactly like a missing one
    ):
        stolen = RemoteLease(str(community.id), str(target.id), lease.lease_generation, lease.lease_until)
        base = f"/communities/{community.id}/deliveries/{target.id}"
        assert alice.request("GET", base).status_code == status
        assert alice.request("POST", base + "/renew", {"lease_generation": 1}).status_code == status
        response = alice.request("POST", base + "/finish", {"lease_generation": 1, "outcome": "finished"})
        assert response.status_code == status
        with pytest.raises(GatewayHTTPError) as info:
            alice.read(stolen.community_id, stolen.delivery_id)
        assert info.value.code == ("not_enrolled" if status == 403 else "not_found")
    missing = f"/communities/{a.id}/deliveries/{os.urandom(16).hex()[:8]}-0000-7000-8000-000000000000"
    assert alice.request("GET", missing).json()["code"] == "not_found"
    assert delivery_state() == before


def test_revoked_or_fenced_enrollment_is_403_and_a_never_enrolled_key_cannot_claim(gateway_server):
    community = CommunityFactory()
    agent, stranger = new_agent(gateway_server), new_agent(gateway_server)
    enroll(agent, community)
    (delivery,) = deliver(community, agent.pubkey)
    (claim,) = agent.claim()
    gateway.revoke(community.id, agent.pubkey)
    before = delivery_state()
    response = agent.request(
        "POST", f"/communities/{community.id}/deliveries/{delivery.id}/finish",
        {"lease_generation": claim.lease.lease_generation, "outcome": "finished"},
    )  # fmt: skip
    assert (response.status_code, response.json()["code"]) == (403, "not_enrolled")
    response = stranger.request("POST", "/deliveries/claim", {})
    assert (response.status_code, response.json()["code"]) == (403, "not_enrolled")
    enroll(agent, community)
    advance_to(community, "quiescing")
    assert agent.request("POST", "/deliveries/claim", {}).status_code == 403
    assert delivery_state() == before


@pytest.mark.parametrize(
    ("tamper", "code"),
    [
        ("other_key", "auth_invalid"),
        ("body", "auth_invalid"),
        ("url", "auth_invalid"),
        ("query", "auth_invalid"),
        ("method", "auth_invalid"),
        ("old", "auth_stale"),
        ("future", "auth_stale"),
        ("missing", "auth_missing"),
        ("garbage", "auth_invalid"),
        ("bad_sig", "auth_invalid"),
        ("bad_id", "auth_invalid"),
        ("wrong_kind", "auth_invalid"),
        ("no_payload", "auth_invalid"),
    ],
)
def test_a_request_not_covered_by_a_fresh_signature_of_the_caller_is_401_and_writes_nothing(
    gateway_server, tamper, code
):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    (delivery,) = deliver(community, agent.pubkey)
    path = "/deliveries/claim"
    body = json.dumps({"limit": 1}).encode()
    now = int(time.time())
    sign = {
        "other_key": {"key": os.urandom(32)},  # the event verifies, but as another key: not enrolled
        "body": {"body": json.dumps({"limit": 2}).encode()},
        "url": {"url": agent.base_url + "/deliveries/claim/"},
        "query": {"url": agent.base_url + path + "?x=1"},
        "method": {"method": "PUT"},
        "old": {"created_at": now - 120},
        "future": {"created_at": now + 120},
        "missing": {"header": ""},
        "garbage": {"header": "Nostr !!!"},
        "no_payload": {"body": b""},
    }.get(tamper, {})
    if tamper in ("bad_sig", "bad_id", "wrong_kind"):
        event = nip98.sign_event(agent._key, agent.base_url + path, "POST", body)
        if tamper == "bad_sig":
            event["sig"] = event["sig"][:-2] + ("00" if event["sig"][-2:] != "00" else "11")
        elif tamper == "bad_id":
            event["created_at"] += 1
        else:
            event["kind"] = 1
        sign = {"header": nip98.encode_header(event)}
    before, state = row_counts(), delivery_state()
    if tamper == "missing":
        response = httpx.post(agent.base_url + path, content=body, timeout=10)
    else:
        response = signed(agent, "POST", path, body, **sign)
    if tamper == "other_key":
        # A valid signature by a key that is enrolled nowhere: 403, and nothing is recorded
        # (issue 27: it used to add a replay-store row, a disk filler for anyone with a key).
        assert (response.status_code, response.json()["code"]) == (403, "not_enrolled")
        assert row_counts() == before
    else:
        assert response.status_code == 401, response.text
        assert response.json()["code"] == code
        assert response.headers["WWW-Authenticate"] == "Nostr"
        assert row_counts() == before
    assert delivery_state() == state
    assert WorkflowAgentDelivery.objects.get(id=delivery.id).status == "pending"


@pytest.mark.parametrize("tamper", ["body", "url", "method", "other_key"])
def test_a_tampered_finish_is_refused_and_leaves_the_lease_as_it_was(gateway_server, tamper):
    """On a write endpoint: the signed request says ``failed`` (or another delivery's URL, or
    PUT, or another key's signature); what arrives is this agent's finish ``finished``."""
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    (delivery, other) = deliver(community, agent.pubkey, 2)
    (claim,) = agent.claim()
    path = f"/communities/{community.id}/deliveries/{claim.lease.delivery_id}/finish"
    body = json.dumps({"lease_generation": claim.lease.lease_generation, "outcome": "finished"}).encode()
    other_id = other.id if str(other.id) != claim.lease.delivery_id else delivery.id
    sign = {
        "body": {"body": json.dumps({"lease_generation": claim.lease.lease_generation, "outcome": "failed"}).encode()},
        "url": {"url": agent.base_url + f"/communities/{community.id}/deliveries/{other_id}/finish"},
        "method": {"method": "PUT"},
        "other_key": {"key": os.urandom(32)},
    }[tamper]
    before, state = row_counts(), delivery_state()

    response = signed(agent, "POST", path, body, **sign)

    if tamper == "other_key":  # verifies, as a key enrolled nowhere: nothing recorded (issue 27)
        assert (response.status_code, response.json()["code"]) == (403, "not_enrolled")
        assert row_counts() == before
    else:
        assert (response.status_code, response.json()["code"]) == (401, "auth_invalid"), response.text
        assert row_counts() == before
    assert delivery_state() == state
    assert WorkflowAgentDelivery.objects.get(id=claim.lease.delivery_id).status == "claimed"


def test_a_replayed_event_is_refused_even_for_the_same_request(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    deliver(community, agent.pubkey, 2)
    url, body = agent.base_url + "/deliveries/claim", b'{"limit":1}'
    header = nip98.encode_header(nip98.sign_event(agent._key, url, "POST", body))
    first = httpx.post(url, content=body, headers={"Authorization": header}, timeout=10)
    assert first.status_code == 200 and len(first.json()["claims"]) == 1
    before, state = row_counts(), delivery_state()
    second = httpx.post(url, content=body, headers={"Authorization": header}, timeout=10)
    assert (second.status_code, second.json()["code"]) == (401, "auth_replayed")
    assert row_counts() == before and delivery_state() == state


def test_a_body_over_the_limit_is_413_before_anything_is_read_or_written(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    deliver(community, agent.pubkey)
    before = row_counts()
    body = json.dumps({"limit": 1, "pad": "x" * 100_000}).encode()
    response = signed(agent, "POST", "/deliveries/claim", body)
    assert (response.status_code, response.json()["code"]) == (413, "payload_too_large")
    assert row_counts() == before


def test_a_long_poll_claim_is_woken_by_the_wake_hint_of_a_commit_to_that_agent(tmp_path):
    # A server of its own that polls only every 600 s: only a hint can wake it within 60 s.
    server = start_server(tmp_path / "gunicorn.log", WAKE_TEST_ENV)
    try:
        community = CommunityFactory()
        agent = new_agent(server)
        enroll(agent, community)
        waiter, got = long_poll_in_background(agent, LONG_WAIT)
        wait_for_long_polls(server, 1)
        assert got == [] and waiter.is_alive()
        other = new_agent(server)
        enroll(other, community)
        deliver(community, other.pubkey)  # a hint for another target does not end the wait
        time.sleep(0.5)
        assert got == [] and waiter.is_alive()
        assert_woken_by_a_commit(community, agent, waiter, got)
    finally:
        stop_server(server)


def test_a_long_poll_that_finds_nothing_returns_empty_after_its_wait(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    started = time.monotonic()
    assert agent.claim(wait_seconds=1.2) == []
    assert 1.1 <= time.monotonic() - started < 60  # not before its wait ends (the bound: a loaded CI)


def test_the_retry_and_failed_outcomes_through_the_api(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    first, second = deliver(community, agent.pubkey, 2)
    claims = {c.lease.delivery_id: c for c in agent.claim(limit=2)}
    retried = agent.finish(claims[str(first.id)].lease, "retry", failure_message="flaky")
    failed = agent.finish(claims[str(second.id)].lease, "failed", failure_code="Bad", failure_message="no")
    assert (retried.outcome, retried.status) == ("settled", "pending")
    assert (failed.outcome, failed.status) == ("settled", "failed")
    assert WorkflowAgentDelivery.objects.get(id=second.id).failure_code == "Bad"


def test_the_authorization_header_is_plain_base64_of_the_event_json(gateway_server):
    event = nip98.sign_event(os.urandom(32), "http://h/p", "GET")
    header = nip98.encode_header(event)
    assert header.startswith("Nostr ")
    assert json.loads(base64.b64decode(header[6:])) == event
