"""Concurrency limits by key for agent runs and workflow steps (issue 32, ``services/flow.py``,
docs/flow-control.md): at most N runs leased (N steps running) at once per key the operator
declares; every statement that moves a run or a step out of its leased state frees its slot (a
settle, a park for approval, a cancel, the reaper); bad definitions are refused naming the field
before any SQL; with no limit the claim is the plain statement and clears old slots."""

from __future__ import annotations

import re

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, connection, transaction
from django.test import override_settings

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import (
    ApprovalRequested,
    Cancelled,
    Finished,
    cancel_agent_run,
    claim_agent_runs,
    complete_run,
    reap_agent_runs,
    request_approval,
)
from buzz_delivery.checks import check_settings
from buzz_delivery.services import flow
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.models import Step
from buzz_delivery.workflows.services import (
    claim_steps,
    complete_and_claim_steps,
    complete_step,
)
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from buzz_delivery.workflows.testing import function_step
from tests.agents_support import backdate_run_lease, make_claimable, new_run
from tests.wf_support import backdate_step_lease, start

pytestmark = pytest.mark.django_db


def agent_limits(**caps: int):
    return override_settings(BUZZ_DELIVERY={"AGENT_CONCURRENCY_LIMITS": caps})


def step_limits(**caps: int):
    return override_settings(BUZZ_DELIVERY={"STEP_CONCURRENCY_LIMITS": caps})


def claim(community, agents, limit: int = 10) -> list:
    return claim_agent_runs(community.id, list(agents), worker_id="w", limit=limit, lease_seconds=30)


def leased(community, **filters) -> int:
    return AgentRun.objects.filter(community_id=community.id, state__in=("running", "waiting_tool"), **filters).count()


def running(community, **filters) -> int:
    return Step.objects.filter(community_id=community.id, state="running", **filters).count()


# -- agent runs ----------------------------------------------------------------------------------


def test_an_agent_limit_caps_the_leased_runs_of_each_agent_and_a_settle_frees_a_slot(community):
    a, b = random32(), random32()
    for agent, n in ((a, 4), (b, 3)):
        for _ in range(n):
            new_run(community.id, agent)
    with agent_limits(agent=2):
        first = claim(community, [a, b])
        assert sorted(bytes(c.run.agent_pubkey) == a for c in first) == [False, False, True, True]
        assert claim(community, [a, b]) == []
        held = next(c for c in first if bytes(c.run.agent_pubkey) == a)
        assert complete_run(held.lease, {"ok": True}) == Finished("completed")
        (again,) = claim(community, [a, b])
    assert bytes(again.run.agent_pubkey) == a
    assert again.run.slot_agent == held.run.slot_agent  # the slot the settle freed
    assert again.run.slot_community is None  # no community limit declared: no slot of that kind
    assert leased(community, agent_pubkey=a) == 2
    slots = AgentRun.objects.filter(community_id=community.id, agent_pubkey=a, state="running")
    assert sorted(slots.values_list("slot_agent", flat=True)) == [0, 1]


def test_an_agent_at_its_limit_does_not_use_up_a_claim_meant_for_the_others(community):
    busy, idle = random32(), random32()
    for _ in range(6):
        new_run(community.id, busy)  # older than every run of idle
    with agent_limits(agent=2):
        assert len(claim(community, [busy])) == 2
        for _ in range(2):
            new_run(community.id, idle)
        taken = claim(community, [busy, idle], limit=2)
    assert [bytes(c.run.agent_pubkey) for c in taken] == [idle, idle]


def test_a_community_limit_holds_across_its_agents(community):
    agents = [random32() for _ in range(3)]
    for agent in agents:
        for _ in range(2):
            new_run(community.id, agent)
    with agent_limits(community=3):
        assert len(claim(community, agents[:1])) == 2
        assert len(claim(community, agents[1:])) == 1
        assert claim(community, agents) == []
    assert leased(community) == 3


def test_a_run_parked_for_approval_or_cancelled_holds_no_slot(community):
    agent = random32()
    ids = [new_run(community.id, agent) for _ in range(3)]
    with agent_limits(agent=1):
        (first,) = claim(community, [agent])
        assert claim(community, [agent]) == []
        assert isinstance(request_approval(first.lease, prompt="go?"), ApprovalRequested)
        (second,) = claim(community, [agent])  # the parked run freed its slot
        assert second.run.id != first.run.id
        assert cancel_agent_run(community.id, second.run.id) == Cancelled(second.run.id)
        (third,) = claim(community, [agent])
    assert third.run.id not in (first.run.id, second.run.id)
    states = dict(AgentRun.objects.filter(id__in=ids).values_list("id", "state"))
    assert sorted(states.values()) == ["cancelled", "running", "waiting_approval"]
    assert leased(community, agent_pubkey=agent) == 1


def test_a_lapsed_run_lease_holds_its_slot_until_the_reaper_takes_it_back(community):
    agent = random32()
    for _ in range(2):
        new_run(community.id, agent, max_attempts=3)
    with agent_limits(agent=1):
        (held,) = claim(community, [agent])
        backdate_run_lease(held.run.id)
        assert claim(community, [agent]) == []  # lapsed, not yet reaped: its slot is held
        assert reap_agent_runs().reclaimed == 1
        (nxt,) = claim(community, [agent])
        make_claimable(held.run.id)
        assert claim(community, [agent]) == []  # the reclaimed run waits for the slot again
    assert nxt.run.id != held.run.id
    assert leased(community, agent_pubkey=agent) == 1


def test_without_a_limit_a_run_claim_clears_the_slots_a_limited_claim_left(community):
    agent = random32()
    new_run(community.id, agent, max_attempts=3)
    with agent_limits(agent=1, community=5):
        (held,) = claim(community, [agent])
    assert (held.run.slot_agent, held.run.slot_community) == (0, 0)
    backdate_run_lease(held.run.id)
    reap_agent_runs()
    make_claimable(held.run.id)
    (again,) = claim(community, [agent])
    assert (again.run.slot_agent, again.run.slot_community) == (None, None)


def test_the_database_refuses_two_leased_runs_of_one_agent_on_one_slot(community):
    agent = random32()
    ids = [new_run(community.id, agent) for _ in range(2)]
    with agent_limits(agent=2):
        claim(community, [agent])
    with (
        pytest.raises(IntegrityError, match="ag_run_slot_agent_key"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute(
            "UPDATE buzz_agents_run SET slot_agent = 0 WHERE community_id = %s AND id = ANY(%s)", [community.id, ids]
        )


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"tenant": 2}, "['AGENT_CONCURRENCY_LIMITS']['tenant']"),
        ({"agent": 0}, "['AGENT_CONCURRENCY_LIMITS']['agent']"),
        ({"agent": True}, "['AGENT_CONCURRENCY_LIMITS']['agent']"),
        ({"workflow": 2}, "['AGENT_CONCURRENCY_LIMITS']['workflow']"),
        ([("agent", 2)], "['AGENT_CONCURRENCY_LIMITS']"),
    ],
)
def test_a_bad_agent_limit_is_refused_naming_its_field_and_a_claim_writes_nothing(community, value, field):
    agent = random32()
    run_id = new_run(community.id, agent)
    pattern = field.replace("[", r"\[").replace("]", r"\]")
    with override_settings(BUZZ_DELIVERY={"AGENT_CONCURRENCY_LIMITS": value}):
        assert [(e.id, bool(re.search(pattern, e.msg))) for e in check_settings()] == [("buzz_delivery.E034", True)]
        with pytest.raises(ImproperlyConfigured, match=pattern):
            claim(community, [agent])
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.lease_generation, run.worker_id, run.history) == ("pending", 0, None, [])


# -- workflow steps ------------------------------------------------------------------------------


def parallel(n: int, prefix: str = "s") -> dict:
    return {"steps": [function_step(f"{prefix}{i}") for i in range(n)]}


def test_a_workflow_limit_caps_the_running_steps_of_each_workflow_and_a_settle_frees_a_slot(community):
    one, two = WorkflowFactory(community=community), WorkflowFactory(community=community)
    start(one, parallel(4))
    start(two, parallel(3))
    with step_limits(workflow=2):
        first = claim_steps(community.id, limit=10, lease_seconds=30)
        by_workflow = sorted(c.step.slot_workflow_id == one.id for c in first)
        assert by_workflow == [False, False, True, True]
        assert claim_steps(community.id, limit=10, lease_seconds=30) == []
        held = next(c for c in first if c.step.slot_workflow_id == one.id)
        assert complete_step(held.lease, {"ok": 1}).status == "succeeded"
        (again,) = claim_steps(community.id, limit=10, lease_seconds=30)
    assert again.step.slot_workflow_id == one.id
    assert again.step.slot_workflow == held.step.slot_workflow
    assert (again.step.slot_step, again.step.slot_community) == (None, None)  # kinds not declared
    assert running(community, slot_workflow_id=one.id) == 2


def test_a_step_limit_holds_per_step_key_of_a_workflow(community):
    workflow = WorkflowFactory(community=community)
    for _ in range(3):
        start(workflow, {"steps": [function_step("fetch"), function_step("store")]})
    with step_limits(step=1):
        taken = claim_steps(community.id, limit=10, lease_seconds=30)
        assert claim_steps(community.id, limit=10, lease_seconds=30) == []
    assert sorted(c.step.key for c in taken) == ["fetch", "store"]
    assert {c.step.slot_step for c in taken} == {0}


def test_a_community_step_limit_and_the_batch_completion_claim_honour_it(community):
    workflow = WorkflowFactory(community=community)
    start(workflow, parallel(5))
    with step_limits(community=2):
        first = claim_steps(community.id, limit=10, lease_seconds=30)
        assert len(first) == 2
        batch = complete_and_claim_steps(community.id, [(first[0].lease, 1)], claim_limit=10, lease_seconds=30)
        assert len(batch.claims) == 1  # the completion freed one slot, which its claim took
    assert running(community) == 2


def test_a_lapsed_step_lease_holds_its_slot_until_the_reaper_takes_it_back(community):
    workflow = WorkflowFactory(community=community)
    start(workflow, parallel(2))
    with step_limits(workflow=1):
        (held,) = claim_steps(community.id, limit=10, lease_seconds=30)
        backdate_step_lease(held.step.id)
        assert claim_steps(community.id, limit=10, lease_seconds=30) == []  # lapsed, not yet reaped
        reap_workflow_steps()
        assert Step.objects.get(id=held.step.id).state != "running"
        (nxt,) = claim_steps(community.id, limit=10, lease_seconds=30)
    assert nxt.step.id != held.step.id
    assert running(community) == 1


def test_without_a_limit_a_step_claim_clears_the_slots_a_limited_claim_left(community):
    workflow = WorkflowFactory(community=community)
    start(workflow, {"steps": [function_step("a", retry={"max_attempts": 3, "base_seconds": 1})]})
    with step_limits(workflow=1, step=1, community=1):
        (held,) = claim_steps(community.id, lease_seconds=30)
    assert (held.step.slot_workflow, held.step.slot_step, held.step.slot_community) == (0, 0, 0)
    backdate_step_lease(held.step.id)
    reap_workflow_steps()
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_workflows_step SET next_attempt_at = NULL WHERE community_id = %s AND id = %s",
            [community.id, held.step.id],
        )
    (again,) = claim_steps(community.id, lease_seconds=30)
    assert again.step.id == held.step.id
    assert (again.step.slot_workflow, again.step.slot_step, again.step.slot_community) == (None, None, None)


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"agent": 2}, "['STEP_CONCURRENCY_LIMITS']['agent']"),
        ({"workflow": 1001}, "['STEP_CONCURRENCY_LIMITS']['workflow']"),
        ({"step": "2"}, "['STEP_CONCURRENCY_LIMITS']['step']"),
        ("workflow=2", "['STEP_CONCURRENCY_LIMITS']"),
    ],
)
def test_a_bad_step_limit_is_refused_naming_its_field_and_a_claim_writes_nothing(community, value, field):
    workflow = WorkflowFactory(community=community)
    run = start(workflow, parallel(1))
    pattern = field.replace("[", r"\[").replace("]", r"\]")
    with override_settings(BUZZ_DELIVERY={"STEP_CONCURRENCY_LIMITS": value}):
        assert [e.id for e in check_settings()] == ["buzz_delivery.E035"]
        with pytest.raises(ImproperlyConfigured, match=pattern):
            claim_steps(community.id, limit=5, lease_seconds=30)
        with pytest.raises(ImproperlyConfigured, match=pattern):
            complete_and_claim_steps(community.id, [], claim_limit=5)
    step = Step.objects.get(run_id=run.pk)
    assert (step.state, step.lease_generation, step.claimed_by) == ("ready", 0, None)
    assert [entry["event"] for entry in step.history] == []


def test_the_claims_under_limits_keep_citus_router_form():
    """Every statement names its community (the rules of tests/test_scale_out_rules.py)."""
    from buzz_delivery.agents.services import sql as agents_sql
    from buzz_delivery.workflows.services import sql as steps_sql
    from tests.test_scale_out_rules import rule1_violations, rule2_violations, rule3_violations

    for statement in (agents_sql.CLAIM_PENDING_RUNS_UNDER_LIMITS, steps_sql.CLAIM_READY_STEPS_UNDER_LIMITS):
        assert "%(community_id)s" in statement
        assert not rule1_violations(statement) + rule2_violations(statement) + rule3_violations(statement)
    assert flow.AGENT_KINDS == ("agent", "community")


def test_metrics_show_each_declared_run_and_step_limit_its_slots_held_and_the_keys_at_it(community):
    from tests.test_metrics import scrape

    full, half = random32(), random32()
    for agent in (full, full, full, half):
        new_run(community.id, agent)
    workflow = WorkflowFactory(community=community)
    start(workflow, parallel(3))
    settings = {"AGENT_CONCURRENCY_LIMITS": {"agent": 2}, "STEP_CONCURRENCY_LIMITS": {"workflow": 5, "step": 1}}
    with override_settings(BUZZ_DELIVERY=settings):
        assert len(claim(community, [full, half])) == 3
        assert len(claim_steps(community.id, limit=10, lease_seconds=30)) == 3
        found = scrape()
    agent = (("kind", "agent"),)
    assert found["buzz_agent_concurrency_limit"] == {agent: 2}
    assert found["buzz_agent_concurrency_slots_held"] == {agent: 3}
    assert found["buzz_agent_concurrency_slots_held_max"] == {agent: 2}
    assert found["buzz_agent_concurrency_keys_at_limit"] == {agent: 1}
    step, whole = (("kind", "step"),), (("kind", "workflow"),)
    assert found["buzz_step_concurrency_limit"] == {step: 1, whole: 5}
    assert found["buzz_step_concurrency_slots_held"] == {step: 3, whole: 3}
    assert found["buzz_step_concurrency_slots_held_max"] == {step: 1, whole: 3}
    assert found["buzz_step_concurrency_keys_at_limit"] == {step: 3, whole: 0}
    assert "buzz_agent_concurrency_limit" not in scrape()  # none declared: no samples
