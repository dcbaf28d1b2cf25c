"""``communities_with_due_waits`` (the ``--all`` orchestrator's poll) names active communities only.

It listed every community with a due wait, at most ``limit`` of them, in id order, whatever the
community's state: the waits of a quiescing or deleting community cannot end (every UPDATE that
ends one requires an active community), so they stayed due, and as many such communities as the
limit hid every active community behind them from the poll of every ``--all`` orchestrator (their
sleeps then ended only at the maintenance's next pass). The maintenance's own walk reads active
communities only. Found in review: the test failed before the fix (it named the quiescing one).
"""

from __future__ import annotations

import pytest
from django.db import connection

from buzz_delivery.testing import CommunityFactory, WorkflowFactory
from buzz_delivery.workflows.services import communities_with_due_waits
from buzz_delivery.workflows.testing import run_until_idle
from tests.wf_support import start

pytestmark = pytest.mark.django_db


def _due_sleep(community) -> None:
    start(WorkflowFactory(community=community), {"steps": [{"key": "nap", "kind": "sleep", "seconds": 600}]})
    run_until_idle(community.id)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_workflows_step SET wait_deadline = now() - interval '1 second'"
            " WHERE community_id = %s AND state = 'waiting'",
            [community.id],
        )


def test_a_quiescing_community_does_not_take_an_active_ones_place():
    quiescing, active = CommunityFactory(), CommunityFactory()  # ids in creation order (UUIDv7)
    assert quiescing.id < active.id
    _due_sleep(quiescing)
    _due_sleep(active)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE buzz_delivery_community SET deletion_state = 'quiescing' WHERE id = %s", [quiescing.id])
    assert communities_with_due_waits(limit=1) == [active.id]
    assert communities_with_due_waits() == [active.id]
