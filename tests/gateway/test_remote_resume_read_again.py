"""A resumed remote run whose journal read (``GET .../runs/{id}``, a read: nothing to keep) the
gateway answers 503 ``unavailable`` or 429 is read again, as a step batch is sent again: before,
the run thread gave the run up before its handler started, its lease lapsed and the reaper
counted an attempt (on the run's last one: ``failed``/``attempts_exhausted``, its calls
compensated) for a passing database error or a burst of resumed runs over the key's bound.

Real gateway, real database: the journal read waits on a table lock this test holds, past the
server's ``lock_timeout``, so the gateway answers a true 503; the lock is let go once that answer
came back."""

from __future__ import annotations

import os
import uuid

import psycopg
import pytest
from django.db import connection

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import Created, intake_event, reap_agent_runs
from buzz_delivery.gateway.client import GatewayClient, GatewayHTTPError
from buzz_delivery.gateway.remote_runs import RemoteRunContext, run_remote_claim
from buzz_delivery.testing import CommunityFactory
from project.database_url import database_url
from tests.agents_support import backdate_run_lease, make_claimable
from tests.gateway import handlers
from tests.gateway.support import enroll, start_server, stop_server

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def impatient_gateway(tmp_path):
    """A gateway whose statements wait on a lock at most 300 ms (then 503 ``unavailable``)."""
    server = start_server(tmp_path / "gunicorn.log", {"PGOPTIONS": "-c lock_timeout=300"}, threads=4)
    yield server
    stop_server(server)


class Spy(GatewayClient):
    """Lets the test's lock go once the first journal read was answered; records the answers."""

    def __init__(self, *args, release, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.release, self.answers = release, []

    def read_run(self, community_id, run_id):
        try:
            found = super().read_run(community_id, run_id)
        except GatewayHTTPError as exc:
            self.answers.append((exc.status, exc.code))
            raise
        finally:
            if len(self.answers) <= 1:
                self.release()
        self.answers.append("read")
        return found


def test_a_resumed_runs_journal_read_answered_503_is_read_again(impatient_gateway, tmp_path, monkeypatch):
    monkeypatch.setenv("GATEWAY_RUN_LEDGER", str(tmp_path / "ledger.txt"))
    community = CommunityFactory()
    blocker = psycopg.connect(database_url(connection.settings_dict, application_name="test-blocker"))
    agent = Spy(impatient_gateway.base, os.urandom(32), release=blocker.rollback)
    enroll(agent, community)
    outcome = intake_event(community.id, "test", uuid.uuid4().hex, {"fail": False}, agent.pubkey)
    assert isinstance(outcome, Created)
    (first,) = agent.claim_runs(worker_id="dies")
    key = agent.journal_call(first.lease, "effect", {"n": 1}).data["idempotency_key"]
    handlers.effect({"n": 1}, key)
    agent.record_result(first.lease, 1, ok=True, output={"n": 1})
    backdate_run_lease(outcome.run_id)  # the first holder died: its run is resumed
    assert reap_agent_runs().reclaimed == 1
    make_claimable(outcome.run_id)
    try:
        (second,) = agent.claim_runs(worker_id="resumes")
        with blocker.cursor() as cur:  # the journal read must wait on this lock
            cur.execute("LOCK TABLE buzz_agents_journal IN ACCESS EXCLUSIVE MODE")
        ctx = RemoteRunContext(agent, second)
        result = run_remote_claim(agent, second, handlers.three_calls, ctx)
    finally:
        blocker.close()
        agent.close()

    assert agent.answers[:2] == [(503, "unavailable"), "read"]  # a true 503, then read again
    assert (result, ctx.replayed) == ("completed", 1)
    assert AgentRun.objects.get(id=outcome.run_id).output == {"sum": 6}
