"""A send that outlasts the retention still reaches a ``wait_event`` step that started meanwhile.

``send_event`` kept its event until its first statement + ``EVENT_RETENTION_SECONDS``, and a
starting wait judged it live when it took it (after waiting for the send's row lock, then for its
run). A send slowed past the retention (here: a run of another waiting step held by a third
transaction) blocked a wait that started meanwhile; when it committed, the wait found the event
already expired and parked, and the send had not seen the step waiting: taken by neither, where
the docs promise "never neither" (with ``EVENT_RETENTION_SECONDS`` = 0, allowed then, any send
did this). The send now keeps its event for the retention from its last statement, the wait
judges it against its own first statement, and the settings check refuses a retention under
``MIN_EVENT_RETENTION_SECONDS``. Found in review: the test failed before the fix (the second
step stayed ``waiting``).
"""

from __future__ import annotations

import threading
import time

import pytest
from django.core import checks as django_checks
from django.db import connections, transaction
from django.test import override_settings

from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.services import send_event
from buzz_delivery.workflows.testing import run_until_idle
from tests.wf_support import start

pytestmark = pytest.mark.django_db(transaction=True)
RETENTION = 1
WAIT_EVENT = {"steps": [{"key": "paid", "kind": "wait_event", "event": "payment", "event_key": "order:1"}]}


def _paid(run) -> str:
    return Step.objects.get(community_id=run.community_id, run_id=run.pk, key="paid").state


@override_settings(BUZZ_WORKFLOWS={"EVENT_RETENTION_SECONDS": RETENTION})
def test_a_wait_starting_while_a_slow_send_holds_the_event_takes_it(community):
    workflow = WorkflowFactory(community=community)
    first = start(workflow, WAIT_EVENT)
    run_until_idle(community.id)
    assert _paid(first) == "waiting"
    held, release, errors, sent = threading.Event(), threading.Event(), [], []

    def holder():  # holds the first run's row: the send waits for it
        try:
            with transaction.atomic():
                Run.objects.select_for_update(no_key=True).get(community_id=community.id, run_id=first.pk)
                held.set()
                release.wait(60)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    def sender():
        try:
            sent.append(send_event(community.id, "payment", "order:1", {"amount": 5}))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    def waiter():  # a second run's step starts waiting while the send holds the event's row
        try:
            run_until_idle(community.id)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    h = threading.Thread(target=holder)
    h.start()
    assert held.wait(60)
    s = threading.Thread(target=sender)
    s.start()
    time.sleep(RETENTION + 1)  # the send's first statement is past its retention now
    second = start(workflow, WAIT_EVENT)
    w = threading.Thread(target=waiter)
    w.start()
    time.sleep(1)  # the wait meets the send's row lock
    release.set()
    for t in (h, s, w):
        t.join(60)
    assert not errors, errors
    assert sent[0].resumed == 1
    run_until_idle(community.id)
    assert (_paid(first), _paid(second)) == ("succeeded", "succeeded")


def test_the_settings_check_refuses_a_retention_too_short_and_names_it():
    with override_settings(BUZZ_WORKFLOWS={"EVENT_RETENTION_SECONDS": 0}):
        (error,) = [m for m in django_checks.run_checks() if m.id.startswith("buzz_workflows.")]
    assert error.id == "buzz_workflows.E003"
    assert "BUZZ_WORKFLOWS['EVENT_RETENTION_SECONDS'] must be at least 60" in error.msg
    assert "taken by neither" in error.msg
