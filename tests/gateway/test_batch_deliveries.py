"""Batched renewal of deliveries through the gateway (issue 29): many leases of one community
renewed in one signed request and one fenced statement, each lease judged by its own generation;
the ``work`` client renews its held leases through it, one request per community and round."""

from __future__ import annotations

import time
import uuid

import pytest

from buzz_delivery import services
from buzz_delivery.gateway.client import GatewayHTTPError, RemoteLease, RemoteOutcome, RemoteWorker
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory
from tests.conftest import backdate_lease
from tests.gateway.support import deliver, enroll, new_agent
from tests.gateway.test_remote_worker import deliveries, posts, start, summary, wait_handled

pytestmark = pytest.mark.django_db(transaction=True)


def leases_state() -> dict:
    """Each delivery's lease state (renewals included), for nothing-written checks."""
    return {
        row[0]: row[1:]
        for row in WorkflowAgentDelivery.objects.values_list(
            "id", "status", "lease_generation", "lease_until", "renewals"
        )
    }


def test_batch_renew_extends_each_lease_and_refuses_a_stale_holder_for_its_delivery_only(gateway_server):
    community = CommunityFactory()
    agent, bob = new_agent(gateway_server), new_agent(gateway_server)
    enroll(agent, community)
    enroll(bob, community)
    deliver(community, agent.pubkey, 4)
    leases = [c.lease for c in agent.claim(limit=4, lease_seconds=20)]
    (bobs,) = deliver(community, bob.pubkey)
    bob.claim()
    bobs_lease = RemoteLease(str(community.id), str(bobs.id), 1, "")
    stale = leases[1]
    backdate_lease(uuid.UUID(stale.delivery_id))
    assert services.reap().reclaimed == 1  # the reaper took it back: generation + 1
    assert agent.finish(leases[3], "finished").outcome == "settled"
    before = leases_state()

    results = agent.renew_many([*leases, bobs_lease], lease_seconds=200)

    assert [r.outcome for r in results] == ["renewed", "lease_lost", "renewed", "lease_lost", "not_found"]
    after = leases_state()
    for i in (0, 2):
        delivery_id = uuid.UUID(leases[i].delivery_id)
        status, generation, until, renewals = after[delivery_id]
        assert (status, generation, renewals) == ("claimed", leases[i].lease_generation, 1)
        assert until > before[delivery_id][2]
        assert results[i].lease is not None and results[i].lease.lease_generation == generation
    for delivery_id in (uuid.UUID(stale.delivery_id), uuid.UUID(leases[3].delivery_id), bobs.id):
        assert after[delivery_id] == before[delivery_id]


def test_a_bad_item_is_a_400_naming_it_and_nothing_is_renewed(gateway_server):
    community, other = CommunityFactory(), CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    deliver(community, agent.pubkey, 2)
    a, b = (c.lease for c in agent.claim(limit=2))
    good = {"delivery_id": a.delivery_id, "lease_generation": a.lease_generation}
    path = f"/communities/{community.id}/deliveries/renew"
    before = leases_state()
    for body, field in (
        ({"deliveries": []}, "deliveries"),
        ({"deliveries": [good] * 101}, "deliveries"),
        ({"deliveries": [good, good]}, "deliveries[1].delivery_id"),
        ({"deliveries": [good, {"delivery_id": "x", "lease_generation": 1}]}, "deliveries[1].delivery_id"),
        ({"deliveries": [good, {"delivery_id": b.delivery_id}]}, "deliveries[1].lease_generation"),
        ({"deliveries": [good, {"delivery_id": b.delivery_id, "lease_generation": 0}]},
         "deliveries[1].lease_generation"),
        ({"deliveries": [good, {**good, "outcome": "x"}]}, "deliveries[1].outcome"),
        ({"deliveries": [good, 1]}, "deliveries[1]"),
        ({"deliveries": [good], "lease_seconds": 10**9}, "lease_seconds"),
        ({"deliveries": [good], "extra": 1}, "extra"),
        ({}, "deliveries"),
    ):  # fmt: skip
        response = agent.request("POST", path, body)
        assert (response.status_code, response.json()["field"]) == (400, field), response.text
    not_enrolled = agent.request("POST", f"/communities/{other.id}/deliveries/renew", {"deliveries": [good]})
    assert not_enrolled.status_code == 403
    assert agent.request("GET", path).status_code == 405
    assert leases_state() == before


def test_the_work_client_renews_its_held_leases_in_one_request_per_round(tmp_path, gateway_server):
    """Issue 29: the remote worker used to send one signed renew per held lease and round."""
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    made = deliveries(community, agent.pubkey, *[f"ok_{i}" for i in range(6)])
    gate = tmp_path / "gate"
    proc = start(tmp_path, gateway_server, agent, "--concurrency", "6", "--max-deliveries", "6", "--wait-seconds", "1",
                 "--lease-seconds", "2", "--renew-every", "0.5", "-v", "2", gate=gate)  # fmt: skip
    wait_handled(tmp_path, 6)
    time.sleep(3)  # past the 2 s lease: only renewals keep the six alive
    gate.touch()
    assert proc.wait(timeout=60) == 0, (tmp_path / "worker.err").read_text()
    result = summary(tmp_path)
    assert (result["finished"], result["lease_lost"], result["settle_errors"]) == (6, 0, 0)
    assert set(WorkflowAgentDelivery.objects.filter(id__in=[d.id for d in made]).values_list("status", flat=True)) == {
        "finished"
    }
    sent = posts(tmp_path)
    rounds = [p for p in sent if p.endswith("/renew")]
    assert rounds and set(rounds) == {f"POST {gateway_server.base}/communities/{community.id}/deliveries/renew"}
    assert result["renewed"] >= 6 * 3 and len(rounds) * 6 <= result["renewed"] + 6, (len(rounds), result)


class _FakeClient:
    """The renewal calls a RemoteWorker makes, recorded; ``refuse``: the batch answers 400."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.batches: list[list[str]] = []
        self.singles: list[str] = []

    def renew_many(self, leases, lease_seconds=None):
        self.batches.append([x.delivery_id for x in leases])
        if self.refuse:
            raise GatewayHTTPError(400, "bad_request", "deliveries[1].delivery_id: must be a UUID")
        return [
            RemoteOutcome("lease_lost") if x.delivery_id == "b" else RemoteOutcome("renewed", lease=renewed(x))
            for x in leases
        ]

    def renew(self, lease, lease_seconds=None):
        self.singles.append(lease.delivery_id)
        if lease.delivery_id == "b":
            return RemoteOutcome("lease_lost")
        return RemoteOutcome("renewed", lease=renewed(lease))


def renewed(lease: RemoteLease) -> RemoteLease:
    return RemoteLease(lease.community_id, lease.delivery_id, lease.lease_generation, "later")


def held_worker(client, leases: dict[str, str]) -> RemoteWorker:
    worker = RemoteWorker(client, lambda d: None)  # type: ignore[arg-type]
    for delivery_id, community in leases.items():
        worker._held[delivery_id] = RemoteLease(community, delivery_id, 1, "now")
    return worker


def test_a_renewal_round_is_one_batch_per_community_and_a_lost_lease_is_that_delivery_s_only():
    client = _FakeClient()
    worker = held_worker(client, {"a": "c1", "b": "c1", "c": "c2", "d": "c1"})
    worker._done = _Once()
    worker._renew_loop()
    assert sorted(client.batches) == [["a", "b", "d"], ["c"]] and client.singles == []
    assert worker._counts["renewed"] == 3
    assert {d: x.lease_until for d, x in worker._held.items()} == {"a": "later", "b": "now", "c": "later", "d": "later"}


def test_a_renewal_batch_refused_as_a_whole_is_sent_again_one_lease_per_request():
    client = _FakeClient(refuse=True)
    worker = held_worker(client, {"a": "c1", "b": "c1", "c": "c1"})
    worker._renew(list(worker._held.values()))
    assert client.batches == [["a", "b", "c"]] and client.singles == ["a", "b", "c"]
    assert worker._counts["renewed"] == 2 and worker._held["b"].lease_until == "now"


class _Once:
    """A ``_done`` event that lets the renew loop run one round, then ends it."""

    def __init__(self) -> None:
        self.rounds = 0

    def wait(self, timeout: float) -> bool:
        self.rounds += 1
        return self.rounds > 1


def test_a_gateway_without_the_batch_renew_route_gets_one_renew_per_lease():
    """An older gateway answers the batch path with its read route's 405 (a 404 without it):
    the leases are renewed one by one, never left to lapse."""
    for status in (404, 405):

        class Older(_FakeClient):
            def renew_many(self, leases, lease_seconds=None, status=status):
                self.batches.append([x.delivery_id for x in leases])
                raise GatewayHTTPError(status, "method_not_allowed", "use GET for this route")

        client = Older()
        worker = held_worker(client, {"a": "c1"})
        worker._renew(list(worker._held.values()))
        assert client.batches == [["a"]] and client.singles == ["a"], status
        assert worker._counts["renewed"] == 1 and worker._held["a"].lease_until == "later"
