"""Citus: a worker's connection lost inside a request's transaction (the worker restarted, its
backend terminated, the network) fails the coordinator's COMMIT with ``XX000`` ("could not commit
transaction for shard N on at least one active node"): psycopg's ``InternalError``, not the
``OperationalError`` of a connection lost on one node. The transaction was rolled back, nothing
kept: the gateway answers it 503 ``unavailable`` (retry later), as any lost connection, not a
500, which no client sends again (a step batch's runs were then given up, a settle's leases left
to lapse, an accept's delivery settled ``retry``: an attempt spent each, on the last one ended
``failed``).

The real fault, timed: the accept's own transaction runs in this process (Django's test client),
and the worker nodes' backends are terminated after its last statement, right before its COMMIT."""

from __future__ import annotations

import json
import os

from django.test import Client

from buzz_delivery import services as core
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.gateway import nip98
from buzz_delivery.gateway import services as gateway
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory
from tests.citus_node_lost import PYTESTMARK, workers_lost_before_commit
from tests.gateway.support import deliver

pytestmark = PYTESTMARK


def test_an_accept_whose_commit_lost_a_worker_is_answered_503_and_keeps_nothing():
    community = CommunityFactory()
    key = os.urandom(32)
    pubkey = nip98.public_key_of(key)
    gateway.enroll(community.id, pubkey, enrolled_by="test")
    (delivery,) = deliver(community, pubkey)
    claimed = core.claim_delivery(community.id, pubkey, delivery_id=delivery.id, lease_seconds=60)
    assert claimed is not None
    path = f"/gateway/v1/communities/{community.id}/deliveries/{delivery.id}/accept"
    body = json.dumps({"lease_generation": claimed.lease.lease_generation}).encode()
    header = nip98.encode_header(nip98.sign_event(key, "http://testserver" + path, "POST", body))

    # after the transaction's last statement (the runs' insert), before its COMMIT; the checks
    # below use a fresh connection
    with workers_lost_before_commit(after="INSERT INTO buzz_agents_run"):
        response = Client(raise_request_exception=False).post(
            path, body, content_type="application/json", HTTP_AUTHORIZATION=header
        )

    assert (response.status_code, response.json().get("code")) == (503, "unavailable")
    assert WorkflowAgentDelivery.objects.get(id=delivery.id).status == "claimed"  # nothing kept
    assert not AgentRun.objects.filter(community_id=community.id, delivery_id=delivery.id).exists()
