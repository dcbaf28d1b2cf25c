"""A hostile caller against the run batches that record their event id in the request's own
transaction (issue 29): the same signed request sent twice at once takes effect once, and a
request refused for the bound on requests in flight (429) still spends its event id."""

from __future__ import annotations

import os
import threading
import time
from contextlib import ExitStack

import psycopg
import pytest
from django.db import connection
from django.test import Client

from buzz_delivery.gateway import limits
from buzz_delivery.gateway.client import GatewayClient
from buzz_delivery.gateway.conf import get_settings
from buzz_delivery.testing import CommunityFactory
from project.database_url import database_url
from tests.agents_support import claim, counts, new_run
from tests.citus_support import CITUS_MODE, waits_for_a_row_lock
from tests.gateway.support import enroll, new_agent
from tests.gateway.test_batch_one_transaction import a_completion_waits_for_a_row_lock, post, seen, signed_post
from tests.gateway.test_runs import run_state

pytestmark = pytest.mark.django_db(transaction=True)


def the_second_waits_for_the_event_id() -> bool:
    """Whether a request's admission (ADMIT_IF_FRESH_ENROLLED_AND_UNSEEN) waits for a lock: the
    key of the event id another transaction inserted and has not committed."""
    if CITUS_MODE:
        return waits_for_a_row_lock(0, "%WITH clock AS%buzz_gateway_seen_event%")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'buzz-gateway-test'"
            " AND wait_event_type = 'Lock' AND query LIKE '%%buzz_gateway_seen_event%%'"
        )
        return cursor.fetchone()[0] > 0


def test_the_same_signed_batch_sent_twice_at_once_takes_effect_once(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    new_run(community.id, agent.pubkey)
    (claim,) = agent.claim_runs(1, worker_id="remote-1", lease_seconds=30)
    lease = {"run_id": claim.lease.run_id, "lease_generation": claim.lease.lease_generation}
    path = f"/communities/{community.id}/runs/complete"
    header, body = signed_post(agent, path, {"runs": [{**lease, "output": {"n": 1}}], "worker_id": "remote-1"})
    before = seen(agent)
    answers: dict[str, object] = {}

    def send(name: str) -> None:
        answers[name] = post(agent, path, header, body)

    first, second = (threading.Thread(target=send, args=(n,), daemon=True) for n in ("first", "second"))
    # Another transaction holds the run's row: the first request takes the event id (not yet
    # committed) and waits for the row; the second arrives while the first is inside.
    with psycopg.connect(database_url(connection.settings_dict)) as holder:
        holder.execute(
            "SELECT id FROM buzz_agents_run WHERE community_id = %s AND id = %s FOR UPDATE",
            [community.id, claim.lease.run_id],
        )
        first.start()
        deadline = time.monotonic() + 10
        while not a_completion_waits_for_a_row_lock():
            assert time.monotonic() < deadline, "the first request never waited for the row"
            time.sleep(0.001)
        second.start()
        while not the_second_waits_for_the_event_id():
            assert time.monotonic() < deadline, "the second request never waited for the event id"
            time.sleep(0.001)
        assert seen(agent) == before  # neither has committed its id
        holder.rollback()
    first.join(10)
    second.join(10)
    statuses = sorted((r.status_code, r.json().get("code")) for r in answers.values())
    assert statuses == [(200, None), (401, "auth_replayed")], statuses
    winner = next(r for r in answers.values() if r.status_code == 200)
    assert winner.json()["results"][0]["outcome"] == "finished"
    assert seen(agent) == before + 1


def test_a_run_batch_refused_for_too_many_requests_spends_its_event_id_and_writes_nothing_else(community):
    agent = GatewayClient("http://testserver/gateway/v1", os.urandom(32))  # served in this process
    enroll(agent, community)
    path = f"/communities/{community.id}/runs/complete"
    lease = {"run_id": str(new_run(community.id, agent.pubkey)), "lease_generation": 1}
    rows, state = counts(), run_state()
    header, body = signed_post(agent, path, {"runs": [{**lease, "output": 1}], "worker_id": "remote-1"})
    client = Client()

    def send():
        return client.post("/gateway/v1" + path, body, content_type="application/json", HTTP_AUTHORIZATION=header)

    before = seen(agent)
    with ExitStack() as held:  # every slot of the key in this process is held (requests in flight)
        for _ in range(get_settings().max_requests_per_key):
            held.enter_context(limits.request(agent.pubkey, None))
        refused = send()
    assert (refused.status_code, refused.json()["code"]) == (429, "too_many_requests")
    assert refused["Retry-After"] == "1"
    assert seen(agent) == before + 1  # committed with the refusal
    assert counts() == rows and run_state() == state
    again = send()
    assert (again.status_code, again.json()["code"]) == (401, "auth_replayed")
    assert counts() == rows and run_state() == state


def test_a_run_batch_the_database_refuses_inside_the_request_transaction_falls_back_to_one_run_at_a_time(
    community, monkeypatch
):
    from buzz_delivery.agents.services import batch

    agent = GatewayClient("http://testserver/gateway/v1", os.urandom(32))  # served in this process
    enroll(agent, community)
    run_ids = [new_run(community.id, agent.pubkey) for _ in range(2)]
    leases = [claim(community.id, r, worker="remote-1", agent=agent.pubkey) for r in run_ids]
    real = batch.complete_runs

    def refused_after_writing(community_id, completions):
        real(community_id, completions)  # the batch's write, then the database refuses the batch
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 / 0")

    monkeypatch.setattr(batch, "complete_runs", refused_after_writing)
    path = f"/communities/{community.id}/runs/complete"
    items = [{"run_id": str(x.run_id), "lease_generation": x.lease_generation, "output": {"n": 1}} for x in leases]
    header, body = signed_post(agent, path, {"runs": items, "worker_id": "remote-1"})
    before = seen(agent)
    answer = Client().post("/gateway/v1" + path, body, content_type="application/json", HTTP_AUTHORIZATION=header)
    assert answer.status_code == 200, answer.content
    # The refused batch wrote nothing (its savepoint rolled back): each run is completed once,
    # by its one-run form, in the request's transaction, which commits the event id with it.
    assert [r["outcome"] for r in answer.json()["results"]] == ["finished", "finished"]
    assert seen(agent) == before + 1
