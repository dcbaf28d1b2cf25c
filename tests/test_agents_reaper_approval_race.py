"""The agents' reaper timing out a run whose ``request_approval`` committed during its pass
(real threads, their own connections).

A pass expires the approvals of overdue ``waiting_approval`` runs, then locks its candidate
runs (``SKIP LOCKED``) and times them out. A run that was ``running`` when the expiry read it
and ``waiting_approval`` once locked (its holder's ``request_approval`` committed in between)
was timed out with its new approval left ``pending``: the operators' queue kept it, and deciding
it answered ``Decided`` though nothing moved. The window is made wide here by another overdue
run's approval, row-locked by a third connection, on which the expiry waits. Found in review:
the test failed before the fix (the approval stayed ``pending``, the run ended ``timeout``).
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import ApprovalRequested, reap_agent_runs, request_approval
from buzz_delivery.testing import CommunityFactory
from buzz_delivery.workflows.models import Approval
from buzz_delivery.workflows.services import Expired, decide_approval
from tests.agents_support import claim, new_run
from tests.citus_support import waits_for_a_row_lock

pytestmark = pytest.mark.django_db(transaction=True)


def _overdue(run_id) -> None:
    with connection.cursor() as cursor:
        cursor.execute("UPDATE buzz_agents_run SET timeout_at = now() - interval '1 second' WHERE id = %s", [run_id])


def test_a_run_that_parked_for_approval_during_the_pass_is_not_ended_with_its_approval_pending():
    community_id = CommunityFactory().id
    other = new_run(community_id)
    other_approval = request_approval(claim(community_id, other), deadline_seconds=600)
    assert isinstance(other_approval, ApprovalRequested)
    run_id = new_run(community_id)
    lease = claim(community_id, run_id)
    _overdue(other)
    _overdue(run_id)

    held = threading.Event()
    release = threading.Event()
    pid: list[int] = []
    errors: list[BaseException] = []

    def holder():  # holds the other run's approval row: the pass's expiry waits on it
        try:
            with transaction.atomic():
                Approval.objects.select_for_update().get(community_id=community_id, id=other_approval.approval_id)
                held.set()
                release.wait(60)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    def reaper():
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                pid.append(cursor.fetchone()[0])
            reap_agent_runs()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    h = threading.Thread(target=holder)
    h.start()
    assert held.wait(60)
    r = threading.Thread(target=reaper)
    r.start()
    while not pid:
        time.sleep(0.001)
    deadline = time.monotonic() + 30
    while not waits_for_a_row_lock(pid[0], "%buzz_workflows_approval%") and time.monotonic() < deadline:
        time.sleep(0.005)
    requested = request_approval(lease, prompt="ship?", deadline_seconds=600)  # commits during the pass
    release.set()
    h.join(60)
    r.join(60)
    assert not errors, errors
    assert isinstance(requested, ApprovalRequested)
    approval = Approval.objects.get(id=requested.approval_id)
    state = AgentRun.objects.get(id=run_id).state
    assert (state, approval.state) in {("waiting_approval", "pending"), ("timeout", "expired")}, (state, approval.state)
    reap_agent_runs()  # the next pass expires it, and the run ends
    assert Approval.objects.get(id=requested.approval_id).state == "expired"
    assert AgentRun.objects.get(id=run_id).state == "timeout"
    assert isinstance(decide_approval(community_id, requested.approval_id, "approved", "alice"), Expired)
