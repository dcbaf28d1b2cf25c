"""A run claim that finds runs commits them with its event id, in one transaction (issue 29: the
claim was two commits in a K = 1 remote worker's chain of requests); one that finds none commits
the id alone and then waits, outside any transaction, as before."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection

from buzz_delivery.gateway.models import SeenEvent
from buzz_delivery.testing import CommunityFactory
from tests.agents_support import new_run
from tests.citus_support import CITUS_MODE
from tests.gateway.support import enroll, new_agent

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(CITUS_MODE, reason="xmin is a node's own: compared on one PostgreSQL only"),
]


def _xmins(sql: str, params: list) -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return {row[0] for row in cursor.fetchall()}


def _new_event_xmins(agent, before: set[bytes]) -> set[str]:
    rows = SeenEvent.objects.filter(pubkey=agent.pubkey).exclude(event_id__in=before)
    ids = [bytes(r.event_id) for r in rows]
    assert len(ids) == 1, ids
    return _xmins("SELECT xmin::text FROM buzz_gateway_seen_event WHERE event_id = ANY(%s)", [ids])


@pytest.mark.parametrize("wait_seconds", [0, 2])
def test_a_claim_that_finds_runs_commits_them_with_its_event_id(gateway_server, wait_seconds):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    runs = [new_run(community.id, agent.pubkey) for _ in range(2)]
    before = {bytes(e) for e in SeenEvent.objects.filter(pubkey=agent.pubkey).values_list("event_id", flat=True)}
    claims = agent.claim_runs(2, wait_seconds=wait_seconds, worker_id="remote-1")
    assert sorted(c.lease.run_id for c in claims) == sorted(str(r) for r in runs)
    claimed = _xmins(
        "SELECT xmin::text FROM buzz_agents_run WHERE community_id = %s AND id = ANY(%s)", [community.id, runs]
    )
    assert claimed == _new_event_xmins(agent, before)


def test_a_long_poll_claim_commits_its_event_id_before_it_waits(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    before = {bytes(e) for e in SeenEvent.objects.filter(pubkey=agent.pubkey).values_list("event_id", flat=True)}
    answers: list = []
    waiter = threading.Thread(target=lambda: answers.append(agent.claim_runs(1, wait_seconds=5)), daemon=True)
    waiter.start()
    deadline = time.monotonic() + 5
    # The id is committed (visible here) while the claim still waits: no transaction held open.
    while not SeenEvent.objects.filter(pubkey=agent.pubkey).exclude(event_id__in=before).exists():
        assert time.monotonic() < deadline, "the waiting claim's event id was not committed"
        time.sleep(0.01)
    assert not answers
    run = new_run(community.id, agent.pubkey)
    waiter.join(10)
    assert [c.lease.run_id for c in answers[0]] == [str(run)]
