"""The orchestrator's poll of due waits never waits for a run row another transaction holds.

Every orchestrator's dispatcher calls ``end_due_waits`` once a poll interval. It locked the runs
of the due waits with a plain ``FOR NO KEY UPDATE``: one run row held by a transaction that does
not end (a stuck session, a long operator transaction) blocked the dispatcher of every
orchestrator polling that community, so none of them claimed anything more, for any run, until
it ended. The maintenance bounds the same wait (``lock_timeout``) for this reason. The poll
now takes the runs that are free (``SKIP LOCKED``) and leaves the others to its next poll.
Found in review: the test failed before the fix (the poll waited for the held run).
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction

from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.services import end_due_waits
from buzz_delivery.workflows.testing import function_step, run_until_idle
from tests.wf_support import start

pytestmark = pytest.mark.django_db(transaction=True)
HELD_SECONDS = 8


def _sleeping_run(community):
    flow = {
        "steps": [{"key": "nap", "kind": "sleep", "seconds": 600}, function_step("after", "echo", depends_on=["nap"])]
    }
    return start(WorkflowFactory(community=community), flow)


def _due(run) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_workflows_step SET wait_deadline = now() - interval '1 second'"
            " WHERE community_id = %s AND run_id = %s AND key = 'nap' AND state = 'waiting'",
            [run.community_id, run.pk],
        )


def _nap(run) -> str:
    return Step.objects.get(community_id=run.community_id, run_id=run.pk, key="nap").state


def test_a_held_run_row_does_not_block_the_poll_and_the_other_waits_still_end(community):
    held_run, free_run = _sleeping_run(community), _sleeping_run(community)
    run_until_idle(community.id)
    assert (_nap(held_run), _nap(free_run)) == ("waiting", "waiting")
    _due(held_run)
    _due(free_run)
    held, release = threading.Event(), threading.Event()

    def holder():  # a transaction holding the run row and not ending (for a while)
        try:
            with transaction.atomic():
                Run.objects.select_for_update(no_key=True).get(community_id=community.id, run_id=held_run.pk)
                held.set()
                release.wait(HELD_SECONDS)
        finally:
            connections.close_all()

    h = threading.Thread(target=holder)
    h.start()
    try:
        assert held.wait(60)
        began = time.monotonic()
        ended = end_due_waits(community.id)
        took = time.monotonic() - began
    finally:
        release.set()
        h.join(60)
    assert took < HELD_SECONDS / 2, f"the poll waited {took:.1f}s for the held run"
    assert (ended.woken, _nap(held_run), _nap(free_run)) == (1, "waiting", "succeeded")
    assert end_due_waits(community.id).woken == 1  # released: the next poll ends it
    assert _nap(held_run) == "succeeded"
