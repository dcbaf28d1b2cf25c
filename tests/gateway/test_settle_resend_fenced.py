"""Issue 29 review: ``work`` sends a settle batch again after a timeout. The repeat carries the
lease of the first: when the first took effect it is the same holder's ``already_terminal`` (a
``retry``'s repeat: ``settled`` pending again, no second attempt); when it did not and the
lease lapsed and another worker of the key claimed the delivery meanwhile, the repeat is
``lease_lost`` and leaves the other worker's claim as it was."""

from __future__ import annotations

import datetime as dt
import os

import pytest

from buzz_delivery.gateway.client import GatewayClient
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.services.reaper import reap_expired_deliveries
from buzz_delivery.testing import CommunityFactory, set_delivery_state
from tests.gateway.support import deliver, enroll
from tests.gateway.test_request_statements import BASE, send

pytestmark = pytest.mark.django_db(transaction=True)


def claim_one(agent: GatewayClient) -> tuple[str, int]:
    answer, _ = send(agent, "/deliveries/claim", {"limit": 1, "wait_seconds": 0})
    assert answer.status_code == 200, answer.content
    (claim,) = answer.json()["claims"]
    return claim["delivery"]["id"], claim["lease"]["lease_generation"]


def settle(agent: GatewayClient, community, delivery_id: str, generation: int, outcome: str) -> dict:
    item = {"delivery_id": delivery_id, "lease_generation": generation}
    payload = {"deliveries": [item], "outcome": outcome}
    answer, _ = send(agent, f"/communities/{community.id}/deliveries/finish", payload)
    assert answer.status_code == 200, answer.content
    (result,) = answer.json()["results"]
    return result


@pytest.mark.parametrize("outcome", ["finished", "retry"])
def test_a_repeat_of_a_settle_that_took_effect_changes_nothing(outcome):
    community = CommunityFactory()
    key = os.urandom(32)
    agent = GatewayClient(BASE, key)
    enroll(agent, community)
    deliver(community, agent.pubkey, 1)
    delivery_id, generation = claim_one(agent)
    first = settle(agent, community, delivery_id, generation, outcome)
    before = WorkflowAgentDelivery.objects.values("status", "attempt", "lease_generation").get(id=delivery_id)
    again = settle(GatewayClient(BASE, key), community, delivery_id, generation, outcome)
    after = WorkflowAgentDelivery.objects.values("status", "attempt", "lease_generation").get(id=delivery_id)
    assert before == after
    expected = "already_terminal" if outcome == "finished" else "settled"
    assert (first["outcome"], again["outcome"], again["status"]) == ("settled", expected, first["status"])


def test_a_repeat_after_the_lease_lapsed_and_another_worker_claimed_it_settles_nothing():
    community = CommunityFactory()
    key = os.urandom(32)
    one, other = GatewayClient(BASE, key), GatewayClient(BASE, key)  # two worker processes of one key
    enroll(one, community)
    deliver(community, one.pubkey, 1)
    delivery_id, generation = claim_one(one)
    # the first settle never reached the database; the lease lapses (as after its timeout)
    set_delivery_state(delivery_id, lease_until=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    assert reap_expired_deliveries() == 1  # the reaper puts it back: pending, a later attempt
    again_id, again_generation = claim_one(other)
    assert again_id == delivery_id and again_generation > generation
    assert settle(one, community, delivery_id, generation, "finished")["outcome"] == "lease_lost"
    row = WorkflowAgentDelivery.objects.get(id=delivery_id)
    assert (row.status, row.lease_generation) == ("claimed", again_generation)
    assert settle(other, community, delivery_id, again_generation, "failed")["status"] == "failed"
