"""A ``sleep`` whose ``until`` the run's data makes an instant UTC cannot hold fails once.

``aware_time`` accepted ``9999-12-31T23:59:59-14:00`` (a valid ISO 8601 time with its offset),
and ``sleep_step`` then refused it (``ValidationError``: in UTC it is the year 10000) from
inside the step's execution: the orchestrator logged a step error and left the step running
under its lease, which lapsed, was reclaimed and failed the same way until its attempts were
spent, one lease at a time (``attempts_exhausted``, never ``sleep_invalid``). Found in review:
the test failed before the fix (``execute`` raised ``ValidationError``).
"""

from __future__ import annotations

import pytest

from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows.models import Step
from buzz_delivery.workflows.testing import function_step, run_until_idle
from tests.wf_support import run_state, start

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("until", ["9999-12-31T23:59:59-14:00", "0001-01-01T00:00:00+14:00"])
def test_a_sleep_until_a_time_outside_utcs_years_fails_once_as_sleep_invalid(community, until):
    flow = {
        "steps": [
            {"key": "nap", "kind": "sleep", "until": {"$ref": "input.at"}},
            function_step("after", "echo", depends_on=["nap"]),
        ]
    }
    run = start(WorkflowFactory(community=community), flow, {"at": until})
    run_until_idle(community.id)
    nap = Step.objects.get(community_id=community.id, run_id=run.pk, key="nap")
    assert (nap.state, nap.failure_code, nap.attempts) == ("failed", "sleep_invalid", 1)
    assert "until" in nap.failure_message
    assert run_state(run) == "failed"
