"""A remote ``ctx.emit`` (and ``ctx.request_approval``: requests of their own, never batched)
the gateway refused 429 ``too_many_requests`` (the key's bound on requests in flight on that
server: refused before any write) is sent again after its ``Retry-After``: before, the run was
marked lost at once, its lease left to lapse and an attempt counted by the reaper (on the run's
last: ``failed``/``attempts_exhausted``, its calls compensated), for a burst of a streaming
worker's runs over the bound. A 503 is not sent again here: an emit is not one transaction
with its event id, it may have been kept.

Real gateway, real database: a server with one request in flight per key, whose one slot a
read of the same key holds while it waits on a table lock this test holds; the lock is let go
once the emit's 429 came back."""

from __future__ import annotations

import os
import threading
import time
import uuid

import psycopg
import pytest
from django.db import connection

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import Created, intake_event
from buzz_delivery.gateway.client import GatewayClient
from buzz_delivery.gateway.remote_runs import RemoteRunContext
from buzz_delivery.testing import CommunityFactory
from project.database_url import database_url
from tests.gateway.support import ReleasingClient, TableLock, enroll

pytestmark = pytest.mark.django_db(transaction=True)


def _waiting_on_the_journal() -> bool:
    with psycopg.connect(database_url(connection.settings_dict, application_name="test-watch")) as watch:
        row = watch.execute(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'buzz_agents_journal'::regclass"
        ).fetchone()
    return bool(row and row[0])


def test_an_emit_refused_429_is_sent_again_not_the_run_given_up(one_request_per_key):
    community = CommunityFactory()
    lock = TableLock()  # let go once the first emit was answered
    agent = ReleasingClient(one_request_per_key.base, os.urandom(32), release=lock.release, watched="emit")
    enroll(agent, community)
    outcome = intake_event(community.id, "test", uuid.uuid4().hex, {"fail": False}, agent.pubkey)
    assert isinstance(outcome, Created)
    (claim,) = agent.claim_runs(worker_id="streams")
    ctx = RemoteRunContext(agent, claim)
    reader = GatewayClient(one_request_per_key.base, agent._key)  # the same key: its one slot
    try:
        lock.hold("buzz_agents_journal")
        holding = threading.Thread(target=reader.read_run, args=(community.id, outcome.run_id), daemon=True)
        holding.start()
        while not _waiting_on_the_journal():  # the read holds the key's slot now
            time.sleep(0.02)
        try:
            seq = ctx.emit("hello")
        except Exception as exc:  # the defect: the run given up
            seq = exc
        holding.join(30)
    finally:
        lock.close()
        agent.close()
        reader.close()

    assert agent.answers[0] == (429, "too_many_requests")  # a true refusal of the gateway
    assert (seq, ctx.lost.is_set()) == (1, False)
    assert AgentRun.objects.get(id=outcome.run_id).output_chunks == 1
