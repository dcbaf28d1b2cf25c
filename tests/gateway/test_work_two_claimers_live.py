"""Issue 29 review: ``work``'s two claimers and two settlers against the real gateway (gunicorn,
real threads): every delivery is handled once by the one worker, and the claims never put more
in its hands than ``concurrency`` + claim-ahead (the room the two claims in flight share)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from buzz_delivery.gateway.client import RemoteWorker
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory
from tests.gateway.support import deliver, enroll, new_agent

pytestmark = pytest.mark.django_db(transaction=True)

TOTAL = 900
CONCURRENCY = 8
AHEAD = 60  # with 10 ms handlers the whole claim-ahead: room for two claims in flight


def test_two_claimers_hand_each_delivery_out_once_and_never_past_the_room(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    for _ in range(3):
        deliver(community, agent.pubkey, TOTAL // 3)
    lock = threading.Lock()
    handled: Counter[str] = Counter()
    worst = {"held": 0, "handling": 0}
    worker: RemoteWorker

    def handler(delivery: dict) -> None:
        with worker._lock:  # what the claims have put in this worker's hands
            worst["handling"] = max(worst["handling"], worker._handling)
            worst["held"] = max(worst["held"], len(worker._held))
        with lock:
            handled[delivery["id"]] += 1
        time.sleep(0.01)

    worker = RemoteWorker(
        agent, handler, concurrency=CONCURRENCY, claim_ahead=AHEAD, wait_seconds=0.5, idle_exit=1.0, lease_seconds=60
    )
    summary = worker.run()
    assert summary["exit_code"] == 0, summary
    assert [k for k, n in handled.items() if n > 1] == []
    assert len(handled) == TOTAL and summary["finished"] == TOTAL, summary
    assert WorkflowAgentDelivery.objects.filter(status="finished").count() == TOTAL
    # claimed and not through a handler: at most the handler threads plus the claim-ahead
    assert worst["handling"] <= CONCURRENCY + AHEAD, worst
    assert worst["held"] <= CONCURRENCY + AHEAD + 2 * worker.settle_batch, worst
