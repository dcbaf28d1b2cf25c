"""The batch finish route settles each delivery with its own outcome, failure text and
retry_after (issue 29), and the ``work`` client sends its failed and retried results through it
too: one request per community and flush, none per delivery."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection

from buzz_delivery.gateway.client import RemoteLease, RemoteSettle
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory
from tests.conftest import backdate_lease
from tests.gateway.support import deliver, enroll, new_agent
from tests.gateway.test_remote_worker import deliveries, posts, start, summary

pytestmark = pytest.mark.django_db(transaction=True)


def rows() -> dict:
    """Each delivery's settle state, for nothing-written checks."""
    return {
        row[0]: row[1:]
        for row in WorkflowAgentDelivery.objects.values_list(
            "id", "status", "lease_generation", "failure_code", "failure_message", "next_attempt_at", "history"
        )
    }


def wait_of(delivery_id: str) -> float:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT extract(epoch FROM next_attempt_at - now()) FROM buzz_delivery_delivery WHERE id = %s",
            [delivery_id],
        )
        return float(cursor.fetchone()[0])


def test_one_request_settles_each_delivery_with_its_own_outcome_and_a_stale_one_is_refused_alone(gateway_server):
    community = CommunityFactory()
    agent, bob = new_agent(gateway_server), new_agent(gateway_server)
    enroll(agent, community)
    enroll(bob, community)
    deliver(community, agent.pubkey, 5)
    done, failed, retried, stale, settled_before = (c.lease for c in agent.claim(limit=5))
    (bobs,) = deliver(community, bob.pubkey)
    bob.claim()
    backdate_lease(uuid.UUID(stale.delivery_id))
    assert agent.finish(settled_before, "failed", failure_code="early").status == "failed"

    results = agent.settle_many(
        [
            RemoteSettle(done, "finished"),
            RemoteSettle(failed, "failed", failure_code="Poison", failure_message="cannot parse"),
            RemoteSettle(retried, "retry", failure_message="429", retry_after=600),
            RemoteSettle(stale, "retry"),
            RemoteSettle(settled_before, "finished"),
            RemoteSettle(RemoteLease(str(community.id), str(bobs.id), 1, ""), "failed"),
        ]
    )

    assert [(r.outcome, r.status) for r in results] == [
        ("settled", "finished"),
        ("settled", "failed"),
        ("settled", "pending"),
        ("lease_lost", None),
        ("already_terminal", "failed"),
        ("not_found", None),
    ]
    state = {d: (r[0], r[2], r[3]) for d, r in rows().items()}
    assert state[uuid.UUID(done.delivery_id)] == ("finished", None, None)
    assert state[uuid.UUID(failed.delivery_id)] == ("failed", "Poison", "cannot parse")
    assert state[uuid.UUID(retried.delivery_id)] == ("pending", None, None)
    assert 590 <= wait_of(retried.delivery_id) <= 600  # its own Retry-After, not the short backoff
    assert state[uuid.UUID(stale.delivery_id)][0] == "claimed"
    assert state[uuid.UUID(settled_before.delivery_id)] == ("failed", "early", None)
    assert state[bobs.id][0] == "claimed"


def test_the_request_s_outcome_and_text_apply_to_the_items_that_name_none(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    deliver(community, agent.pubkey, 3)
    a, b, c = (x.lease for x in agent.claim(limit=3))
    body = {
        "deliveries": [
            {"delivery_id": a.delivery_id, "lease_generation": 1},
            {"delivery_id": b.delivery_id, "lease_generation": 1, "failure_message": "its own"},
            {"delivery_id": c.delivery_id, "lease_generation": 1, "outcome": "finished"},
        ],
        "outcome": "failed",
        "failure_code": "bulk",
        "failure_message": "shared",
    }
    response = agent.request("POST", f"/communities/{community.id}/deliveries/finish", body)
    assert response.status_code == 200, response.text
    assert [r["status"] for r in response.json()["results"]] == ["failed", "failed", "finished"]
    state = rows()
    assert [state[uuid.UUID(x.delivery_id)][:4] for x in (a, b, c)] == [
        ("failed", 1, "bulk", "shared"),
        ("failed", 1, "bulk", "its own"),
        ("finished", 1, None, None),
    ]


def test_a_bad_item_is_a_400_naming_its_field_and_nothing_is_settled(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    deliver(community, agent.pubkey, 2)
    a, b = (x.lease for x in agent.claim(limit=2))
    ok = {"delivery_id": a.delivery_id, "lease_generation": 1, "outcome": "retry"}
    other = {"delivery_id": b.delivery_id, "lease_generation": 1}
    path = f"/communities/{community.id}/deliveries/finish"
    before = rows()
    for body, field in (
        ({"deliveries": [ok, {**other, "outcome": "later"}]}, "deliveries[1].outcome"),
        ({"deliveries": [ok, other]}, "deliveries[1].outcome"),  # neither it nor the request names one
        ({"deliveries": [ok, {**other, "outcome": "finished", "failure_code": "x"}]}, "deliveries[1].failure_code"),
        ({"deliveries": [ok, {**other, "outcome": "retry", "failure_code": "x"}]}, "deliveries[1].failure_code"),
        ({"deliveries": [ok, {**other, "outcome": "finished", "failure_message": "x"}]},
         "deliveries[1].failure_message"),
        ({"deliveries": [ok, {**other, "outcome": "failed", "retry_after": 5}]}, "deliveries[1].retry_after"),
        ({"deliveries": [ok, {**other, "outcome": "retry", "retry_after": -1}]}, "deliveries[1].retry_after"),
        ({"deliveries": [ok, {**other, "outcome": "failed", "failure_code": "x" * 65}]},
         "deliveries[1].failure_code"),
        ({"deliveries": [ok, {**other, "failure_code": "x"}], "outcome": "finished"}, "deliveries[1].failure_code"),
        ({"deliveries": [ok, other], "outcome": "finished", "failure_code": "x"}, "failure_code"),
        ({"deliveries": [ok, other], "outcome": "failed", "retry_after": 5}, "retry_after"),
        ({"deliveries": [ok, other], "outcome": "later"}, "outcome"),
    ):  # fmt: skip
        response = agent.request("POST", path, body)
        assert (response.status_code, response.json()["field"]) == (400, field), (body, response.text)
    assert rows() == before


def test_the_work_client_settles_failed_and_retried_results_through_the_batch_route(tmp_path, gateway_server):
    """Issue 29: ``work`` sent one signed finish per failed or retried delivery."""
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    kinds = [f"{kind}_{i}" for kind in ("ok", "perm", "retry") for i in range(4)]
    made = dict(zip(kinds, deliveries(community, agent.pubkey, *kinds), strict=True))
    gate = tmp_path / "gate"
    proc = start(tmp_path, gateway_server, agent, "--concurrency", "12", "--max-deliveries", "12", "--wait-seconds",
                 "1", "-v", "2", gate=gate)  # fmt: skip
    gate.touch()
    assert proc.wait(timeout=60) == 0, (tmp_path / "worker.err").read_text()

    result = summary(tmp_path)
    assert (result["finished"], result["failed"], result["retried"]) == (4, 4, 4), result
    assert (result["settle_errors"], result["lease_lost"], result["abandoned"]) == (0, 0, 0), result
    state = {d: (r[0], r[2], r[3]) for d, r in rows().items()}
    for kind, delivery in made.items():
        expected = {
            "ok": ("finished", None, None),
            "perm": ("failed", "BadPayload", "cannot parse"),
            "retry": ("pending", None, None),
        }[kind.split("_")[0]]
        assert state[delivery.id] == expected, (kind, state[delivery.id])
    finishes = [p for p in posts(tmp_path) if p.endswith("/finish")]
    assert finishes and set(finishes) == {f"POST {gateway_server.base}/communities/{community.id}/deliveries/finish"}
    assert len(finishes) < 12, finishes
