"""A run batch request in one transaction (issue 29): its event id is recorded in the transaction
of its writes (one commit a request), and a refused request still records it, writing nothing
else, so it cannot be replayed."""

from __future__ import annotations

import json
import threading
import time

import httpx
import psycopg
import pytest
from django.db import connection

from buzz_delivery.gateway import nip98
from buzz_delivery.gateway.client import GatewayClient
from buzz_delivery.gateway.models import SeenEvent
from buzz_delivery.testing import CommunityFactory
from project.database_url import database_url
from tests.agents_support import counts, new_run
from tests.citus_support import CITUS_MODE, waits_for_a_row_lock
from tests.gateway.support import enroll, new_agent
from tests.gateway.test_runs import run_state

pytestmark = pytest.mark.django_db(transaction=True)


def seen(agent: GatewayClient) -> int:
    return SeenEvent.objects.filter(pubkey=agent.pubkey).count()


def signed_post(agent: GatewayClient, path: str, payload: dict) -> tuple[str, bytes]:
    """A signed request's Authorization header and body, to send (and send again) as they are."""
    body = json.dumps(payload, separators=(",", ":")).encode("utf-8")
    event = nip98.sign_event(agent._key, agent.base_url + path, "POST", body)
    return nip98.encode_header(event), body


def post(agent: GatewayClient, path: str, header: str, body: bytes) -> httpx.Response:
    headers = {"Authorization": header, "Content-Type": "application/json"}
    return httpx.post(agent.base_url + path, content=body, headers=headers, timeout=10)


def a_completion_waits_for_a_row_lock() -> bool:
    if CITUS_MODE:
        # The blocked statement as Citus shows it: its first 1024 characters (track_activity_query_size)
        # with the arrays inlined, which end before the table's name: matched by how it starts (the
        # agents' batches that end runs open with their workflow runs' lock, agents sql.SOURCES).
        return waits_for_a_row_lock(0, "%WITH sources AS MATERIALIZED%")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'buzz-gateway-test'"
            " AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0] > 0


def test_a_run_batch_records_its_event_id_only_with_its_writes(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    for _ in range(2):
        new_run(community.id, agent.pubkey)
    leases = [c.lease for c in agent.claim_runs(2, worker_id="remote-1", lease_seconds=30)]
    before = seen(agent)
    answers: list = []
    # Another transaction holds run 0's row: the batch's completion waits for it.
    with psycopg.connect(database_url(connection.settings_dict)) as holder:
        holder.execute(
            "SELECT id FROM buzz_agents_run WHERE community_id = %s AND id = %s FOR UPDATE",
            [community.id, leases[0].run_id],
        )
        sender = threading.Thread(
            target=lambda: answers.append(agent.complete_runs([(x, {"n": 1}) for x in leases])), daemon=True
        )
        sender.start()
        deadline = time.monotonic() + 10
        while not a_completion_waits_for_a_row_lock():
            assert time.monotonic() < deadline, "the batch never waited for the row"
            time.sleep(0.001)
        # Signature checked and the id taken, but not committed before the writes are.
        assert seen(agent) == before
        holder.rollback()
    sender.join(10)
    assert [r.outcome for r in answers[0]] == ["finished", "finished"]
    assert seen(agent) == before + 1


def test_a_refused_run_batch_request_records_its_event_id_writes_nothing_else_and_cannot_be_replayed(
    gateway_server,
):
    community, elsewhere = CommunityFactory(), CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    new_run(community.id, agent.pubkey)
    (claim,) = agent.claim_runs(1, worker_id="remote-1", lease_seconds=30)
    lease = {"run_id": claim.lease.run_id, "lease_generation": claim.lease.lease_generation}
    rows, state = counts(), run_state()
    c = f"/communities/{community.id}/runs"
    for path, payload, status in (
        (f"{c}/complete", {"runs": [{**lease, "output": {"s": "a\x00b"}}]}, 400),
        (f"{c}/calls", {"runs": [{**lease, "tool_name": "", "args": {}}]}, 400),
        (f"{c}/results", {"runs": [{**lease, "seq": 0, "ok": True}]}, 400),
        (f"/communities/{elsewhere.id}/runs/complete", {"runs": [{**lease, "output": 1}]}, 403),
    ):
        header, body = signed_post(agent, path, {**payload, "worker_id": "remote-1"})
        before = seen(agent)
        assert post(agent, path, header, body).status_code == status, path
        assert seen(agent) == before + 1, path  # the refusal rolled back to its savepoint only
        again = post(agent, path, header, body)
        assert (again.status_code, again.json()["code"]) == (401, "auth_replayed"), path
        assert counts() == rows and run_state() == state, path
    # A request that went through cannot be replayed either.
    path = f"{c}/complete"
    header, body = signed_post(agent, path, {"runs": [{**lease, "output": {"n": 1}}], "worker_id": "remote-1"})
    assert post(agent, path, header, body).json()["results"][0]["outcome"] == "finished"
    again = post(agent, path, header, body)
    assert (again.status_code, again.json()["code"]) == (401, "auth_replayed")
