"""The engine against hostile steps (issue 28): no property of one step freezes, kills or poisons
an orchestrator. A step's ``BaseException``, an exception whose ``str()`` raises, a failure code
PostgreSQL cannot store, a transaction left open, a session setting, its own connection
terminated, output that is not JSON: each fails (or, for a session setting, only concerns)
that step, and the worker serves everything else, on the same thread, and exits 0."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import threading

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, transaction

from buzz_delivery.models import Event
from buzz_delivery.services import LeaseLost, Settled
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows import executor
from buzz_delivery.workflows.models import DefinitionVersion, Run, Step
from buzz_delivery.workflows.registry import workflow_function
from buzz_delivery.workflows.services import claim_steps, complete_step, publish_definition, start_run
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from buzz_delivery.workflows.services.runs import IdempotencyConflict
from buzz_delivery.workflows.services.steps import release_steps
from buzz_delivery.workflows.testing import function_step, run_until_idle, send_step
from tests.test_wf_concurrency import ROOT, env
from tests.wf_support import start

pytestmark = pytest.mark.django_db

# --- in one process, inside the test's transaction --------------------------------------------


class Unprintable(RuntimeError):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


@workflow_function("test.unprintable")
def unprintable(input: dict, context: object) -> dict:
    raise Unprintable()


@workflow_function("test.system_exit")
def system_exit(input: dict, context: object) -> dict:
    raise SystemExit(2)


@workflow_function("test.atomic_left_open")
def atomic_left_open(input: dict, context: object) -> dict:
    transaction.atomic().__enter__()
    Event.objects.filter(pk=-1).update(content="never")  # a write in the block left open
    return {}


@workflow_function("test.quarter_mb")
def quarter_mb(input: dict, context: object) -> str:
    return "x" * 240_000


@pytest.fixture
def workflow(community):
    return WorkflowFactory(community=community)


def test_an_exception_whose_str_raises_fails_its_attempt_with_function_error_at_once(workflow):
    start(workflow, {"steps": [function_step("a", "test.unprintable", retry={"max_attempts": 2, "base_seconds": 0})]})
    [claim] = claim_steps(workflow.community_id, lease_seconds=30)

    assert executor.execute(claim) == Settled("ready")  # not left to its lease: retried now

    step = Step.objects.get(id=claim.lease.step_id)
    assert (step.state, step.failure_code) == ("ready", "function_error")
    assert step.failure_message == "Unprintable: <unprintable Unprintable>"


def test_a_step_that_raises_system_exit_fails_with_function_aborted_and_is_not_retried(workflow):
    start(workflow, {"steps": [function_step("a", "test.system_exit", retry={"max_attempts": 3})]})
    [claim] = claim_steps(workflow.community_id, lease_seconds=30)

    assert executor.execute(claim) == Settled("failed")

    step = Step.objects.get(id=claim.lease.step_id)
    assert (step.state, step.failure_code, step.attempts) == ("failed", "function_aborted", 1)
    assert step.failure_message == "SystemExit: 2"


def test_a_step_that_leaves_an_atomic_block_open_fails_alone_and_its_block_is_rolled_back(workflow):
    start(workflow, {"steps": [function_step("a", "test.atomic_left_open")]})
    start(WorkflowFactory(community=workflow.community), {"steps": [function_step("b", "noop")]})
    depth = len(connection.atomic_blocks)  # the test's own transaction
    claims = claim_steps(workflow.community_id, limit=2, lease_seconds=30)

    outcomes = [executor.execute(claim) for claim in claims]

    assert len(connection.atomic_blocks) == depth  # the step's block was exited (rolled back)
    assert outcomes == [Settled("failed"), Settled("succeeded")]
    rows = dict(Step.objects.filter(community_id=workflow.community_id).values_list("key", "failure_code"))
    assert rows == {"a": "transaction_left_open", "b": None}


def test_a_sub_workflow_childs_input_built_from_references_keeps_the_input_bound(workflow):
    child = WorkflowFactory(community=workflow.community)
    publish_definition(child.community_id, child.id, {"steps": [function_step("c", "noop")]})
    parts = [function_step(f"p{i}", "test.quarter_mb") for i in range(5)]  # 5 x 240 KB outputs
    sub = {
        "key": "sub",
        "kind": "sub_workflow",
        "workflow": str(child.id),
        "depends_on": [p["key"] for p in parts],
        "input": {p["key"]: {"$ref": f"steps.{p['key']}.output"} for p in parts},
    }
    run = start(workflow, {"steps": [*parts, sub]})

    run_until_idle(workflow.community_id)

    step = Step.objects.get(run_id=run.pk, key="sub")
    assert (step.state, step.failure_code) == ("failed", "input_too_large")
    assert not Run.objects.filter(community_id=workflow.community_id, parent_run_id=run.pk).exists()


def test_a_send_message_step_stamps_its_message_event_with_the_database_clock(workflow, monkeypatch):
    from django.utils import timezone

    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() + dt.timedelta(days=1))  # this host a day ahead
    run = start(workflow, {"steps": [send_step("send", [random32()])]})

    run_until_idle(workflow.community_id)

    event = Event.objects.get(community_id=workflow.community_id, event_id=executor.message_event_id(run.pk, "send"))
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        db_now = cursor.fetchone()[0]
    assert abs((event.created_at - db_now).total_seconds()) < 60


@pytest.mark.parametrize(
    ("step", "field"),
    [
        ({"key": "a", "kind": "function", "function": "noop", "input": {"q": "a\x00b"}}, "steps[0].input.q"),
        ({"key": "a", "kind": "function", "function": "noop", "input": {"k\ud800": 1}}, "steps[0].input.<key>"),
        ({"key": "a\x00", "kind": "function", "function": "noop"}, "steps[0].key"),
        (
            {"key": "a", "kind": "function", "function": "noop", "when": {"ref": "input.x", "equals": "\ud83d"}},
            "steps[0].when.equals",
        ),
        (
            {"key": "a", "kind": "function", "function": "noop", "input": {"r": {"$ref": "input.x\x00"}}},
            "steps[0].input.r.$ref",
        ),
        ({"key": "a", "kind": "approval", "deadline_seconds": 60, "prompt": "ok?\x00"}, "steps[0].prompt"),
    ],
)
def test_definition_text_postgresql_cannot_store_is_refused_by_step_and_field(workflow, step, field):
    before = DefinitionVersion.objects.count()

    with pytest.raises(ValidationError) as caught:
        publish_definition(workflow.community_id, workflow.id, {"steps": [step]})

    assert list(caught.value.message_dict) == [field]
    assert DefinitionVersion.objects.count() == before  # nothing written


def test_start_run_and_intake_event_judge_the_same_input_alike(workflow):
    from buzz_delivery.agents.services import Created, Duplicate, intake_event
    from buzz_delivery.services import Cause

    start(workflow, {"steps": [function_step("a", "noop")]})
    cause = Cause.event(os.urandom(32))
    first = start_run(workflow.community_id, workflow.id, {"amount": 1}, cause=cause, idempotency_key="k1")
    again = start_run(workflow.community_id, workflow.id, {"amount": 1.0}, cause=cause, idempotency_key="k1")
    assert again.pk == first.pk
    start_run(workflow.community_id, workflow.id, {"flag": True}, cause=cause, idempotency_key="k2")
    with pytest.raises(IdempotencyConflict):  # true is not 1 in JSON (Python's == says it is)
        start_run(workflow.community_id, workflow.id, {"flag": 1}, cause=cause, idempotency_key="k2")

    agent = random32()
    created = intake_event(workflow.community_id, "test", "event-1", {"amount": 1}, agent)
    assert isinstance(created, Created)
    assert intake_event(workflow.community_id, "test", "event-1", {"amount": 1.0}, agent) == Duplicate(created.run_id)


def test_release_steps_hands_claims_back_with_their_attempt_and_fences_the_old_lease(workflow):
    start(workflow, {"steps": [function_step("a", "noop")]})
    [claim] = claim_steps(workflow.community_id, lease_seconds=30)

    assert release_steps(workflow.community_id, [claim.lease]) == 1

    step = Step.objects.get(id=claim.lease.step_id)
    assert (step.state, step.attempts, step.lease_generation) == ("ready", 0, claim.lease.lease_generation + 1)
    assert step.history[-1]["event"] == "release"
    assert complete_step(claim.lease, {}) == LeaseLost()
    assert release_steps(workflow.community_id, [claim.lease]) == 0  # a lost lease is not released
    [again] = claim_steps(workflow.community_id, lease_seconds=30)
    assert again.lease.attempts == 1


# --- the worker as a real process ----------------------------------------------------------------

POISON = {  # function -> (state, failure code) the step ends with
    "poison.system_exit": ("failed", "function_aborted"),
    "poison.keyboard_interrupt": ("failed", "function_aborted"),
    "poison.base_exception": ("failed", "function_aborted"),
    "poison.unprintable": ("failed", "attempts_exhausted"),  # function_error on each attempt
    "poison.bad_code": ("failed", "c" * 64),
    "poison.atomic_left_open": ("failed", "transaction_left_open"),
    "poison.raw_begin": ("failed", "transaction_left_open"),
    "poison.autocommit_off": ("failed", "transaction_left_open"),
    "poison.statement_timeout": ("succeeded", None),  # the session is cleaned after it
    "poison.terminate_self": ("failed", "attempts_exhausted"),  # function_error: OperationalError
    "poison.not_json": ("failed", "output_not_json"),
    "poison.nul_output": ("failed", "output_not_json"),
}


def run_poison_worker(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.wf_poison_worker", *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.django_db(transaction=True)
def test_the_workflow_worker_poison_matrix_each_step_fails_alone_and_the_worker_serves_the_rest(community):
    runs = {}
    ordinary = []
    for function in POISON:
        workflow = WorkflowFactory(community=community)
        retry = {"max_attempts": 2, "base_seconds": 0} if function == "poison.unprintable" else {"max_attempts": 1}
        runs[function] = start(workflow, {"steps": [function_step("p", function, retry=retry)]})
        # An ordinary step after each poison one: on a single step thread it runs right after.
        ordinary.append(start(WorkflowFactory(community=community), {"steps": [function_step("s", "poison.sql")]}))

    proc = run_poison_worker(
        "--community", str(community.id), "--concurrency", "1", "--poll-interval", "0.2",
        "--idle-exit", "2", "--lease-seconds", "5",
    )  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    for function, (state, code) in POISON.items():
        step = Step.objects.get(run_id=runs[function].pk)
        assert (step.state, step.failure_code) == (state, code), (function, step.failure_message)
        assert "reap" not in [entry["event"] for entry in step.history], function  # never left to lapse
    messages = {f: Step.objects.get(run_id=runs[f].pk).failure_message for f in POISON}
    assert messages["poison.unprintable"] == "function_error: Unprintable: <unprintable Unprintable>"
    assert messages["poison.terminate_self"].startswith("function_error: OperationalError")
    assert messages["poison.system_exit"] == "SystemExit: 3"
    for run in ordinary:
        step = Step.objects.get(run_id=run.pk)
        assert step.state == "succeeded"
        assert step.output == {"statement_timeout": "0", "in_atomic_block": False}  # a clean session
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = sum(1 for state, _ in POISON.values() if state == "failed")
    assert (summary["failed"], summary["succeeded"], summary["retried"]) == (failed, len(ordinary) + 1, 1)
    assert (summary["errors"], summary["reason"], summary["exit_code"]) == (0, "idle_exit", 0)
    # The step's own community (a join on run_id alone needs repartitioning on Citus).
    assert not Step.objects.filter(community=community, state="running").exists()


@pytest.mark.django_db(transaction=True)
def test_maintenance_skips_a_community_whose_run_row_a_stuck_transaction_holds_and_serves_the_others(community):
    from buzz_delivery.testing import CommunityFactory
    from tests.wf_support import backdate_step_lease

    stuck_wf, other_wf = WorkflowFactory(community=community), WorkflowFactory(community=CommunityFactory())
    stuck, other = (start(wf, {"steps": [function_step("a", "noop")]}) for wf in (stuck_wf, other_wf))
    for wf in (stuck_wf, other_wf):
        [claim] = claim_steps(wf.community_id, lease_seconds=30)
        backdate_step_lease(claim.lease.step_id)
    holding, release = threading.Event(), threading.Event()

    def hold_the_run_row() -> None:  # a worker's connection left in a transaction, holding the run
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(  # its community named: one shard on Citus, which locks rows of one
                    "SELECT 1 FROM buzz_workflows_run WHERE community_id = %s AND run_id = %s FOR UPDATE",
                    [community.id, stuck.pk],
                )
            holding.set()
            release.wait(30)
        connection.close()

    holder = threading.Thread(target=hold_the_run_row)
    holder.start()
    try:
        assert holding.wait(10)
        done: list = []
        reaper = threading.Thread(target=lambda: (done.append(reap_workflow_steps()), connection.close()))
        reaper.start()
        reaper.join(20)
        assert done, "reap_workflow_steps waited on the held row lock"
    finally:
        release.set()
        holder.join()
    result = done[0]
    assert (result.reclaimed, result.skipped_busy) == (1, 1)
    assert Step.objects.get(run_id=other.pk).state == "ready"
    assert Step.objects.get(run_id=stuck.pk).state == "running"  # left for the next pass
