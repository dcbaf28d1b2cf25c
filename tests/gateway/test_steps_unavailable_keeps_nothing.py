"""A step batch answered 503 kept nothing (issue 29): the client sends it again, signed anew, so
a write the first attempt kept would be applied twice (a call journaled twice, its budget spent
twice). A deadlock in a later kind's one-run replay used to be answered 503 while the request's
transaction committed what the earlier kinds had written."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.db import connection

from buzz_delivery.agents.models import JournalEntry
from buzz_delivery.testing import CommunityFactory
from project.database_url import database_url
from tests.agents_support import new_run
from tests.citus_support import CITUS_MODE
from tests.gateway.support import enroll, new_agent
from tests.gateway.test_batch_one_transaction import a_completion_waits_for_a_row_lock, post, seen, signed_post
from tests.gateway.test_batch_steps import _ref

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(CITUS_MODE, reason="a deadlock staged on one PostgreSQL's row locks"),
]

LOCK = "SELECT id FROM buzz_agents_run WHERE community_id = %s AND id = %s FOR UPDATE"


def test_a_steps_request_answered_503_keeps_none_of_its_writes(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    for _ in range(2):
        new_run(community.id, agent.pubkey)
    journaled, completed = [c.lease for c in agent.claim_runs(2, worker_id="remote-1", lease_seconds=60)]
    before = seen(agent)
    answers: list = []

    path = f"/communities/{community.id}/runs/steps"
    header, body = signed_post(
        agent,
        path,
        {
            "calls": [{**_ref(journaled), "tool_name": "fetch", "args": {}}],
            "complete": [{**_ref(completed), "output": {"a": 1}}],
            "worker_id": "remote-1",
        },
    )

    def send() -> None:
        answers.append(post(agent, path, header, body))

    with psycopg.connect(database_url(connection.settings_dict)) as holder:
        holder.execute("SET deadlock_timeout = '60s'")  # the gateway's side is the deadlock's victim
        holder.execute(LOCK, [community.id, completed.run_id])
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        deadline = time.monotonic() + 10
        while not a_completion_waits_for_a_row_lock():  # the call journaled, the completion waits
            assert time.monotonic() < deadline, "the completion never waited for the row"
            time.sleep(0.001)
        # The holder now waits for the journaled run's row: the completion (batched, then its
        # one-run replay) is a deadlock's victim each time, after the gateway's deadlock_timeout.
        locker = threading.Thread(target=lambda: holder.execute(LOCK, [community.id, journaled.run_id]), daemon=True)
        locker.start()
        sender.join(30)
        locker.join(30)
        holder.rollback()
    (answer,) = answers
    assert answer.status_code == 503, answer.text
    # Nothing kept: the call the request journaled before its 503 is not in the journal...
    assert JournalEntry.objects.filter(community_id=community.id, run_id=journaled.run_id).count() == 0
    # ...but its event id: the signed request cannot be replayed (the client signs anew).
    assert seen(agent) == before + 1
    again = post(agent, path, header, body)
    assert (again.status_code, again.json()["code"]) == (401, "auth_replayed")
    assert JournalEntry.objects.filter(community_id=community.id, run_id=journaled.run_id).count() == 0
