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

import pytest

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import Created, intake_event, reap_agent_runs
from buzz_delivery.gateway.remote_runs import RemoteRunContext, run_remote_claim
from buzz_delivery.testing import CommunityFactory
from tests.agents_support import backdate_run_lease, make_claimable
from tests.gateway import handlers
from tests.gateway.support import ReleasingClient, TableLock, enroll

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_resumed_runs_journal_read_answered_503_is_read_again(impatient_gateway, tmp_path, monkeypatch):
    monkeypatch.setenv("GATEWAY_RUN_LEDGER", str(tmp_path / "ledger.txt"))
    community = CommunityFactory()
    lock = TableLock()  # let go once the first journal read was answered
    agent = ReleasingClient(
        impatient_gateway.base, os.urandom(32), release=lock.release, watched="read_run", answered=lambda _: "read"
    )
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
        lock.hold("buzz_agents_journal")  # the journal read must wait on this lock
        ctx = RemoteRunContext(agent, second)
        result = run_remote_claim(agent, second, handlers.three_calls, ctx)
    finally:
        lock.close()
        agent.close()

    assert agent.answers[:2] == [(503, "unavailable"), "read"]  # a true 503, then read again
    assert (result, ctx.replayed) == ("completed", 1)
    assert AgentRun.objects.get(id=outcome.run_id).output == {"sum": 6}
