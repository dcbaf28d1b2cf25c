"""A cancel racing the run's ``request_approval`` (real threads, their own connections).

``cancel_agent_run`` expires the run's pending approval before it locks the run (approval then
run, the order of ``decide_approval``). A ``request_approval`` in flight holds the run row, so
the cancel's expiry found no approval yet (the run was ``running`` in its snapshot), then the
cancel waited for the run, saw it ``waiting_approval`` and ended it ``cancelled``: the approval
was left ``pending`` in the operators' queue for a run that no longer waited, and deciding it
answered ``Decided`` although nothing moved. Found in review: the test failed before the fix
(the approval stayed ``pending`` and the decision said ``Decided``).
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import ApprovalRequested, Cancelled, cancel_agent_run, request_approval
from buzz_delivery.testing import CommunityFactory
from buzz_delivery.workflows.models import Approval
from buzz_delivery.workflows.services import Expired, decide_approval
from tests.agents_support import claim, new_run
from tests.citus_support import waits_for_a_row_lock

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_cancel_racing_request_approval_expires_the_approval_it_did_not_see_yet():
    community_id = CommunityFactory().id
    run_id = new_run(community_id)
    lease = claim(community_id, run_id)
    requested_ = threading.Event()
    go_on = threading.Event()
    pid: list[int] = []
    outcomes: list[object] = []
    errors: list[BaseException] = []

    def requester():
        try:
            with transaction.atomic():
                outcomes.append(request_approval(lease, prompt="ship?", deadline_seconds=600))
                requested_.set()  # the run row is held until this commits
                go_on.wait(60)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    def canceller():
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                pid.append(cursor.fetchone()[0])
            outcomes.append(cancel_agent_run(community_id, run_id))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    a = threading.Thread(target=requester)
    a.start()
    assert requested_.wait(60)
    c = threading.Thread(target=canceller)
    c.start()
    while not pid:
        time.sleep(0.001)
    deadline = time.monotonic() + 30
    while not waits_for_a_row_lock(pid[0], "%buzz_agents_run%") and c.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    go_on.set()
    a.join(60)
    c.join(60)
    assert not errors, errors
    requested, cancelled = outcomes
    assert isinstance(requested, ApprovalRequested)
    assert cancelled == Cancelled(run_id)
    assert AgentRun.objects.get(id=run_id).state == "cancelled"
    approval = Approval.objects.get(id=requested.approval_id)
    assert approval.state == "expired"  # not left pending for a run that no longer waits
    assert isinstance(decide_approval(community_id, approval.id, "approved", "alice"), Expired)
