"""fail_run / fail_runs racing a journal_call of the same run (same holder: threads of one holder
may call tools at once, SPEND_CALL's comment) never end the run ``failed`` with the just-journaled
call still ``pending`` with a compensation, never undone (issue 28's invariant).

The journal_call holds the run row (SPEND_CALL's UPDATE) until it commits the pending entry. A
failure that waited on that row inside its judging statement would judge OUTSTANDING on the
snapshot it took before waiting ("nothing to undo"), so both forms lock the run rows first, in a
statement of their own (LOCK_RUN, LOCK_RUNS), and judge on a snapshot taken after the wait. Found
in review; both tests failed before that lock."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import batch as b
from buzz_delivery.agents.services import fail_run, journal_call
from tests.agents_support import claim, new_run
from tests.citus_support import waits_for_a_row_lock

pytestmark = pytest.mark.django_db(transaction=True)
UNDO = {"function": "m:undo"}


def _waits_for_a_lock(pid: int) -> bool:
    return waits_for_a_row_lock(pid, "%buzz_agents_run%")


def _race(fail) -> tuple[object, str, list]:
    community_id = None
    lease = None

    def setup(cid):
        nonlocal lease
        lease = claim(cid, new_run(cid))

    from buzz_delivery.testing import CommunityFactory

    community_id = CommunityFactory().id
    setup(community_id)
    journaled = threading.Event()
    go_on = threading.Event()
    pid: list[int] = []
    result: list[object] = []

    def journaler():
        try:
            with transaction.atomic():
                journal_call(lease, "t", {"n": 1}, compensation=UNDO)  # holds the run row's lock
                journaled.set()
                go_on.wait(60)
        finally:
            connections.close_all()

    def failer():
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                pid.append(cursor.fetchone()[0])
            result.append(fail(lease))
        finally:
            connections.close_all()

    a = threading.Thread(target=journaler)
    a.start()
    assert journaled.wait(60)
    f = threading.Thread(target=failer)
    f.start()
    while not pid:
        time.sleep(0.001)
    waited = False
    while not waited:
        waited = _waits_for_a_lock(pid[0])
        if not f.is_alive():
            break
    assert waited, "the failure never waited for the journaler's lock"
    go_on.set()
    a.join(60)
    f.join(60)
    run = AgentRun.objects.get(id=lease.run_id)
    journal = list(JournalEntry.objects.filter(run_id=lease.run_id).values_list("seq", "status", "uncertain"))
    return result[0], run.state, journal


def test_single_fail_run_never_ends_a_run_with_a_pending_call_to_undo():
    outcome, state, journal = _race(lambda lease: fail_run(lease, "boom"))
    assert state == "running", (outcome, state, journal)  # unwinding: the call is undone first


def test_batch_fail_runs_ends_it_as_the_single_form_does():
    outcome, state, journal = _race(
        lambda lease: b.fail_runs(lease.community_id, [b.prepare_failure(lease, "boom")])[0]
    )
    assert state == "running", (outcome, state, journal)
