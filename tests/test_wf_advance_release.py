"""The Advance trigger releases a successor in the UPDATE that counts its last dependency
(issue 31, migration 0024, ``bench/results/engine-server-cpu.md``): one new version of the
successor's row, not two (counted, then made ``ready`` by ``buzz_workflows_release``), and the
same outcome as before for every kind of successor: ready (with the completing statement's
clock), still pending (a dependency left), skipped (a dependency blocked it), or decided by its
``when`` condition."""

from __future__ import annotations

import datetime

import pytest
from django.db import connection, transaction

from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.services import claim_steps, complete_step, fail_step
from buzz_delivery.workflows.testing import diamond, function_step
from tests.citus_support import CITUS_MODE
from tests.wf_support import start, states

pytestmark = pytest.mark.django_db


@pytest.fixture
def workflow(community):
    return WorkflowFactory(community=community)


def claim_ready(community_id) -> dict:
    """Claims every ready step of the community, by key."""
    return {c.step.key: c for c in claim_steps(community_id, limit=100, lease_seconds=30)}


def claim(community_id, key: str):
    [found] = claim_ready(community_id).values()
    assert found.step.key == key
    return found


def same_statement_clock(ready_at, finished_at) -> bool:
    """The successor's ``ready_at`` is the clock of the statement that finished its last
    dependency. On Citus the trigger runs on the worker, whose statement started a little after
    the coordinator's (which evaluated ``finished_at``), as it did before migration 0024."""
    if CITUS_MODE:
        return finished_at <= ready_at <= finished_at + datetime.timedelta(seconds=5)
    return bool(ready_at == finished_at)


def step_versions_written() -> int:
    """Rows of the step table this transaction UPDATEd so far (each a new row version)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_get_xact_tuples_updated('buzz_workflows_step'::regclass)")
        return int(cursor.fetchone()[0])


def test_completing_a_step_writes_each_released_successor_once(workflow):
    run = start(workflow, diamond())
    first = claim(workflow.community_id, "step1")
    with transaction.atomic():
        before = step_versions_written()
        complete_step(first.lease, {"n": 1})
        # step1 settled, step2 and step3 counted and made ready: three versions (five before:
        # each released successor was UPDATEd a second time by buzz_workflows_release).
        assert step_versions_written() - before == 3
    assert states(run) == {"step1": "succeeded", "step2": "ready", "step3": "ready", "step4": "pending"}
    rows = {s.key: s for s in Step.objects.filter(run_id=run.pk)}
    # Ready at the completing statement's clock, as buzz_workflows_release set it.
    assert rows["step2"].ready_at == rows["step3"].ready_at
    assert same_statement_clock(rows["step2"].ready_at, rows["step1"].finished_at)
    assert (rows["step2"].deps_done, rows["step4"].deps_done, rows["step4"].ready_at) == (1, 0, None)


def test_the_join_waits_for_its_last_dependency_then_is_ready_once(workflow):
    run = start(workflow, diamond())
    complete_step(claim(workflow.community_id, "step1").lease, None)
    branches = claim_ready(workflow.community_id)
    complete_step(branches["step2"].lease, None)
    join = Step.objects.get(run_id=run.pk, key="step4")
    assert (join.state, join.deps_done, join.ready_at) == ("pending", 1, None)
    complete_step(branches["step3"].lease, None)
    join.refresh_from_db()
    last = Step.objects.get(run_id=run.pk, key="step3")
    assert (join.state, join.deps_done) == ("ready", 2)
    assert same_statement_clock(join.ready_at, last.finished_at)
    complete_step(claim(workflow.community_id, "step4").lease, None)
    assert Run.objects.get(pk=run.pk).state == "succeeded"


def test_a_blocked_or_conditional_successor_is_still_decided_by_release(workflow):
    run = start(
        workflow,
        {
            "steps": [
                function_step("check"),
                function_step("risky", on_error="skip_dependents"),
                function_step("go", depends_on=["check"], when={"ref": "steps.check.output.ok", "equals": True}),
                function_step("stop", depends_on=["check"], when={"ref": "steps.check.output.ok", "equals": False}),
                function_step("after_risky", depends_on=["risky"]),
            ]
        },
    )
    roots = claim_ready(workflow.community_id)
    complete_step(roots["check"].lease, {"ok": True})
    fail_step(roots["risky"].lease, "boom", retryable=False)
    found = {s.key: s for s in Step.objects.filter(run_id=run.pk)}
    assert {k: s.state for k, s in found.items()} == {
        "check": "succeeded",
        "risky": "failed",
        "go": "ready",
        "stop": "skipped",
        "after_risky": "skipped",
    }
    assert (found["stop"].skip_reason, found["after_risky"].skip_reason) == (
        "condition_false",
        "dependency_not_succeeded",
    )
    assert same_statement_clock(found["go"].ready_at, found["check"].finished_at)


def run_versions_written() -> tuple[int, int]:
    """Rows of the run table this transaction UPDATEd so far, and how many of them HOT."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_stat_get_xact_tuples_updated('buzz_workflows_run'::regclass),"
            " pg_stat_get_xact_tuples_hot_updated('buzz_workflows_run'::regclass)"
        )
        updated, hot = cursor.fetchone()
        return int(updated), int(hot)


def test_counting_a_step_in_its_run_stays_on_the_runs_page(workflow):
    """Runs are inserted one after another: without free room kept on each page (the run
    table's fillfactor), the first page was full and the Advance's ``steps_left`` update of a
    run on it wrote a new entry in every index of the run table (not HOT)."""
    chain = {"steps": [function_step("a"), function_step("b", depends_on=["a"])]}
    runs = [start(workflow, chain) for _ in range(60)]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT run_id, (ctid::text::point)[0]::int FROM buzz_workflows_run WHERE community_id = %s",
            [workflow.community_id],
        )
        page_of = {row[0]: row[1] for row in cursor.fetchall()}
    assert max(page_of.values()) > min(page_of.values())  # the first page is as full as it gets
    first = next(r for r in runs if page_of[r.pk] == min(page_of.values()))
    lease = next(
        c.lease for c in claim_steps(workflow.community_id, limit=100, lease_seconds=30) if c.lease.run_id == first.pk
    )
    with transaction.atomic():
        updated, hot = run_versions_written()
        complete_step(lease, None)
        assert run_versions_written() == (updated + 1, hot + 1)
    assert Run.objects.get(pk=first.pk).steps_left == 1
