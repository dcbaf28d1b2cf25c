"""The engine agrees with a pure-Python model of SPEC section 11 on random DAGs and random
operation sequences: claims, completions, failures (retryable or not), crashes (lapsed leases
reclaimed by the maintenance), stale and repeated lease use, cancels and restarts. After every
operation every run's state and every step's state must equal the model's: each step terminal
once, no fan-in lost or doubled (``deps_done``, ``steps_left``)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import pytest
from django.db import connection, transaction
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from buzz_delivery.services import AlreadyTerminal, Cause, LeaseLost, Settled
from buzz_delivery.testing import CommunityFactory, WorkflowFactory
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.services import (
    Canceled,
    cancel_run,
    claim_steps,
    complete_and_claim_steps,
    complete_step,
    fail_step,
    publish_definition,
    restart_run,
    start_run,
)
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from tests.citus_mode import repetitions
from tests.model_support import run_machine

pytestmark = pytest.mark.django_db
TERMINAL = ("succeeded", "failed", "skipped", "canceled")
STATS = {"examples": 0, "steps": 0}


@dataclass
class MStep:
    key: str
    deps: list[str]
    dependents: list[str]
    on_error: str
    max_attempts: int
    when_flag: bool | None  # the step runs only when input.flag equals this (None: no condition)
    state: str = "pending"
    deps_done: int = 0
    deps_blocked: int = 0
    attempts: int = 0
    gen: int = 0


@dataclass
class MRun:
    run_id: object
    flag: bool
    steps: dict[str, MStep]
    state: str = "running"
    left: int = 0
    order: list[str] = field(default_factory=list)

    def finish(self, s: MStep, state: str) -> None:
        """A step becomes terminal: Advance, as the trigger does it."""
        s.state = state
        self.left -= 1
        left = self.left
        if self.state != "running" or state == "canceled":
            return
        if state == "failed" and s.on_error == "fail_run":
            self.end("failed")
            return
        blocked = state == "skipped" or (state == "failed" and s.on_error == "skip_dependents")
        for key in s.dependents:
            d = self.steps[key]
            if d.state == "pending":
                d.deps_done += 1
                d.deps_blocked += int(blocked)
                if d.deps_done == len(d.deps):
                    self.release(d)
        if left == 0:
            self.end("succeeded")

    def release(self, s: MStep) -> None:
        if s.deps_blocked or (s.when_flag is not None and s.when_flag != self.flag):
            self.finish(s, "skipped")
        else:
            s.state = "ready"

    def end(self, state: str) -> None:
        if self.state != "running":
            return
        if state != "succeeded":
            for s in self.steps.values():
                if s.state not in TERMINAL:
                    s.state = "canceled"
                    s.gen += 1
                    self.left -= 1
        self.state = state

    def start(self) -> None:
        self.left = len(self.steps)
        for key in self.order:
            if not self.steps[key].deps:
                self.release(self.steps[key])


@st.composite
def dags(draw: st.DrawFn) -> list[dict]:
    n = draw(st.integers(min_value=1, max_value=5))
    steps = []
    for i in range(n):
        deps = draw(st.lists(st.sampled_from([f"s{j}" for j in range(i)]), unique=True, max_size=3)) if i else []
        step = {
            "key": f"s{i}",
            "kind": "function",
            "function": "noop",
            "depends_on": deps,
            "on_error": draw(st.sampled_from(["fail_run", "continue", "skip_dependents"])),
            "retry": {"max_attempts": draw(st.integers(min_value=1, max_value=2)), "base_seconds": 0},
        }
        flag = draw(st.sampled_from([None, None, True, False]))
        if flag is not None:
            step["when"] = {"ref": "input.flag", "equals": flag}
        steps.append(step)
    return steps


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        STATS["examples"] += 1
        self._atomic = transaction.atomic()
        self._atomic.__enter__()
        self.community = CommunityFactory()
        self.workflow = WorkflowFactory(community=self.community)
        self.runs: list[MRun] = []
        self.leases: list[tuple[MRun, str, object]] = []  # (run, key, StepLease)

    def teardown(self) -> None:
        transaction.set_rollback(True)
        self._atomic.__exit__(None, None, None)

    @initialize(definition=dags())
    def publish(self, definition: list[dict]) -> None:
        self.definition = definition
        publish_definition(self.community.id, self.workflow.id, {"steps": definition})

    def _model_run(self, run_id: object, flag: bool) -> MRun:
        steps = {}
        for s in self.definition:
            dependents = [t["key"] for t in self.definition if s["key"] in t["depends_on"]]
            when = s.get("when", {}).get("equals")
            steps[s["key"]] = MStep(
                s["key"], s["depends_on"], dependents, s["on_error"], s["retry"]["max_attempts"], when
            )
        return MRun(run_id, flag, steps, order=[s["key"] for s in self.definition])

    @precondition(lambda self: len(self.runs) < 3)
    @rule(flag=st.booleans())
    def start(self, flag: bool) -> None:
        run = start_run(self.community.id, self.workflow.id, {"flag": flag}, cause=Cause.event(os.urandom(32)))
        model = self._model_run(run.pk, flag)
        model.start()
        self.runs.append(model)

    @rule()
    def claim_all(self) -> None:
        self._claimed(claim_steps(self.community.id, limit=100, lease_seconds=60))

    def _claimed(self, claims: list) -> None:
        """Every ready step of the model was claimed, and nothing else."""
        got = sorted((str(c.lease.run_id), c.step.key) for c in claims)
        expected = sorted((str(r.run_id), s.key) for r in self.runs for s in r.steps.values() if s.state == "ready")
        assert got == expected
        by_id = {str(r.run_id): r for r in self.runs}
        for c in claims:
            run = by_id[str(c.lease.run_id)]
            s = run.steps[c.step.key]
            s.state, s.attempts, s.gen = "running", s.attempts + 1, s.gen + 1
            assert (c.lease.attempts, c.lease.lease_generation) == (s.attempts, s.gen)
            self.leases.append((run, c.step.key, c.lease))

    def _expected(self, run: MRun, key: str, lease: object, *, retry_ok: bool = False) -> object | None:
        s = run.steps[key]
        if s.state == "running" and s.gen == lease.lease_generation:
            return None  # the lease is current
        if s.gen == lease.lease_generation and s.state in TERMINAL:
            return AlreadyTerminal(s.state)
        if retry_ok and s.gen == lease.lease_generation and s.state == "ready":
            return Settled("ready")
        return LeaseLost()

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(min_value=0, max_value=50))
    def complete(self, i: int) -> None:
        run, key, lease = self.leases[i % len(self.leases)]
        expected = self._expected(run, key, lease)
        outcome = complete_step(lease, {"k": key})
        if expected is None:
            expected = Settled("succeeded")
            run.finish(run.steps[key], "succeeded")
        assert outcome == expected

    @precondition(lambda self: self.leases)
    @rule(picks=st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=6), chain=st.booleans())
    def complete_batch(self, picks: list[int], chain: bool) -> None:
        """Several leases (current, stale or already ended; one per step) completed in one
        statement; with ``chain`` every ready step is claimed in the same transaction."""
        chosen: dict[object, tuple[MRun, str, object]] = {}
        for i in picks:
            run, key, lease = self.leases[i % len(self.leases)]
            chosen.setdefault(lease.step_id, (run, key, lease))
        items = list(chosen.values())
        expected = [self._expected(run, key, lease) for run, key, lease in items]
        batch = complete_and_claim_steps(
            self.community.id, [(lease, {"k": key}) for _, key, lease in items], claim_limit=100 if chain else 0
        )
        for (run, key, _), want in zip(items, expected, strict=True):
            if want is None:
                run.finish(run.steps[key], "succeeded")
        assert batch.outcomes == [want or Settled("succeeded") for want in expected]
        if chain:
            self._claimed(batch.claims)
        else:
            assert batch.claims == []

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(min_value=0, max_value=50), retryable=st.booleans())
    def fail(self, i: int, retryable: bool) -> None:
        run, key, lease = self.leases[i % len(self.leases)]
        s = run.steps[key]
        retry_path = retryable and lease.attempts < s.max_attempts
        expected = self._expected(run, key, lease, retry_ok=retry_path)
        outcome = fail_step(lease, "boom", retryable=retryable)
        if expected is None:
            if retry_path:
                s.state = "ready"
                expected = Settled("ready")
            else:
                expected = Settled("failed")
                run.finish(s, "failed")
        assert outcome == expected

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(min_value=0, max_value=50))
    def crash(self, i: int) -> None:
        """The holder dies: its lease lapses and the maintenance reclaims (or exhausts) it."""
        run, key, lease = self.leases[i % len(self.leases)]
        s = run.steps[key]
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE buzz_workflows_step SET lease_until = now() - interval '1 hour',"
                " claimed_at = now() - interval '2 hours' WHERE community_id = %s AND id = %s AND state = 'running'"
                " AND lease_generation = %s",
                [lease.community_id, lease.step_id, lease.lease_generation],
            )
        result = reap_workflow_steps()
        if s.state == "running" and s.gen == lease.lease_generation:
            s.gen += 1
            if s.attempts < s.max_attempts:
                s.state = "ready"
                assert (result.reclaimed, result.exhausted) == (1, 0)
            else:
                assert (result.reclaimed, result.exhausted) == (0, 1)
                run.finish(s, "failed")
        else:
            assert result.total == 0

    @precondition(lambda self: self.runs)
    @rule(i=st.integers(min_value=0, max_value=50))
    def cancel(self, i: int) -> None:
        run = self.runs[i % len(self.runs)]
        outcome = cancel_run(self.community.id, run.run_id)
        if run.state == "running":
            assert isinstance(outcome, Canceled)
            run.end("canceled")
        else:
            assert outcome == AlreadyTerminal(run.state)

    @precondition(lambda self: any(r.state != "running" for r in self.runs) and len(self.runs) < 5)
    @rule(i=st.integers(min_value=0, max_value=50), from_failure=st.booleans())
    def restart(self, i: int, from_failure: bool) -> None:
        ended = [r for r in self.runs if r.state != "running"]
        old = ended[i % len(ended)]
        new = restart_run(self.community.id, old.run_id, from_failure=from_failure)
        model = self._model_run(new.pk, old.flag)
        model.start()
        if from_failure:
            kept: set[str] = set()
            for key in old.order:  # definition order is topological here (deps come first)
                s = old.steps[key]
                if s.state == "succeeded" and all(d in kept for d in s.deps):
                    kept.add(key)
            for key in model.order:
                if key in kept and model.steps[key].state == "ready":
                    model.finish(model.steps[key], "succeeded")
        self.runs.append(model)

    @invariant()
    def database_agrees_with_the_model(self) -> None:
        STATS["steps"] += 1
        for run in self.runs:
            db_run = Run.objects.get(pk=run.run_id)
            rows = {s.key: s for s in Step.objects.filter(community_id=self.community.id, run_id=run.run_id)}
            assert {k: s.state for k, s in rows.items()} == {k: s.state for k, s in run.steps.items()}
            assert (db_run.state, db_run.steps_left) == (run.state, run.left)
            for key, s in run.steps.items():
                row = rows[key]
                assert (row.deps_done, row.deps_blocked, row.attempts, row.lease_generation) == (
                    s.deps_done,
                    s.deps_blocked,
                    s.attempts,
                    s.gen,
                ), key


def _run(examples: int, steps: int) -> None:
    STATS.update(examples=0, steps=0)
    started = time.monotonic()
    run_machine(EngineMachine, examples, steps)
    print(
        f"\nengine model: {STATS['examples']} examples, {STATS['steps']} checked states, "
        f"{time.monotonic() - started:.1f} s"
    )


def test_the_engine_agrees_with_the_model_on_random_dags_and_operations():
    _run(examples=repetitions("tests/test_wf_model_based.py", full=80, on_cluster=20), steps=25)


@pytest.mark.slow
def test_the_engine_agrees_with_the_model_on_long_random_sequences():
    _run(examples=600, steps=50)
