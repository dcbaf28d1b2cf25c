"""Issue 29 review: the views take the key's communities from the admission statement. A key
still enrolled in one community but revoked in (or whose enrollment's community is closing)
another is refused there by every view that names that community, and nothing is written."""

from __future__ import annotations

import os

import pytest

from buzz_delivery.gateway import services as gateway
from buzz_delivery.gateway.client import GatewayClient
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory, advance_to
from tests.gateway.support import deliver, enroll
from tests.gateway.test_request_statements import BASE, send

pytestmark = pytest.mark.django_db(transaction=True)


def claimed(agent: GatewayClient, n: int) -> list[dict]:
    answer, _ = send(agent, "/deliveries/claim", {"limit": n, "wait_seconds": 0})
    assert answer.status_code == 200, answer.content
    return answer.json()["claims"]


@pytest.mark.parametrize("how", ["revoked", "quiescing"])
def test_a_held_lease_in_a_community_left_cannot_be_renewed_or_settled_while_enrolled_elsewhere(how):
    kept, left = CommunityFactory(), CommunityFactory()
    agent = GatewayClient(BASE, os.urandom(32))
    enroll(agent, kept)
    enroll(agent, left)
    deliver(left, agent.pubkey, 1)
    (claim,) = claimed(agent, 1)
    delivery_id, generation = claim["delivery"]["id"], claim["lease"]["lease_generation"]
    if how == "revoked":
        gateway.revoke(left.id, agent.pubkey)
    else:
        advance_to(left, "quiescing")
    one = {"lease_generation": generation}
    items = [{"delivery_id": delivery_id, "lease_generation": generation}]
    base = f"/communities/{left.id}/deliveries"
    for path, payload in (
        (f"{base}/finish", {"deliveries": items, "outcome": "finished"}),
        (f"{base}/renew", {"deliveries": items}),
        (f"{base}/{delivery_id}/finish", one | {"outcome": "finished"}),
        (f"{base}/{delivery_id}/renew", one),
        (f"/communities/{left.id}/events", {"name": "n", "key": "k", "payload": {}}),
    ):
        answer, _ = send(agent, path, payload)
        assert (answer.status_code, answer.json().get("code")) == (403, "not_enrolled"), (path, answer.content)
    row = WorkflowAgentDelivery.objects.get(id=delivery_id)
    assert (row.status, row.lease_generation) == ("claimed", generation)
    assert claimed(agent, 1) == []  # nothing to claim in ``kept``; ``left`` is not searched
