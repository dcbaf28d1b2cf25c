"""intake_event (the one-statement function) under a concurrent race on one key: the
loser waits for the winner's transaction and then judges duplicate vs conflict by the key that
won (committed), or wins itself when the winner rolled back."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import Created, Duplicate, IdempotencyConflict, intake_event
from tests.agents_support import AGENT
from tests.citus_support import waits_for_a_row_lock

pytestmark = pytest.mark.django_db(transaction=True)


def _waits_for_a_lock(pid: int) -> bool:
    return waits_for_a_row_lock(pid, "%intake%")


def _race(community_id, first_payload, second_payload, *, commit: bool):
    inserted, go_on = threading.Event(), threading.Event()
    first: list[object] = []
    pid: list[int] = []
    second: list[object] = []

    def winner():
        try:
            with transaction.atomic():
                first.append(intake_event(community_id, "t", "ev", first_payload, AGENT))
                inserted.set()
                go_on.wait(60)
                if not commit:
                    transaction.set_rollback(True)
        finally:
            connections.close_all()

    def loser():
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                pid.append(cursor.fetchone()[0])
            second.append(intake_event(community_id, "t", "ev", second_payload, AGENT))  # autocommit
        finally:
            connections.close_all()

    a = threading.Thread(target=winner)
    a.start()
    assert inserted.wait(60)
    b = threading.Thread(target=loser)
    b.start()
    while not pid:
        time.sleep(0.001)
    waited = False
    while not waited and b.is_alive():
        waited = _waits_for_a_lock(pid[0])
    assert waited
    go_on.set()
    a.join(60)
    b.join(60)
    return first[0], second[0]


@pytest.mark.parametrize(("payload", "expected"), [({"n": 1}, Duplicate), ({"n": 2}, IdempotencyConflict)])
def test_the_loser_judges_by_the_committed_winner(community, payload, expected):
    won, lost = _race(community.id, {"n": 1}, payload, commit=True)
    assert isinstance(won, Created)
    assert lost == expected(won.run_id)
    assert AgentRun.objects.filter(community_id=community.id).count() == 1


def test_the_loser_wins_when_the_winner_rolls_back(community):
    won, lost = _race(community.id, {"n": 1}, {"n": 2}, commit=False)
    assert isinstance(won, Created) and isinstance(lost, Created)
    assert list(AgentRun.objects.filter(community_id=community.id).values_list("id", flat=True)) == [lost.run_id]
