"""Run and step priority (issue 32): set at ``start_run``, taken by the run's steps (claims take
higher first, then the longest ready), by the deliveries its send_message steps commit, and by
its child runs and restarts; refused out of range naming ``priority``, nothing written."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from buzz_delivery import models
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.services import claim_steps
from buzz_delivery.workflows.testing import function_step, run_until_idle, send_step
from tests.wf_support import counts, start

pytestmark = pytest.mark.django_db


@pytest.fixture
def workflow(community):
    return WorkflowFactory(community=community)


def test_steps_of_a_higher_priority_run_are_claimed_first_then_the_longest_ready(workflow):
    definition = {"steps": [function_step("a"), function_step("b")]}
    low = start(workflow, definition)
    urgent = start(workflow, definition, priority=6)
    ordinary = start(workflow, definition, priority=0)

    claims = claim_steps(workflow.community_id, limit=6)

    assert [c.step.run_id for c in claims] == [urgent.pk] * 2 + [low.pk] * 2 + [ordinary.pk] * 2
    assert {s.priority for s in Step.objects.filter(run_id=urgent.pk)} == {6}


def test_the_deliveries_of_a_send_message_step_take_the_run_priority(workflow):
    targets = [random32(), random32()]
    run = start(workflow, {"steps": [send_step("send", targets)]}, priority=-4)
    run_until_idle(workflow.community_id)
    rows = models.WorkflowAgentDelivery.objects.filter(community_id=workflow.community_id, run_id=run.pk)
    assert sorted(rows.values_list("priority", flat=True)) == [-4, -4]


@pytest.mark.parametrize("bad", [11, -11, True, "3", None])
def test_a_bad_run_priority_is_refused_naming_it_and_nothing_is_written(workflow, bad):
    definition = {"steps": [function_step("a")]}
    start(workflow, definition)  # the definition published
    before = counts()
    with pytest.raises(ValidationError) as info:
        start(workflow, definition, priority=bad)
    assert "priority" in info.value.message_dict
    assert counts() == before


def test_a_restart_carries_the_run_priority(workflow):
    from buzz_delivery.workflows.services import cancel_run, restart_run

    run = start(workflow, {"steps": [function_step("a")]}, priority=3)
    cancel_run(workflow.community_id, run.pk)
    again = restart_run(workflow.community_id, run.pk)
    assert Run.objects.get(pk=again.pk).priority == 3


def test_an_agent_run_takes_its_delivery_priority_and_claims_take_higher_first(run):
    from buzz_delivery import services as core
    from buzz_delivery.agents.services import Accepted, accept_delivery, claim_agent_runs
    from buzz_delivery.testing import BindingFactory, DeliveryFactory
    from tests.agents_support import AGENT

    accepted = []
    for priority in (0, 7, -2):
        delivery = DeliveryFactory(binding=BindingFactory(run=run, target_pubkey=AGENT), priority=priority)
        claim = core.claim_delivery(run.community_id, AGENT, delivery_id=delivery.id, lease_seconds=30)
        outcome = accept_delivery(claim.lease)
        assert isinstance(outcome, Accepted)
        accepted.append(outcome.run_id)

    claims = claim_agent_runs(run.community_id, [AGENT], worker_id="w", limit=3, lease_seconds=30)

    assert [c.lease.run_id for c in claims] == [accepted[1], accepted[0], accepted[2]]
    assert [c.run.priority for c in claims] == [7, 0, -2]
