"""The delivery fan-in ends a send_message step in the UPDATE that counts its last delivery
(workflows migration 0025, issue 31): one statement and one version of the step row, not two.
The outcomes themselves (succeeded, failed past the tolerance, counted both ways, frozen while
agent runs are awaited) are tests/test_wf_send_and_cancel.py's and the agents' tests'."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from buzz_delivery import services
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.services import Settled
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.services import get_run
from buzz_delivery.workflows.testing import run_until_idle, send_step
from tests.wf_support import run_state, start

pytestmark = pytest.mark.django_db(transaction=True)


def _step_versions_written() -> int:
    """Step rows this transaction updated (every version: the counting UPDATE, and any other)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_get_xact_tuples_updated('buzz_workflows_step'::regclass)")
        return int(cursor.fetchone()[0])


def _settle_in_one_transaction(delivery: WorkflowAgentDelivery, outcome: str) -> int:
    claim = services.claim_delivery(
        delivery.community_id, bytes(delivery.target_pubkey), delivery_id=delivery.id, lease_seconds=30
    )
    assert claim is not None
    with transaction.atomic():
        before = _step_versions_written()
        assert services.finish_delivery(claim.lease, outcome) == Settled(outcome)
        return _step_versions_written() - before


@pytest.mark.parametrize(
    ("outcomes", "ended"),
    [
        (["finished", "finished"], ("succeeded", None, {"delivered": 2, "failed": 0})),
        (["finished", "failed"], ("failed", "deliveries_failed", {"delivered": 1, "failed": 1})),
    ],
)
def test_the_last_delivery_ends_its_step_in_one_step_update(community, outcomes, ended):
    """The send is the run's only step, so every step version the last settle writes is the
    fan-in's: one (it was two: the count, then the end); Advance then ends the run."""
    workflow = WorkflowFactory(community=community)
    targets = sorted(random32() for _ in range(2))
    run = start(workflow, {"steps": [send_step("send", targets)]})
    run_until_idle(workflow.community_id)
    first, last = WorkflowAgentDelivery.objects.filter(run_id=run.pk).order_by("target_pubkey")
    assert _settle_in_one_transaction(first, outcomes[0]) == 1  # the count alone
    step = get_run(workflow.community_id, run.pk).step("send")
    assert (step.state, step.delivered_terminal) == ("waiting", 1)
    assert _settle_in_one_transaction(last, outcomes[1]) == 1  # the count and the end
    step = get_run(workflow.community_id, run.pk).step("send")
    assert (step.state, step.failure_code, step.output) == ended
    assert step.finished_at is not None and step.wait_deadline is None
    if ended[0] == "failed":
        assert step.failure_message == "1 of 2 deliveries failed (0 tolerated)"
    assert run_state(run) == ended[0]
