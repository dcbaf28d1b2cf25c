"""What a hostile review of the gateway found (issue 27), through a real gunicorn and a real HTTP
client: every case is refused with the status that names what is wrong, writes nothing, and
never answers 500; what a remote agent may ask for is bounded by the operator's policy."""

from __future__ import annotations

import base64
import json
import threading
import time

import httpx
import pytest
from django.db import connection

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services.policy import set_policy
from buzz_delivery.gateway import nip98
from buzz_delivery.testing import CommunityFactory
from buzz_delivery.workflows.services import decide_approval
from tests.agents_support import counts
from tests.gateway.support import (
    LONG_WAIT,
    WAKE_TEST_ENV,
    assert_woken_by_a_commit,
    deliver,
    enroll,
    long_poll_in_background,
    long_polls_waiting,
    new_agent,
    row_counts,
    wait_for,
    wait_for_long_polls,
)
from tests.gateway.test_runs import accepted_run, run_state, send

pytestmark = pytest.mark.django_db(transaction=True)


def nested(depth: int) -> object:
    value: object = []
    for _ in range(depth):
        value = [value]
    return value


def test_an_authorization_header_of_deeply_nested_json_is_401_and_writes_nothing(gateway_server):
    """2.7 KB of ``[[[...]]]`` made the header parser raise RecursionError: a 500 for anyone."""
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    before = row_counts()
    for token in ("[" * 1400 + "]" * 1400, '{"a":' * 700 + "1" + "}" * 700):
        header = "Nostr " + base64.b64encode(token.encode()).decode()
        response = httpx.get(agent.base_url + "/me", headers={"Authorization": header}, timeout=10)
        assert (response.status_code, response.json()["code"]) == (401, "auth_invalid"), response.text
    assert row_counts() == before


def test_an_authorization_event_with_a_key_twice_is_401(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    url = agent.base_url + "/me"
    event = nip98.sign_event(agent._key, url, "GET")
    text = json.dumps(event, separators=(",", ":"))
    twice = text[:-1] + ',"content":""}'  # the same field again (even with the same value)
    header = "Nostr " + base64.b64encode(twice.encode()).decode()
    before = row_counts()
    response = httpx.get(url, headers={"Authorization": header}, timeout=10)
    assert (response.status_code, response.json()["code"]) == (401, "auth_invalid"), response.text
    assert row_counts() == before


def test_a_body_with_a_key_twice_is_400_and_writes_nothing(gateway_server):
    """The last value used to win: {"outcome": "failed", "outcome": "finished"} finished."""
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    deliver(community, agent.pubkey)
    (claim,) = agent.claim()
    path = f"/communities/{community.id}/deliveries/{claim.lease.delivery_id}/finish"
    raw = b'{"lease_generation": 1, "outcome": "failed", "outcome": "finished"}'
    before = row_counts()
    response = send(agent, "POST", path, raw)
    assert response.status_code == 400, response.text
    assert response.json()["field"] == "body" and "twice" in response.json()["message"]
    assert row_counts() == {**before, "seen": before["seen"] + 1}
    assert agent.read(str(community.id), claim.lease.delivery_id)["status"] == "claimed"


# (action, body without the lease fields, the field a 400 must name)
HOSTILE_RUN_BODIES = [
    ("complete", {"output": nested(930)}, "output"),
    ("results", {"seq": 1, "ok": True, "output": {"deep": nested(200)}}, "output"),
    ("calls", {"tool_name": "t", "args": nested(500)}, "args"),
    ("calls", {"tool_name": "t", "args": {"q": "\ud800"}}, "args"),
    ("calls", {"tool_name": "t", "args": {"\udfff": 1}}, "args"),
    ("calls", {"tool_name": "t", "args": {}, "compensation": {"function": "x\ud83d"}}, "compensation"),
    ("calls", {"tool_name": "t\ud800", "args": {}}, "tool_name"),
    ("results", {"seq": 1, "ok": True, "output": ["\udc00"]}, "output"),
    ("results", {"seq": 1, "ok": False, "error": "\ud800"}, "error"),
    ("complete", {"output": "\ud800"}, "output"),
    ("fail", {"failure_code": "x", "failure_message": "\udfff"}, "failure_message"),
    ("heartbeat", {"worker_id": "w\ud800"}, "worker_id"),
    ("calls", {"tool_name": "t", "args": {}, "cost": 2**62}, "cost"),
]


def test_hostile_json_on_the_run_endpoints_is_400_naming_the_field_and_writes_nothing(gateway_server):
    """Lone surrogates used to reach PostgreSQL (500), an output 930 lists deep was stored (and
    then broke the admin), a cost near 2**62 overflowed the budget's bigint on the second call."""
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    lease = accepted_run(agent, community, max_cost=2**53 - 1).lease
    assert agent.journal_call(lease, "t", {}).outcome == "journaled"  # entry 1, for "results"
    base = f"/communities/{community.id}/runs/{lease.run_id}"
    fence = {"lease_generation": lease.lease_generation, "worker_id": lease.worker_id}
    before, rows = run_state(), counts()
    for action, body, field in HOSTILE_RUN_BODIES:
        response = send(agent, "POST", f"{base}/{action}", {**fence, **body})
        assert response.status_code == 400, (action, field, response.status_code, response.text[:300])
        assert response.json()["field"] == field, (action, response.json())
    assert run_state() == before and counts() == rows


def test_hostile_json_in_an_accept_is_400_and_creates_no_run(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    deliver(community, agent.pubkey)
    (claim,) = agent.claim()
    path = f"/communities/{community.id}/deliveries/{claim.lease.delivery_id}/accept"
    for body, field in (
        ({"input": {"x": "\ud800"}}, "input"),
        ({"input": {"x": nested(300)}}, "input"),
        ({"max_cost": 2**62}, "max_cost"),
    ):
        response = send(agent, "POST", path, {"lease_generation": claim.lease.lease_generation, **body})
        assert response.status_code == 400, (body, response.text[:300])
        assert response.json()["field"] == field
    assert not AgentRun.objects.exists()
    assert agent.read(str(community.id), claim.lease.delivery_id)["status"] == "claimed"


def test_a_remote_agent_gets_the_operators_policy_whatever_its_accept_asks_for(gateway_server):
    """An agent used to set its own budgets and shadow mode when it accepted."""
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    set_policy(community.id, max_tool_calls=5, max_cost=10, shadow=True, max_lease_seconds=20)
    lease = accepted_run(agent, community, max_tool_calls=100_000, max_cost=2**53 - 1, shadow=False).lease
    run = agent.read_run(str(community.id), lease.run_id)["run"]
    assert (run["max_tool_calls"], run["max_cost"], run["shadow"]) == (5, 10, True)
    # accepted_run asked for a 30 s lease; the run's policy allows 20.
    renewed = agent.heartbeat(lease, 300)
    assert renewed.outcome == "renewed"
    stored = AgentRun.objects.get(id=lease.run_id)
    assert (stored.lease_until - stored.heartbeat_at).total_seconds() <= 20
    blocked = agent.journal_call(lease, "rm", {}, destructive=True)
    assert blocked.outcome == "blocked"


def test_the_decision_a_remote_agent_reads_back_names_no_operator(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    lease = accepted_run(agent, community).lease
    requested = agent.request_approval(lease, "ship?", 600)
    decide_approval(community.id, requested.data["approval_id"], "approved", "alice@example.com")
    (again,) = agent.claim_runs(worker_id="remote-1")
    (entry,) = agent.read_run(str(community.id), again.lease.run_id)["journal"]
    assert entry["output"] == {"decision": "approved", "decided_by": "operator"}
    assert "alice" not in json.dumps(agent.read_run(str(community.id), again.lease.run_id))


def test_a_long_poll_is_still_woken_after_hostile_notifications_on_the_wake_channel(tmp_path):
    """A payload that was not the expected JSON killed the gateway's LISTEN thread: waiting
    long-polls were no longer woken (until a later request started it again)."""
    from buzz_delivery.conf import get_settings
    from tests.gateway.support import start_server, stop_server
    from tests.test_listeners import HOSTILE_PAYLOADS

    server = start_server(tmp_path / "gunicorn.log", WAKE_TEST_ENV)
    try:
        community = CommunityFactory()
        agent = new_agent(server)
        enroll(agent, community)
        waiter, got = long_poll_in_background(agent, LONG_WAIT)
        # The wake listener starts with the first long-poll: LISTENing before the payloads are sent.
        wait_for_long_polls(server, 1)
        with connection.cursor() as cursor:
            for payload in HOSTILE_PAYLOADS:
                cursor.execute("SELECT pg_notify(%s, %s)", [get_settings().notify_channel, payload])
        time.sleep(0.5)
        assert got == [] and waiter.is_alive()
        assert_woken_by_a_commit(community, agent, waiter, got)  # the wake listener survived them
    finally:
        stop_server(server)


def _long_polls(agent, n: int, seconds: float) -> tuple[list[threading.Thread], list[int]]:
    statuses: list[int] = []

    def poll() -> None:
        response = agent.request("POST", "/deliveries/claim", {"wait_seconds": seconds}, extra_timeout=seconds)
        statuses.append(response.status_code)

    threads = [threading.Thread(target=poll) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, statuses


def test_one_key_holding_every_thread_with_long_polls_no_longer_starves_another_community(tmp_path):
    """With as many long-polls as the server has threads, another community's request used to
    wait until a long-poll ended (about 10 s in the review); now the key gets at most
    MAX_LONG_POLLS_PER_KEY waits and its others are 429 at once."""
    from tests.gateway.support import start_server, stop_server

    server = start_server(tmp_path / "gunicorn.log", {"BUZZ_GATEWAY_POLL_SECONDS": "30"}, threads=6)
    try:
        a, b = CommunityFactory(), CommunityFactory()
        greedy, other = new_agent(server), new_agent(server)
        enroll(greedy, a)
        enroll(other, b)
        threads, statuses = _long_polls(greedy, 6, 8)
        # Every long-poll is in: refused (answered) or waiting in its claim.
        wait_for(lambda: len(statuses) + long_polls_waiting() == 6, "the six long-polls to be held or refused")
        assert other.me()["communities"] == [str(b.id)]
        # Answered while the held ones still wait (their 8 s): it did not wait for a thread they held.
        assert statuses == [429, 429], "another community's request waited for the long-polls"
        for t in threads:
            t.join(15)
        assert sorted(statuses) == [200] * 4 + [429] * 2
    finally:
        stop_server(server)


def test_the_agents_of_one_community_are_bounded_together_and_a_key_per_request(tmp_path):
    from tests.gateway.support import start_server, stop_server

    env = {
        "BUZZ_GATEWAY_POLL_SECONDS": "30",
        "BUZZ_GATEWAY_MAX_LONG_POLLS_PER_COMMUNITY": "2",
        "BUZZ_GATEWAY_MAX_REQUESTS_PER_KEY": "2",
    }
    server = start_server(tmp_path / "gunicorn.log", env, threads=8)
    try:
        a, b = CommunityFactory(), CommunityFactory()
        alice, bob, carol, dave = (new_agent(server) for _ in range(4))
        for agent in (alice, bob, carol):
            enroll(agent, a)
        enroll(dave, b)
        held = [_long_polls(agent, 1, 9) for agent in (alice, bob)]  # held until dave's are in
        wait_for(lambda: long_polls_waiting() == 2, "alice's and bob's long-polls to wait")
        refused = carol.request("POST", "/deliveries/claim", {"wait_seconds": 5}, extra_timeout=5)
        assert (refused.status_code, refused.json()["code"]) == (429, "too_many_requests")
        assert refused.headers["Retry-After"] == "1"
        assert carol.claim() == []  # a claim that does not wait is still served
        assert dave.claim(wait_seconds=0.5) == []  # another community waits as usual
        # A key's requests of any kind count together: with two long-polls dave has no third.
        wait_for(lambda: long_polls_waiting() == 2, "dave's short wait to end")  # its backend gone too
        threads, statuses = _long_polls(dave, 2, 4)
        wait_for(lambda: long_polls_waiting() == 4, "dave's two long-polls to wait beside alice's and bob's")
        assert dave.request("GET", "/me").status_code == 429
        for t in threads + [t for ts, _ in held for t in ts]:
            t.join(15)
        assert statuses == [200, 200]
        assert [s for _, ss in held for s in ss] == [200, 200]
        assert dave.me()["communities"] == [str(b.id)]
    finally:
        stop_server(server)
