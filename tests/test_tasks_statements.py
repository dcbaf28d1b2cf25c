"""The statements the task runner sends for one task, run in this process on a delivery it
claimed: the task's row and what an earlier holder recorded are read in one statement fenced
by the lease, and the outcome is recorded in one more (before the worker's settle)."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from buzz_delivery import services
from buzz_delivery.tasks import compat
from buzz_delivery.tasks.models import TaskResult
from buzz_delivery.tasks.runner import TaskRunner
from buzz_delivery.testing import CommunityFactory
from tests import tasks_support as t


@pytest.mark.django_db(transaction=True)
def test_a_task_is_read_with_its_recorded_outcome_in_one_statement_and_recorded_in_one_more():
    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    backend = compat.task_backends["default"]
    result = t.add.enqueue(1, 2)
    claim = services.claim_delivery(t.COMMUNITY, backend.target_for("default"))
    assert claim is not None
    with CaptureQueriesContext(connection) as captured:
        TaskRunner(backend)(claim.delivery)
    # Each as sent: the tenant scope's set_config rides in front of it ("...; " + statement).
    sent = [q["sql"].rsplit("; ", 1)[-1].strip() for q in captured.captured_queries]
    # Before: the task's row, then the recorded outcome (a second statement fenced by the
    # lease), then the record: three. Now the first two are one.
    assert len(sent) == 2, sent
    assert sent[0].startswith("SELECT") and "buzz_delivery_now()" in sent[0]
    assert sent[1].startswith("UPDATE buzz_tasks_result")
    assert TaskResult.objects.get(id=result.id).return_value == 3  # recorded (the worker settles)
