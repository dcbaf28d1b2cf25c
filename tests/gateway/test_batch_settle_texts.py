"""a request-level text the batch cannot apply is a 400 naming it, as the single
finish refuses it, not silently dropped."""

from __future__ import annotations

import pytest

from buzz_delivery.testing import CommunityFactory
from tests.gateway.support import deliver, enroll, new_agent
from tests.gateway.test_batch_settles import rows

pytestmark = pytest.mark.django_db(transaction=True)


def test_request_texts_no_item_takes_are_refused_by_name(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    deliver(community, agent.pubkey, 1)
    (a,) = (x.lease for x in agent.claim(limit=1))
    item = {"delivery_id": a.delivery_id, "lease_generation": 1, "outcome": "retry"}
    path = f"/communities/{community.id}/deliveries/finish"
    before = rows()
    answers = {}
    for body, field in (
        ({"deliveries": [item], "outcome": "finished", "retry_after": 5}, "retry_after"),
        ({"deliveries": [item], "outcome": None, "failure_code": "x"}, "failure_code"),
    ):
        response = agent.request("POST", path, body)
        answers[field] = (response.status_code, response.json().get("field"))
        if response.status_code == 200:
            break
    assert answers == {"retry_after": (400, "retry_after"), "failure_code": (400, "failure_code")}, answers
    assert rows() == before
