"""``map`` steps (issue 33, SPEC 16): a function, a sub-workflow or a send_message once per item
of a runtime list, the items counted into the map step by the Advance trigger as every fan-in is,
its output the items' outputs in order; over an empty list, one item and many; a bound on the
list's size; failures tolerated or not; cancel while mapping."""

from __future__ import annotations

import pytest
from django.test import override_settings

from buzz_delivery import services as core
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.services import cancel_run, claim_steps, complete_step, fail_step, get_run
from buzz_delivery.workflows.testing import function_step, run_until_idle
from tests.wf_support import run_state, start, states

pytestmark = pytest.mark.django_db


def mapping(do: dict, over: str = "input.items", **fields: object) -> dict:
    return {
        "steps": [
            {"key": "each", "kind": "map", "over": {"$ref": over}, "do": do, **fields},
            function_step("after", "echo", depends_on=["each"], input={"all": {"$ref": "steps.each.output"}}),
        ]
    }


ECHO_ITEM = {"kind": "function", "function": "echo", "input": {"x": {"$ref": "item"}, "n": {"$ref": "input.n"}}}


@pytest.mark.parametrize("items", [[], ["a"], list(range(7))], ids=["empty", "one", "many"])
def test_a_map_runs_its_function_once_per_item_and_collects_the_outputs_in_order(community, items):
    run = start(WorkflowFactory(community=community), mapping(ECHO_ITEM), {"items": items, "n": 1})
    run_until_idle(community.id)
    view = get_run(community.id, run.pk)
    assert view.state == "succeeded"
    expected = [{"x": item, "n": 1} for item in items]
    assert view.step("each").output == expected
    assert view.step("after").output == {"all": expected}
    elements = [s for s in view.steps if s.map_key == "each"]
    assert [(s.key, s.item_index, s.state, s.attempts) for s in elements] == [
        (f"each[{i}]", i, "succeeded", 1) for i in range(len(items))
    ]
    run_row = Run.objects.get(pk=run.pk)
    assert (run_row.steps_total, run_row.steps_left) == (2 + len(items), 0)


def test_the_map_step_waits_pending_on_its_items_and_holds_no_lease(community):
    run = start(WorkflowFactory(community=community), mapping(ECHO_ITEM), {"items": [1, 2, 3]})
    claims = claim_steps(community.id, limit=10)
    assert [c.step.key for c in claims] == ["each"]
    from buzz_delivery.workflows import executor

    assert executor.execute(claims[0]).status == "pending"
    each = Step.objects.get(run_id=run.pk, key="each")
    assert (each.state, each.deps_total, each.deps_done, each.expected, each.lease_until) == ("pending", 3, 0, 3, None)
    items = claim_steps(community.id, limit=10)
    assert sorted(c.step.key for c in items) == ["each[0]", "each[1]", "each[2]"]
    for c in items[:2]:
        complete_step(c.lease, {"done": c.step.key})
    each.refresh_from_db()
    assert (each.state, each.deps_done) == ("pending", 2)
    complete_step(items[2].lease, {"done": items[2].step.key})
    each.refresh_from_db()
    assert (each.state, each.deps_done) == ("ready", 3)  # released once every item is in


def test_a_failed_item_fails_the_map_unless_tolerated(community):
    workflow = WorkflowFactory(community=community)
    strict = start(
        workflow, mapping({"kind": "function", "function": "noop", "retry": {"max_attempts": 1}}), {"items": [1, 2]}
    )
    claims = claim_steps(community.id, limit=10)
    from buzz_delivery.workflows import executor

    executor.execute(claims[0])
    items = claim_steps(community.id, limit=10)
    fail_step(items[0].lease, "boom")
    complete_step(items[1].lease, {"ok": 1})
    assert run_state(strict) == "running"  # an item's failure is the map's to judge
    run_until_idle(community.id)
    each = Step.objects.get(run_id=strict.pk, key="each")
    assert (each.state, each.failure_code) == ("failed", "map_items_failed")
    assert run_state(strict) == "failed"

    lenient = start(
        workflow,
        mapping({"kind": "function", "function": "test.boom", "retry": {"max_attempts": 1}}, tolerate_failures=2),
        {"items": [1, 2]},
    )
    run_until_idle(community.id)
    assert Step.objects.get(run_id=lenient.pk, key="each").output == [None, None]
    assert run_state(lenient) == "succeeded"


def test_a_list_beyond_the_bound_or_not_a_list_fails_the_map_writing_no_items(community):
    workflow = WorkflowFactory(community=community)
    with override_settings(BUZZ_WORKFLOWS={"MAX_MAP_ITEMS": 3}):
        big = start(workflow, mapping(ECHO_ITEM), {"items": [1, 2, 3, 4]})
        ok = start(workflow, mapping(ECHO_ITEM), {"items": [1, 2, 3]})
        run_until_idle(community.id)
    assert Step.objects.get(run_id=big.pk, key="each").failure_code == "map_too_large"
    assert not Step.objects.filter(run_id=big.pk, map_key__isnull=False).exists()
    assert run_state(ok) == "succeeded"
    odd = start(workflow, mapping(ECHO_ITEM), {"items": {"a": 1}})
    run_until_idle(community.id)
    assert Step.objects.get(run_id=odd.pk, key="each").failure_code == "map_not_a_list"


def test_a_map_of_a_sub_workflow_starts_one_child_run_per_item(community):
    child = WorkflowFactory(community=community)
    start(child, {"steps": [function_step("inner", "echo", input={"v": {"$ref": "input.v"}})]})
    run = start(
        WorkflowFactory(community=community),
        mapping({"kind": "sub_workflow", "workflow": str(child.id), "input": {"v": {"$ref": "item.v"}}}),
        {"items": [{"v": 1}, {"v": 2}]},
    )
    run_until_idle(community.id)
    assert get_run(community.id, run.pk).step("each").output == [{"inner": {"v": 1}}, {"inner": {"v": 2}}]
    children = Run.objects.filter(parent_run_id=run.pk).order_by("parent_step_key")
    assert [c.parent_step_key for c in children] == ["each[0]", "each[1]"]


def test_a_map_of_send_message_sends_one_message_per_item_and_counts_its_deliveries(community):
    agents = [random32() for _ in range(2)]
    run = start(
        WorkflowFactory(community=community),
        mapping({"kind": "send_message", "targets": [{"$ref": "item.agent"}], "content": {"$ref": "item.text"}}),
        {"items": [{"agent": a.hex(), "text": f"hi {i}"} for i, a in enumerate(agents)]},
    )
    run_until_idle(community.id)
    rows = WorkflowAgentDelivery.objects.filter(run_id=run.pk).order_by("step_id")
    assert [(d.step_id, bytes(d.target_pubkey)) for d in rows] == [("each[0]", agents[0]), ("each[1]", agents[1])]
    for agent in agents:
        claim = core.claim_delivery(community.id, agent, lease_seconds=30)
        core.finish_delivery(claim.lease, "finished")
    run_until_idle(community.id)
    assert get_run(community.id, run.pk).step("each").output == [{"delivered": 1, "failed": 0}] * 2


def test_an_item_whose_target_resolves_to_nonsense_fails_the_map_before_anything_is_written(community):
    run = start(
        WorkflowFactory(community=community),
        mapping({"kind": "send_message", "targets": {"$ref": "item"}, "content": "x"}),
        {"items": ["ab" * 32, "not hex"]},
    )
    run_until_idle(community.id)
    each = Step.objects.get(run_id=run.pk, key="each")
    assert (each.state, each.failure_code) == ("failed", "map_item_invalid")
    assert "item 1" in each.failure_message
    assert not Step.objects.filter(run_id=run.pk, map_key__isnull=False).exists()
    assert not WorkflowAgentDelivery.objects.filter(run_id=run.pk).exists()


def test_an_item_that_looks_like_a_reference_stays_data(community):
    run = start(
        WorkflowFactory(community=community), mapping(ECHO_ITEM), {"items": [{"$ref": "input.secret"}], "secret": 1}
    )
    run_until_idle(community.id)
    assert get_run(community.id, run.pk).step("each").output == [{"x": {"$ref": "input.secret"}, "n": None}]


def test_cancel_while_mapping_cancels_every_item_once(community):
    run = start(WorkflowFactory(community=community), mapping(ECHO_ITEM), {"items": [1, 2, 3]})
    claims = claim_steps(community.id, limit=10)
    from buzz_delivery.workflows import executor

    executor.execute(claims[0])
    held = claim_steps(community.id, limit=1)
    cancel_run(community.id, run.pk)
    assert set(states(run).values()) == {"canceled"}
    assert complete_step(held[0].lease, {}).__class__.__name__ == "LeaseLost"
    assert Run.objects.get(pk=run.pk).steps_left == 0


def test_restart_from_failure_keeps_a_succeeded_maps_output(community):
    from buzz_delivery.workflows.services import restart_run

    workflow = WorkflowFactory(community=community)
    run = start(
        workflow,
        {
            "steps": [
                {"key": "each", "kind": "map", "over": {"$ref": "input.items"}, "do": ECHO_ITEM},
                function_step("after", "test.boom", depends_on=["each"], retry={"max_attempts": 1}),
            ]
        },
        {"items": [1, 2], "n": 0},
    )
    run_until_idle(community.id)
    assert run_state(run) == "failed"
    new = restart_run(community.id, run.pk)
    assert Step.objects.get(run_id=new.pk, key="each").output == [{"x": 1, "n": 0}, {"x": 2, "n": 0}]
    assert not Step.objects.filter(run_id=new.pk, map_key__isnull=False).exists()
