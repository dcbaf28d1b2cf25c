"""A decision on an agent run's approval racing the cancel of the workflow run that started it
(real threads, their own connections).

``decide_approval`` takes the approval, then (its trigger) the agent run; the workflow cancel's
trigger takes the agent runs, then their approvals: when both are on the way, PostgreSQL aborts
one as a deadlock's victim. The cancel retries (``retry_deadlocks``); the decision did not, so an
operator or a gateway caller got ``deadlock detected`` instead of the typed outcome of the side
that won (``Expired``: the run ended first). A third connection holding the agent run lines the
two up, and the sessions' ``deadlock_timeout`` make the decision the victim. Found in review:
the test failed before the fix (``decide_approval`` raised ``OperationalError``).
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction

from buzz_delivery import services as core
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import Accepted, accept_delivery, claim_agent_runs
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.models import Approval
from buzz_delivery.workflows.services import Canceled, Expired, cancel_run, decide_approval
from buzz_delivery.workflows.testing import run_until_idle, send_step
from tests import agent_handlers as h
from tests.citus_support import waits_for_a_row_lock
from tests.wf_support import start

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_LEDGER", str(tmp_path / "ledger.txt"))
    monkeypatch.delenv("AGENT_KILL", raising=False)


def _waiting(pid: list[int], thread: threading.Thread, pattern: str) -> None:
    while not pid:
        time.sleep(0.001)
    deadline = time.monotonic() + 30
    while not waits_for_a_row_lock(pid[0], pattern) and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.002)


def test_a_decision_that_loses_to_a_workflow_cancel_is_told_expired_not_deadlock(community):
    agent = random32()
    run = start(WorkflowFactory(community=community), {"steps": [send_step("ask", [agent], **{"await": "agent_run"})]})
    run_until_idle(community.id)
    (d,) = WorkflowAgentDelivery.objects.filter(run_id=run.pk)
    claimed = core.claim_delivery(community.id, agent, delivery_id=d.id, lease_seconds=30)
    accepted = accept_delivery(claimed.lease, input={"mode": "approve"})
    assert isinstance(accepted, Accepted)
    (claim,) = claim_agent_runs(community.id, [agent], worker_id="w")
    assert run_claim(claim, h.approve_then_call) == "parked"
    approval_id = AgentRun.objects.get(id=accepted.run_id).approval_id

    held, release = threading.Event(), threading.Event()
    pids: dict[str, list[int]] = {"cancel": [], "decide": []}
    outcomes: dict[str, object] = {}

    def holder():  # holds the agent run: the cancel, then the decision, queue behind it
        try:
            with transaction.atomic():
                AgentRun.objects.select_for_update(no_key=True).get(community_id=community.id, id=accepted.run_id)
                held.set()
                release.wait(60)
        finally:
            connections.close_all()

    def call(name, fn, deadlock_timeout):
        def body():
            try:
                with connection.cursor() as cursor:
                    # Who looks for the cycle first is its victim: the decision, well after the
                    # holder's release (a loaded machine), and long before the cancel would.
                    cursor.execute("SELECT set_config('deadlock_timeout', %s, false)", [deadlock_timeout])
                    cursor.execute("SELECT pg_backend_pid()")
                    pids[name].append(cursor.fetchone()[0])
                outcomes[name] = fn()
            except BaseException as exc:
                outcomes[name] = exc
            finally:
                connections.close_all()

        return threading.Thread(target=body)

    hold = threading.Thread(target=holder)
    hold.start()
    assert held.wait(60)
    canceller = call("cancel", lambda: cancel_run(community.id, run.pk), "60s")
    canceller.start()
    _waiting(pids["cancel"], canceller, "%buzz_agents_run%")
    decider = call("decide", lambda: decide_approval(community.id, approval_id, "approved", "alice"), "3s")
    decider.start()
    _waiting(pids["decide"], decider, "%buzz_workflows_approval%")
    release.set()  # within the decision's deadlock_timeout: it finds the cycle, and is its victim
    for t in (hold, canceller, decider):
        t.join(60)
    assert isinstance(outcomes["cancel"], Canceled), outcomes
    assert isinstance(outcomes["decide"], Expired), outcomes
    assert Approval.objects.get(community_id=community.id, id=approval_id).state == "expired"
    assert AgentRun.objects.get(id=accepted.run_id).failure_code == "workflow_canceled"
