"""In-process acceptance (``accept_claim``) tries an accept that failed for a transient cause
again on a fresh connection before it settles the delivery ``retry``: before, a terminated
backend, a lock or statement timeout or a Citus COMMIT loss settled it ``retry`` at once, which
spent one of its attempts (on its last: ``failed``/``attempts_exhausted``, no run), while the
remote acceptor sends such an accept again. Real fault: the accepting thread's backend is
terminated while its transaction waits for a row lock another connection holds."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.db import connection

from buzz_delivery import services as core
from buzz_delivery.agents.acceptance import ACCEPT_TRIES, accept_claim
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory, random32
from project.database_url import database_url
from tests.operator_support import pending

pytestmark = pytest.mark.django_db(transaction=True)


def _accept_in_a_thread(claim) -> tuple[threading.Thread, dict]:
    seen: dict = {}

    def accept() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                seen["pid"] = cursor.fetchone()[0]
            seen["outcome"] = accept_claim(claim)
        except BaseException as exc:  # the test reads it
            seen["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=accept)
    thread.start()
    return thread, seen


def _terminate_when_it_waits_for_a_lock(seen: dict, admin: psycopg.Connection, times: int) -> None:
    deadline = time.monotonic() + 30
    for _ in range(times):
        while "pid" not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
        pid = seen["pid"]
        while time.monotonic() < deadline:
            row = admin.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
            if row and row[0] == "Lock":
                break
            time.sleep(0.01)
        else:
            pytest.fail("the accept never waited for the lock")
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        seen.pop("pid")  # the next try's backend is a new one: learn it from pg_stat_activity
        while time.monotonic() < deadline:
            rows = admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
                " AND pid <> %s AND backend_type = 'client backend'",
                [pid],
            ).fetchall()
            if rows:
                seen["pid"] = rows[0][0]
                break
            time.sleep(0.01)


@pytest.mark.parametrize("faults", [1, ACCEPT_TRIES - 1])
def test_an_accept_whose_backend_was_terminated_is_tried_again_and_makes_one_run(faults):
    community = CommunityFactory()
    agent = random32()
    delivery = pending(community, target_pubkey=agent)
    claim = core.claim_delivery(community.id, agent, delivery_id=delivery.pk, lease_seconds=60)
    url = database_url(connection.settings_dict)
    with psycopg.connect(url) as blocker, psycopg.connect(url, autocommit=True) as admin:
        blocker.execute("SELECT 1 FROM buzz_delivery_delivery_record WHERE id = %s FOR UPDATE", [delivery.pk])
        thread, seen = _accept_in_a_thread(claim)
        _terminate_when_it_waits_for_a_lock(seen, admin, faults)
        blocker.rollback()  # the lock goes: the try after the last fault goes through
        thread.join(timeout=60)

    assert "error" not in seen, seen.get("error")
    assert seen["outcome"] == "accepted"
    after = WorkflowAgentDelivery.objects.get(pk=delivery.pk)
    assert (after.status, after.attempt) == ("finished", 1)  # no attempt spent on the faults
    assert AgentRun.objects.filter(community_id=community.id, delivery_id=delivery.pk).count() == 1


def test_an_accept_failing_on_every_try_is_settled_retry_as_before():
    community = CommunityFactory()
    agent = random32()
    delivery = pending(community, target_pubkey=agent)
    claim = core.claim_delivery(community.id, agent, delivery_id=delivery.pk, lease_seconds=60)
    url = database_url(connection.settings_dict)
    with psycopg.connect(url) as blocker, psycopg.connect(url, autocommit=True) as admin:
        blocker.execute("SELECT 1 FROM buzz_delivery_delivery_record WHERE id = %s FOR UPDATE", [delivery.pk])
        thread, seen = _accept_in_a_thread(claim)
        _terminate_when_it_waits_for_a_lock(seen, admin, ACCEPT_TRIES)
        blocker.rollback()
        thread.join(timeout=60)

    assert seen["outcome"] == "errors"
    after = WorkflowAgentDelivery.objects.get(pk=delivery.pk)
    assert after.status == "pending" and after.next_attempt_at is not None  # settled retry: its backoff
    assert not AgentRun.objects.filter(community_id=community.id, delivery_id=delivery.pk).exists()
