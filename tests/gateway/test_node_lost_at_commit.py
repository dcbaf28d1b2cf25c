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
from unittest import mock

import psycopg
import pytest
from django.db import connection
from django.test import Client

from buzz_delivery import services as core
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.gateway import nip98
from buzz_delivery.gateway import services as gateway
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory
from project.database_url import database_url
from tests.citus_support import CITUS_MODE, with_database, worker_urls
from tests.gateway.support import deliver

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CITUS_MODE, reason="a Citus coordinator's COMMIT failing for a lost worker connection"),
]


def _terminate_worker_backends() -> None:
    name = connection.settings_dict["NAME"]
    for url in worker_urls(database_url(connection.settings_dict)):
        with psycopg.connect(with_database(url, name), autocommit=True) as worker:
            worker.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            )


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

    commit = connection._commit
    inserted: list[str] = []

    def note_the_runs_insert(execute, sql, params, many, context):
        if "INSERT INTO buzz_agents_run" in sql:
            inserted.append(sql)
        return execute(sql, params, many, context)

    def lose_the_workers_then_commit():  # after the transaction's last statement, before its COMMIT
        if inserted:
            inserted.clear()
            _terminate_worker_backends()
        return commit()

    with (
        connection.execute_wrapper(note_the_runs_insert),
        mock.patch.object(connection, "_commit", lose_the_workers_then_commit),
    ):
        response = Client(raise_request_exception=False).post(
            path, body, content_type="application/json", HTTP_AUTHORIZATION=header
        )
    connection.close()  # this session met the lost node: the checks below use a fresh one

    assert (response.status_code, response.json().get("code")) == (503, "unavailable")
    assert WorkflowAgentDelivery.objects.get(id=delivery.id).status == "claimed"  # nothing kept
    assert not AgentRun.objects.filter(community_id=community.id, delivery_id=delivery.id).exists()
