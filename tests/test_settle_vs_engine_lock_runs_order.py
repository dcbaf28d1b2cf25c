"""A worker's batch settle of deliveries of two workflow runs, and an engine transaction that
locks those same two runs' engine rows (``sql.LOCK_RUNS``) at once: the engine's maintenance pass
ending them past their deadline, or ``send_event`` resuming a ``wait_event`` step in each.

The settle (``buzz_delivery_finish_leases``) locks the core's run rows in run id order (more than
one run), then its fan-in (``buzz_workflows_count_delivery``) locks each delivery's engine run row
(``buzz_workflows_run``) in delivery id order. ``LOCK_RUNS`` locked the engine rows in run id order
and no core row: when the deliveries' order is the runs' the other way round, each held an engine
run row the other waited for ("deadlock detected").

Deterministic: the settle meets its two deliveries second run first. The second run sends first
(a higher priority: its delivery has the lower id) and is claimed first (the settle's DELETE meets
the queue rows in the order the claims wrote them); the community holds a few hundred deliveries,
analyzed, so the settle reaches its records from those queue rows by key, as on tables at work (on
nearly empty ones the planner walks the records by ``delivery_identity_key``, whose run column
leads: run id order, the one order that hides the cycle). A transaction holding the second run's
send step (the engine at work on it) stops the settle between its two engine rows (it holds the
second run's and waits for that step); the engine side then locks the first run and waits for the
second. Once the step is free the settle needs the first run's row. The settle finds the deadlock
(a shorter ``deadlock_timeout``): ``send_event`` replays a deadlock's victim on its own, and the
settle is the side a worker sees fail.

A ``send_event`` over pages of one run each took no core row of those runs (``LOCK_RUNS`` takes none
for one run): the third test. The maintenance's cancel of the child runs of timed-out
``sub_workflow`` waits locked the children's engine rows after the parents', with no core row of a
child: the fourth. Its fix took the core rows of one level up only: a parent failed by its child's
end (``on_error: fail_run``) failed its own parent, which canceled its other children, their
engine rows locked with no core row: the fifth. ``cancel_run`` took the core rows of its run's
tree and of its parent only: a canceled child fails its parent's step the same way, up to the
root: the sixth."""

from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.db import connection, transaction

from buzz_delivery import services as core
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.services import Cause, Settled
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.services import Canceled, cancel_run, publish_definition, send_event, start_run
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from buzz_delivery.workflows.testing import function_step, run_until_idle, send_step
from tests.conftest import BARRIER_TIMEOUT, collecting, lock_waits_reach
from tests.lock_order_support import hold_row

LOCK_STEP = "SELECT 1 FROM buzz_workflows_step WHERE community_id = %s AND run_id = %s AND key = %s FOR NO KEY UPDATE"
FILL = 500
WAIT = {"key": "paid", "kind": "wait_event", "event": "payment", "event_key": "order:1"}


def past_deadline(community: Any, runs: list[Any]) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_workflows_run SET deadline_at = now() - interval '1 second'"
            " WHERE community_id = %s AND run_id = ANY(%s)",
            [community.id, [r.pk for r in runs]],
        )


def reap(community: Any) -> Any:
    return reap_workflow_steps()


def event(community: Any) -> Any:
    return send_event(community.id, "payment", "order:1", {"paid": True})


# The engine side: what sets it up, the call, how it ends each run.
FORMS = {
    "maintenance_run_deadline": (past_deadline, reap, "failed"),
    "send_event": (lambda community, runs: None, event, "running"),
}


def at_work(community: Any) -> None:
    """The deliveries of a community at work, analyzed: the settle reaches its rows by key."""
    many = WorkflowFactory(community=community)
    publish_definition(community.id, many.id, {"steps": [send_step("send", [random32() for _ in range(FILL)])]})
    start_run(community.id, many.id, {}, cause=Cause.event(os.urandom(32)), priority=-1)
    run_until_idle(community.id)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE buzz_delivery_delivery_queue, buzz_delivery_delivery_record")


def settle_against(community: Any, leases: list[Any], held_run: Any, engine_side: Any) -> dict[str, Any]:
    """The settle of ``leases`` (it meets ``held_run``'s delivery first) and ``engine_side``, at once,
    lined up by a transaction holding ``held_run``'s send step; what each returned."""
    connection.close()
    errors: list[BaseException] = []
    found: dict[str, Any] = {}
    holding, release = threading.Event(), threading.Event()
    guarded = collecting(errors)

    @guarded
    def engine_at_work() -> None:  # holds that run's send step for a moment
        hold_row(LOCK_STEP, [community.id, held_run.pk, "send"], holding, release)

    # Each side in a transaction of its own: a deadlock's victim raises instead of running again.
    @guarded
    def settle() -> None:
        with transaction.atomic():
            with connection.cursor() as cursor:  # it, not the engine side, finds a deadlock
                cursor.execute("SET LOCAL deadlock_timeout = '200ms'")
            found["settle"] = core.finish_deliveries(leases)

    @guarded
    def engine() -> None:
        with transaction.atomic():
            found["engine"] = engine_side()

    with ThreadPoolExecutor(max_workers=3) as pool:
        held = pool.submit(engine_at_work)
        assert holding.wait(BARRIER_TIMEOUT)
        settled = pool.submit(settle)
        lock_waits_reach(1, 5.0)  # the settle holds both core runs and the held run's engine row
        engined = pool.submit(engine)
        lock_waits_reach(2, 5.0)  # the engine side waits too (before the fix: holding the other)
        release.set()  # the settle counts in the held run's step, then needs the other run
        held.result(BARRIER_TIMEOUT)
        settled.result(BARRIER_TIMEOUT)
        engined.result(BARRIER_TIMEOUT)

    assert not errors, [str(e).splitlines()[0] for e in errors]
    assert found["settle"] == [Settled(status="finished")] * 2
    return found


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("form", list(FORMS))
def test_a_multi_run_settle_and_the_engine_locking_the_same_runs_never_deadlock(community, form):
    prepare, engine_side, run_state = FORMS[form]
    target, other = random32(), random32()
    workflow = WorkflowFactory(community=community)
    # A second step keeps each run running once its send has counted.
    steps = [send_step("send", [target]), send_step("later", [other]), WAIT]
    publish_definition(community.id, workflow.id, {"steps": steps})
    first, second = (
        start_run(community.id, workflow.id, {}, cause=Cause.event(os.urandom(32)), priority=p) for p in (0, 5)
    )
    at_work(community)
    assert first.pk < second.pk
    sends = [WorkflowAgentDelivery.objects.get(run_id=run.pk, step_id="send") for run in (second, first)]
    assert sends[0].id < sends[1].id  # the second run's delivery first, by id and by claim
    leases = [core.claim_delivery(community.id, target, delivery_id=d.id, lease_seconds=60).lease for d in sends]
    prepare(community, [first, second])

    found = settle_against(community, leases, second, lambda: engine_side(community))

    if form == "send_event":
        assert found["engine"].resumed == 2
    else:
        assert (found["engine"].runs_timed_out, found["engine"].skipped_busy) == (2, 0)
    for run in (first, second):
        assert Run.objects.get(pk=run.pk).state == run_state
        assert Step.objects.get(run_id=run.pk, key="send").state == "succeeded"  # counted before any end


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("canceled", ["parent", "child"])
def test_a_multi_run_settle_and_a_cancel_of_the_same_run_tree_never_deadlock(community, canceled):
    """A parent run and its child run each send to one target; a worker settles both deliveries in
    one batch while the operator cancels the parent (the walk locks the parent's engine row, then
    the child's: the settle meets the child's delivery first) or the child (its row, then its
    parent's, for the parent's step: the settle meets the parent's first)."""
    target, other = random32(), random32()
    child_flow, parent_flow = WorkflowFactory(community=community), WorkflowFactory(community=community)
    publish_definition(
        community.id, child_flow.id, {"steps": [send_step("send", [target]), send_step("later", [other])]}
    )
    sub = {"key": "child", "kind": "sub_workflow", "workflow": str(child_flow.id)}
    # The parent's send after a step of its own: the child's sends first.
    late = {"depends_on": ["pre"]} if canceled == "parent" else {}
    steps = [sub, function_step("pre"), send_step("send", [target], **late), send_step("later", [other])]
    publish_definition(community.id, parent_flow.id, {"steps": steps})
    parent = start_run(community.id, parent_flow.id, {}, cause=Cause.event(os.urandom(32)))
    at_work(community)
    child = Run.objects.get(parent_run_id=parent.pk)
    assert parent.pk < child.pk
    runs = (child, parent) if canceled == "parent" else (parent, child)  # in the settle's order
    sends = [WorkflowAgentDelivery.objects.get(run_id=run.pk, step_id="send") for run in runs]
    assert sends[0].id < sends[1].id  # by id and by claim
    leases = [core.claim_delivery(community.id, target, delivery_id=d.id, lease_seconds=60).lease for d in sends]
    run = parent if canceled == "parent" else child

    found = settle_against(community, leases, runs[0], lambda: cancel_run(community.id, run.pk))

    assert isinstance(found["engine"], Canceled)
    assert Run.objects.get(pk=run.pk).state == "canceled"
    for each in (parent, child):
        assert Step.objects.get(run_id=each.pk, key="send").state == "succeeded"  # counted before the cancel


@pytest.mark.django_db(transaction=True)
def test_a_multi_run_settle_and_a_send_event_over_pages_of_one_run_never_deadlock(community, monkeypatch):
    """``send_event`` resumes the waits of an event a page at a time (``waits.EVENT_PAGE``), each
    page's runs locked by ``LOCK_RUNS``, all in the send's one transaction. The pages come in run
    id order, so the core rows of pages of more than one run are taken in one ascending order; but
    ``LOCK_RUNS`` takes no core row for a page of one run, and a send over pages of one run each
    then held the first run's engine row (no core row) and waited for the second's, which the
    settle held with both core rows while it waited for the first's ("deadlock detected"). At the
    production page (1,000) a page holds more than one run unless it is the last (a run has at
    most ``MAX_STEPS`` = 500 steps): the page here is one step, each run's wait alone on its page."""
    from buzz_delivery.workflows.services import waits

    monkeypatch.setattr(waits, "EVENT_PAGE", 1)
    target, other = random32(), random32()
    workflow = WorkflowFactory(community=community)
    steps = [send_step("send", [target]), send_step("later", [other]), WAIT]
    publish_definition(community.id, workflow.id, {"steps": steps})
    first, second = (
        start_run(community.id, workflow.id, {}, cause=Cause.event(os.urandom(32)), priority=p) for p in (0, 5)
    )
    at_work(community)
    assert first.pk < second.pk
    sends = [WorkflowAgentDelivery.objects.get(run_id=run.pk, step_id="send") for run in (second, first)]
    assert sends[0].id < sends[1].id  # the settle meets the second run's delivery first
    leases = [core.claim_delivery(community.id, target, delivery_id=d.id, lease_seconds=60).lease for d in sends]

    found = settle_against(community, leases, second, lambda: event(community))

    assert found["engine"].resumed == 2  # over two pages (and an empty third)
    for run in (first, second):
        assert Step.objects.get(run_id=run.pk, key="paid").state == "succeeded"
        assert Step.objects.get(run_id=run.pk, key="send").state == "succeeded"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("on_error", ["continue", "fail_run"])
def test_a_multi_run_settle_and_the_maintenance_canceling_child_runs_of_timed_out_waits_never_deadlock(
    community, on_error
):
    """Two parent runs each wait on a child run (a ``sub_workflow`` step); each child sends to one
    target, and a worker settles both children's deliveries in one batch while the maintenance
    finds both waits timed out and cancels both children: one after the other, with their
    parents locked (``continue``: ``sql.END_RUN_IF_ACTIVE`` per child, ``fail_run``: the parent's
    end in the Advance). Its batch locked the parents' core rows, never the children's: it held
    the first child's engine row and waited for the second's, the settle (which meets the second
    child's delivery first: the first child sends after a step of its own) held the second's and
    needed the first's. Now the children's core rows are locked with the parents', in run id
    order (``sql.LOCK_RUNS_AND_TREES``): the maintenance waits for the settle, holding no engine
    row of a child."""
    target, other = random32(), random32()
    late_flow, early_flow = WorkflowFactory(community=community), WorkflowFactory(community=community)
    later = send_step("later", [other])  # keeps each child running once its send has counted
    late = [function_step("pre"), send_step("send", [target], depends_on=["pre"]), later]
    publish_definition(community.id, late_flow.id, {"steps": late})
    publish_definition(community.id, early_flow.id, {"steps": [send_step("send", [target]), later]})
    parents = []
    for child_flow in (late_flow, early_flow):
        flow = WorkflowFactory(community=community)
        sub = {"key": "child", "kind": "sub_workflow", "workflow": str(child_flow.id)}
        sub.update(wait_timeout_seconds=3600, on_error=on_error)
        publish_definition(community.id, flow.id, {"steps": [sub, WAIT]})  # WAIT keeps it running
        parents.append(start_run(community.id, flow.id, {}, cause=Cause.event(os.urandom(32))))
    at_work(community)
    children = [Run.objects.get(parent_run_id=parent.pk) for parent in parents]
    assert parents[0].pk < parents[1].pk < children[0].pk < children[1].pk
    sends = [WorkflowAgentDelivery.objects.get(run_id=run.pk, step_id="send") for run in reversed(children)]
    assert sends[0].id < sends[1].id  # the second child's delivery first, by id and by claim
    leases = [core.claim_delivery(community.id, target, delivery_id=d.id, lease_seconds=60).lease for d in sends]
    with connection.cursor() as cursor:  # the waits time out
        cursor.execute(
            "UPDATE buzz_workflows_step SET wait_deadline = now() - interval '1 second'"
            " WHERE community_id = %s AND run_id = ANY(%s) AND key = 'child' AND state = 'waiting'",
            [community.id, [p.pk for p in parents]],
        )
        assert cursor.rowcount == 2

    found = settle_against(community, leases, children[1], lambda: reap(community))

    assert (found["engine"].wait_timed_out, found["engine"].skipped_busy) == (2, 0)
    for parent, child in zip(parents, children, strict=True):
        assert Run.objects.get(pk=parent.pk).state == ("running" if on_error == "continue" else "failed")
        assert Run.objects.get(pk=child.pk).state == "canceled"
        assert Step.objects.get(run_id=child.pk, key="send").state == "succeeded"  # counted before the cancel


@dataclasses.dataclass
class TwoLevelTree:
    runs: tuple[Run, Run, Run, Run, Run]  # root, parent, leaf, side run, side child
    leases: list[Any]  # the side child's delivery's, then the side run's, both claimed


def two_level_tree(community, wait: dict[str, Any]) -> TwoLevelTree:
    """The run tree of the two-level cases: a grandparent (root) runs two ``sub_workflow`` steps
    (``on_error: fail_run``, the default), a parent whose own ``sub_workflow`` step (with
    ``wait``) waits on a leaf, and a side run, which waits on a child of its own. The side child
    and the side run each send to one target, the side run after a step of its own (its child's
    delivery comes first, by id and by claim); both deliveries are claimed."""
    target, other = random32(), random32()
    leaf_flow, side_child_flow = WorkflowFactory(community=community), WorkflowFactory(community=community)
    later = send_step("later", [other])  # keeps each run that has it running once its send has counted
    publish_definition(community.id, leaf_flow.id, {"steps": [later]})
    publish_definition(community.id, side_child_flow.id, {"steps": [send_step("send", [target]), later]})
    parent_flow, side_flow, root_flow = (WorkflowFactory(community=community) for _ in range(3))
    sub = {"key": "child", "kind": "sub_workflow", "workflow": str(leaf_flow.id), **wait}
    publish_definition(community.id, parent_flow.id, {"steps": [sub]})
    side = {"key": "child", "kind": "sub_workflow", "workflow": str(side_child_flow.id)}
    # The side run's send after a step of its own: its child's sends first.
    steps = [side, function_step("pre"), send_step("send", [target], depends_on=["pre"]), later]
    publish_definition(community.id, side_flow.id, {"steps": steps})
    subs = [
        {"key": key, "kind": "sub_workflow", "workflow": str(f.id)}
        for key, f in (("mid", parent_flow), ("side", side_flow))
    ]
    publish_definition(community.id, root_flow.id, {"steps": subs})  # on_error: fail_run (the default)
    root = start_run(community.id, root_flow.id, {}, cause=Cause.event(os.urandom(32)))
    at_work(community)
    parent = Run.objects.get(parent_run_id=root.pk, parent_step_key="mid")
    leaf = Run.objects.get(parent_run_id=parent.pk)
    side_run = Run.objects.get(parent_run_id=root.pk, parent_step_key="side")
    side_child = Run.objects.get(parent_run_id=side_run.pk)
    assert (root.depth, parent.depth, leaf.depth, side_run.depth, side_child.depth) == (0, 1, 2, 1, 2)
    runs = (side_child, side_run)  # in the settle's order
    sends = [WorkflowAgentDelivery.objects.get(run_id=run.pk, step_id="send") for run in runs]
    assert sends[0].id < sends[1].id  # the side child's delivery first, by id and by claim
    leases = [core.claim_delivery(community.id, target, delivery_id=d.id, lease_seconds=60).lease for d in sends]
    return TwoLevelTree((root, parent, leaf, side_run, side_child), leases)


@pytest.mark.django_db(transaction=True)
def test_a_multi_run_settle_and_the_maintenance_failing_a_run_tree_two_levels_up_never_deadlock(community):
    """A grandparent run waits on two child runs (``sub_workflow`` steps, ``on_error: fail_run``):
    a parent, itself waiting on a child run, and a side run, which waits on a child of its own;
    the side run and its child each send to one target, and a worker settles both deliveries in
    one batch (it meets the side child's first: the side run sends after a step of its own) while
    the maintenance finds the parent's wait timed out. The parent fails, cancels its child, then
    fails the grandparent's step, so the grandparent fails and cancels the side run, then the
    side run's child: their engine rows locked one after the other. The batch locked the core
    rows of the parent's tree and of its parent only, never the side runs': it held the side
    run's engine row and waited for its child's, the settle held the child's and needed the side
    run's. Now the core rows of the whole tree, from its root, are locked first, in run id order
    (``sql.LOCK_RUNS_AND_TREES``): the maintenance waits for the settle, holding no engine row."""
    tree = two_level_tree(community, {"wait_timeout_seconds": 3600})
    root, parent, leaf, side_run, side_child = tree.runs
    with connection.cursor() as cursor:  # the parent's wait times out
        cursor.execute(
            "UPDATE buzz_workflows_step SET wait_deadline = now() - interval '1 second'"
            " WHERE community_id = %s AND run_id = %s AND key = 'child' AND state = 'waiting'",
            [community.id, parent.pk],
        )
        assert cursor.rowcount == 1

    found = settle_against(community, tree.leases, side_child, lambda: reap(community))

    assert (found["engine"].wait_timed_out, found["engine"].skipped_busy) == (1, 0)
    for run, state in ((root, "failed"), (parent, "failed"), (leaf, "canceled"), (side_run, "canceled")):
        assert Run.objects.get(pk=run.pk).state == state
    assert Run.objects.get(pk=side_child.pk).state == "canceled"
    for run in (side_child, side_run):
        assert Step.objects.get(run_id=run.pk, key="send").state == "succeeded"  # counted before the cancel


@pytest.mark.django_db(transaction=True)
def test_a_multi_run_settle_and_a_cancel_failing_a_run_tree_two_levels_up_never_deadlock(community):
    """The fifth test's run tree, the operator canceling the parent's child run (the leaf): the
    parent's ``sub_workflow`` step fails with it (``child_run_canceled``, ``on_error: fail_run``),
    so the parent fails, then the grandparent's step, so the grandparent fails and cancels the side
    run, then the side run's child: their engine rows locked one after the other, while a worker
    settles the side runs' deliveries in one batch (it meets the side child's first). The cancel
    locked the core rows of the leaf's tree and of its parent only, never the side runs': it held
    the side run's engine row and waited for its child's, the settle held the child's and needed
    the side run's. Now the core rows of the whole tree, from its root, are locked first, in run id
    order (``sql.LOCK_CORE_RUNS_OF_TREE``, LOCK_RUNS_AND_TREES's walk): the cancel waits for the
    settle, holding no engine row."""
    tree = two_level_tree(community, {})
    root, parent, leaf, side_run, side_child = tree.runs

    found = settle_against(community, tree.leases, side_child, lambda: cancel_run(community.id, leaf.pk))

    assert isinstance(found["engine"], Canceled) and found["engine"].runs == 1
    ended = {leaf: "canceled", parent: "failed", root: "failed", side_run: "canceled", side_child: "canceled"}
    for run, state in ended.items():
        assert Run.objects.get(pk=run.pk).state == state
    assert Step.objects.get(run_id=parent.pk, key="child").failure_code == "child_run_canceled"
    for run in (side_child, side_run):
        assert Step.objects.get(run_id=run.pk, key="send").state == "succeeded"  # counted before the cancel
