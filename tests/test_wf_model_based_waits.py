"""The engine agrees with a pure-Python model of its waiting kinds (issue 33, SPEC 16 "Engine
waits") on random DAGs of ``sleep``, ``wait_event``, ``map`` and ``function`` steps, under random
operations: step claims and work (a map expands, then collects), events sent before, during and
after the waits (kept for their window, or past it), sleeps woken and waits timed out (by the
maintenance or the orchestrator's poll, under each ``on_timeout``), map items that succeed or
fail (tolerated or not), lists of no, one and many items, and cancels while steps wait.

After every operation the database must equal the model: every run's state, ``steps_left`` and
output; every step's state (map items included), counters, attempts, generation, output and
failure code. Beyond the model: each step became terminal exactly once and never left it (an
audit trigger counts every state change), and ``steps_left`` equals the open steps."""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from django.db import connection, transaction
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from buzz_delivery.services import AlreadyTerminal, Cause, Settled
from buzz_delivery.testing import CommunityFactory, WorkflowFactory
from buzz_delivery.workflows import executor
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.services import (
    Canceled,
    cancel_run,
    claim_steps,
    complete_step,
    end_due_waits,
    fail_step,
    publish_definition,
    send_event,
    start_run,
)
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from tests.model_support import run_machine
from tests.test_wf_model_based_kinds import AUDIT

pytestmark = pytest.mark.django_db
TERMINAL = ("succeeded", "failed", "skipped", "canceled")
KEYS = ["a", "b"]
STATS = {"examples": 0, "steps": 0}
SEEN: Counter[str] = Counter()
UNSET = object()


@dataclass(eq=False)
class MStep:
    key: str
    kind: str
    spec: dict[str, Any]
    dependents: list[str]
    deps_total: int
    on_error: str
    max_attempts: int
    item: Any = None  # a map item's value
    state: str = "pending"
    deps_done: int = 0
    deps_blocked: int = 0
    attempts: int = 0
    gen: int = 0
    output: Any = None
    failure_code: str | None = None
    expected: int | None = None  # a map step's items, once expanded


@dataclass(eq=False)
class MRun:
    run_id: Any
    input: dict[str, Any]
    steps: dict[str, MStep]
    state: str = "running"
    left: int = 0
    output: Any = None

    def start(self) -> None:
        self.left = len(self.steps)
        for s in list(self.steps.values()):
            if s.deps_total == 0 and s.state == "pending":
                self.release(s)

    def finish(self, s: MStep, state: str, *, output: Any = UNSET, code: str | None = None) -> None:
        """A step becomes terminal: Advance, as the trigger does it."""
        assert s.state not in TERMINAL, (s.key, s.state, state)
        SEEN[f"{s.kind} {s.state}->{state}"] += 1
        s.state = state
        if output is not UNSET:
            s.output = output
        if state == "failed":
            s.failure_code = code
        self.left -= 1
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
                if d.deps_done == d.deps_total:
                    self.release(d)
        if self.left == 0:
            self.end("succeeded")

    def release(self, s: MStep) -> None:
        if s.deps_blocked:
            self.finish(s, "skipped")
        else:
            s.state = "ready"

    def end(self, state: str) -> bool:
        if self.state != "running":
            return False
        if state != "succeeded":
            for s in self.steps.values():
                if s.state not in TERMINAL:
                    s.state = "canceled"
                    s.gen += 1
                    self.left -= 1
        sinks = {k: s.output for k, s in self.steps.items() if not s.dependents and s.state == "succeeded"}
        self.output = sinks or None
        SEEN[f"run {state}"] += 1
        self.state = state
        return True


@st.composite
def dags(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A random DAG with one step of each waiting kind and up to two more of any kind."""
    kinds = ["sleep", "wait_event", "map"]
    chosen = draw(st.permutations(kinds + draw(st.lists(st.sampled_from([*kinds, "function"]), max_size=2))))
    steps: list[dict[str, Any]] = []
    for i, kind in enumerate(chosen):
        earlier = [s["key"] for s in steps]
        deps = draw(st.lists(st.sampled_from(earlier), unique=True, max_size=2)) if earlier else []
        step: dict[str, Any] = {
            "key": f"s{i}",
            "kind": kind,
            "depends_on": deps,
            "on_error": draw(st.sampled_from(["fail_run", "continue", "skip_dependents"])),
            "retry": {"max_attempts": 1},
        }
        if kind == "function":
            step["function"] = "noop"
        elif kind == "sleep":
            step["seconds"] = draw(st.sampled_from([0, 600, 600]))
        elif kind == "wait_event":
            step["event"] = "e"
            step["event_key"] = {"$ref": "input.k"}
            step["on_timeout"] = draw(st.sampled_from(["fail", "continue", "skip_dependents"]))
            if draw(st.sampled_from([True, True, True, False])):
                step["wait_timeout_seconds"] = 600
        else:
            step["over"] = {"$ref": "input.items"}
            step["do"] = {"kind": "function", "function": "echo", "input": {"x": {"$ref": "item"}}}
            step["tolerate_failures"] = draw(st.integers(min_value=0, max_value=1))
        steps.append(step)
    return steps


class WaitsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        STATS["examples"] += 1
        self._atomic = transaction.atomic()
        self._atomic.__enter__()
        self.community = CommunityFactory()
        self.cid = self.community.id
        self.workflow = WorkflowFactory(community=self.community)
        self.runs: list[MRun] = []
        self.claims: list[tuple[MRun, str, Any]] = []
        self.kept: dict[str, Any] = {}  # key -> payload of the event kept for later waits

    def teardown(self) -> None:
        transaction.set_rollback(True)
        self._atomic.__exit__(None, None, None)

    # --- runs ---------------------------------------------------------------------------

    @initialize(definition=dags())
    def publish(self, definition: list[dict[str, Any]]) -> None:
        self.definition = definition
        publish_definition(self.cid, self.workflow.id, {"steps": definition})

    def _model_run(self, run_id: Any, input: dict[str, Any]) -> MRun:
        steps = {}
        for s in self.definition:
            dependents = [t["key"] for t in self.definition if s["key"] in t["depends_on"]]
            steps[s["key"]] = MStep(
                s["key"], s["kind"], s, dependents, len(s["depends_on"]), s["on_error"], s["retry"]["max_attempts"]
            )
        return MRun(run_id, input, steps)

    @precondition(lambda self: len(self.runs) < 4)
    @rule(key=st.sampled_from(KEYS), n=st.sampled_from([0, 1, 3]))
    def start(self, key: str, n: int) -> None:
        """A run whose wait_event steps wait for key ``key`` and whose maps get ``n`` items."""
        input = {"k": key, "items": list(range(n))}
        run = start_run(self.cid, self.workflow.id, input, cause=Cause.event(os.urandom(32)))
        model = self._model_run(run.pk, input)
        self.runs.append(model)
        model.start()
        SEEN[f"map over {n}"] += 1

    @precondition(lambda self: self.runs)
    @rule(i=st.integers(min_value=0, max_value=50), now=st.integers(min_value=0, max_value=3))
    def cancel(self, i: int, now: int) -> None:
        if now:  # a quarter as likely as the other rules: a canceled run stops being interesting
            return
        run = self.runs[i % len(self.runs)]
        waiting = sum(s.state in ("waiting", "pending") for s in run.steps.values())
        outcome = cancel_run(self.cid, run.run_id)
        if run.state != "running":
            assert outcome == AlreadyTerminal(run.state)
            return
        assert isinstance(outcome, Canceled)
        SEEN["cancel while waiting"] += int(any(s.state == "waiting" for s in run.steps.values()))
        SEEN["cancel while mapping"] += int(waiting and any(s.expected for s in run.steps.values()))
        run.end("canceled")

    def _parked_runs(self) -> list[MRun]:
        """Running runs with a step parked: waiting (sleep, event) or a map on its items."""
        parked = ("waiting",)
        return [
            r
            for r in self.runs
            if r.state == "running"
            and any(s.state in parked or (s.expected and s.state == "pending") for s in r.steps.values())
        ]

    @precondition(lambda self: self._parked_runs())
    @rule(i=st.integers(min_value=0, max_value=50), now=st.booleans())
    def cancel_while_parked(self, i: int, now: bool) -> None:
        """A cancel while a step sleeps, waits for its event or maps (three times in four: at
        half, a CI run of three rounds drew no such cancel at all)."""
        if now or i % 2:
            parked = self._parked_runs()
            self.cancel(self.runs.index(parked[i % len(parked)]), 0)

    # --- steps --------------------------------------------------------------------------

    @rule(plan=st.lists(st.sampled_from(["work", "work", "work", "work", "work", "fail", "hold"]), max_size=8))
    def claim_and_work(self, plan: list[str]) -> None:
        """Claim every ready step (map items included); work or fail the first few at once."""
        first = len(self.claims)
        claims = claim_steps(self.cid, limit=100, lease_seconds=120)
        got = sorted((str(c.lease.run_id), c.step.key) for c in claims)
        expected = sorted((str(r.run_id), s.key) for r in self.runs for s in r.steps.values() if s.state == "ready")
        assert got == expected
        by_id = {str(r.run_id): r for r in self.runs}
        for c in claims:
            run = by_id[str(c.lease.run_id)]
            s = run.steps[c.step.key]
            s.state, s.attempts, s.gen = "running", s.attempts + 1, s.gen + 1
            assert (c.lease.attempts, c.lease.lease_generation) == (s.attempts, s.gen)
            self.claims.append((run, c.step.key, c))
        for offset, what in enumerate(plan[: len(claims)]):
            if what == "work":
                self._work(first + offset)
            elif what == "fail":
                self._fail(first + offset)

    @precondition(lambda self: self.claims)
    @rule(i=st.integers(min_value=0, max_value=50))
    def work(self, i: int) -> None:
        self._work(i)

    @precondition(lambda self: self.claims)
    @rule(i=st.integers(min_value=0, max_value=50), now=st.integers(min_value=0, max_value=2))
    def fail(self, i: int, now: int) -> None:
        if not now:
            self._fail(i)

    @rule(plan=st.lists(st.sampled_from(["work", "work", "work", "hold"]), max_size=8))
    def progress(self, plan: list[str]) -> None:
        """:meth:`claim_and_work` again, so that runs move on more often than they end."""
        self.claim_and_work(plan)

    def _current(self, run: MRun, key: str, claim: Any) -> bool:
        s = run.steps[key]
        return s.state == "running" and s.gen == claim.lease.lease_generation

    def _work(self, i: int) -> None:
        run, key, claim = self.claims[i % len(self.claims)]
        s = run.steps[key]
        if not self._current(run, key, claim):
            outcome = complete_step(claim.lease, {"late": True})
            assert not isinstance(outcome, Settled)
            return
        if s.kind == "function" and s.item is None:
            assert complete_step(claim.lease, {"k": key}) == Settled("succeeded")
            run.finish(s, "succeeded", output={"k": key})
            return
        outcome = executor.execute(claim)
        if s.item is not None:  # a map item: echo
            assert outcome == Settled("succeeded")
            run.finish(s, "succeeded", output={"x": s.item["value"]})
        elif s.kind == "sleep":
            if s.spec["seconds"] == 0:
                assert outcome == Settled("succeeded")
                run.finish(s, "succeeded", output=None)
            else:
                assert outcome == Settled("waiting")
                s.state = "waiting"
        elif s.kind == "wait_event":
            key_ = run.input["k"]
            if key_ in self.kept:
                assert outcome == Settled("succeeded")
                SEEN["event before the wait"] += 1
                run.finish(s, "succeeded", output=self.kept[key_])
            else:
                assert outcome == Settled("waiting")
                s.state = "waiting"
        elif s.expected is None:  # a map's first claim: expand
            items = run.input["items"]
            if not items:
                assert outcome == Settled("succeeded")
                run.finish(s, "succeeded", output=[])
                return
            assert outcome == Settled("pending")
            s.state, s.expected, s.deps_total, s.deps_done, s.attempts = "pending", len(items), len(items), 0, 0
            for n, item in enumerate(items):
                e = MStep(f"{key}[{n}]", "function", {}, [key], 0, "continue", 1, item={"value": item}, state="ready")
                run.steps[e.key] = e
            run.left += len(items)
        else:  # claimed again: collect
            items = [run.steps[f"{key}[{n}]"] for n in range(s.expected)]
            failed = sum(e.state != "succeeded" for e in items)
            if failed > s.spec["tolerate_failures"]:
                assert outcome == Settled("failed")
                run.finish(s, "failed", code="map_items_failed")
            else:
                assert outcome == Settled("succeeded")
                SEEN[f"map collected {len(items)}, {failed} failed"] += 1
                run.finish(s, "succeeded", output=[e.output if e.state == "succeeded" else None for e in items])

    def _fail(self, i: int) -> None:
        run, key, claim = self.claims[i % len(self.claims)]
        outcome = fail_step(claim.lease, "boom", retryable=False)
        if self._current(run, key, claim):
            assert outcome == Settled("failed")
            run.finish(run.steps[key], "failed", code="boom")
        else:
            assert not isinstance(outcome, Settled)

    # --- events -------------------------------------------------------------------------

    def _waiting_keys(self) -> list[str]:
        return sorted(
            {
                r.input["k"]
                for r in self.runs
                for s in r.steps.values()
                if s.kind == "wait_event" and s.state == "waiting"
            }
        )

    @precondition(lambda self: self._waiting_keys())
    @rule(i=st.integers(min_value=0, max_value=50), payload=st.sampled_from([None, {"p": "w"}]))
    def send_to_a_wait(self, i: int, payload: Any) -> None:
        keys = self._waiting_keys()
        self.send(keys[i % len(keys)], payload)

    @rule(key=st.sampled_from(KEYS), payload=st.sampled_from([None, 1, {"p": "x"}, ["y"]]), now=st.booleans())
    def send_any(self, key: str, payload: Any, now: bool) -> None:
        """An event for a key, whether anything waits for it or not (half as likely as others)."""
        if now:
            self.send(key, payload)

    def send(self, key: str, payload: Any) -> None:
        """An event: every step waiting for its key resumes with the payload; it is kept."""
        waiting = [
            (r, s)
            for r in self.runs
            for s in r.steps.values()
            if s.kind == "wait_event" and s.state == "waiting" and r.input["k"] == key and r.state == "running"
        ]
        sent = send_event(self.cid, "e", key, payload)
        assert sent.resumed == len(waiting)
        SEEN["event during the wait" if waiting else "event with no wait"] += 1
        for run, s in waiting:
            run.finish(s, "succeeded", output=payload)
        self.kept[key] = payload

    @precondition(lambda self: self.kept)
    @rule()
    def events_expire(self) -> None:
        """The keeping window of every sent event passes (back-dated)."""
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE buzz_workflows_sent_event SET expires_at = buzz_delivery_plus_seconds(sent_at, -1)"
                " WHERE community_id = %s AND sent_at IS NOT NULL",
                [self.cid],
            )
        self.kept.clear()
        SEEN["events expired"] += 1

    # --- time passes --------------------------------------------------------------------

    def _due(self, kind: str) -> list[tuple[MRun, MStep]]:
        return [
            (r, s)
            for r in self.runs
            for s in r.steps.values()
            if s.kind == kind
            and s.state == "waiting"
            and (kind == "sleep" or "wait_timeout_seconds" in s.spec)
            and r.state == "running"
        ]

    def _backdate(self, run: MRun, s: MStep) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE buzz_workflows_step SET wait_deadline = now() - interval '1 second',"
                " waiting_since = now() - interval '1 hour' WHERE community_id = %s AND run_id = %s AND key = %s",
                [self.cid, run.run_id, s.key],
            )

    def _pass(self, maintenance: bool) -> tuple[int, int]:
        if maintenance:
            result = reap_workflow_steps()
            return result.woken, result.wait_timed_out
        due = end_due_waits(self.cid)
        return due.woken, due.timed_out

    @precondition(lambda self: self._due("sleep"))
    @rule(i=st.integers(min_value=0, max_value=50), maintenance=st.booleans())
    def sleep_ends(self, i: int, maintenance: bool) -> None:
        due = self._due("sleep")
        run, s = due[i % len(due)]
        self._backdate(run, s)
        assert self._pass(maintenance) == (1, 0)
        run.finish(s, "succeeded", output=None)

    @precondition(lambda self: self._due("wait_event"))
    @rule(i=st.integers(min_value=0, max_value=50), maintenance=st.booleans(), late_event=st.booleans())
    def wait_times_out_now(self, i: int, maintenance: bool, late_event: bool) -> None:
        """:meth:`wait_times_out`, twice as likely."""
        self.wait_times_out(i, maintenance, late_event)

    @precondition(lambda self: self._due("wait_event"))
    @rule(i=st.integers(min_value=0, max_value=50), maintenance=st.booleans(), late_event=st.booleans())
    def wait_times_out(self, i: int, maintenance: bool, late_event: bool) -> None:
        due = self._due("wait_event")
        run, s = due[i % len(due)]
        self._backdate(run, s)
        assert self._pass(maintenance) == (0, 1)
        policy = s.spec["on_timeout"]
        SEEN[f"timeout {policy}"] += 1
        if policy == "fail":
            run.finish(s, "failed", code="wait_timeout")
        elif policy == "continue":
            run.finish(s, "succeeded", output=None)
        else:
            run.finish(s, "skipped")
        if late_event:  # the event after the timeout: kept, resumes what else waits for it
            SEEN["event after the timeout"] += 1
            self.send(run.input["k"], "late")

    @precondition(lambda self: any(r.state == "running" for r in self.runs))
    @rule(payload=st.sampled_from([None, {"p": "d"}]), timeouts=st.booleans(), maintenance=st.booleans())
    def drain(self, payload: Any, timeouts: bool, maintenance: bool) -> None:
        """Everything moves on until every run has ended, as the model predicts: held steps are
        worked, ready ones claimed and worked, sleeps wake, and waits get their events or, with
        ``timeouts``, time out (those that have a timeout)."""
        for _ in range(30):
            if all(r.state != "running" for r in self.runs):
                return
            for i, (run, key, claim) in enumerate(list(self.claims)):
                if self._current(run, key, claim):
                    self._work(i)
            self.claim_and_work(["work"] * 100)
            while timeouts and self._due("wait_event"):
                self.wait_times_out(0, maintenance, False)
            for key in self._waiting_keys():
                self.send(key, payload)
            for run, s in self._due("sleep"):
                self._backdate(run, s)
                assert self._pass(False) == (1, 0)
                run.finish(s, "succeeded", output=None)
        raise AssertionError("runs still running after the drain")

    # --- the database agrees ------------------------------------------------------------

    @invariant()
    def database_agrees_with_the_model(self) -> None:
        STATS["steps"] += 1
        runs = {r.run_id: r for r in Run.objects.filter(community_id=self.cid)}
        assert set(runs) == {r.run_id for r in self.runs}
        rows = {(s.run_id, s.key): s for s in Step.objects.filter(community_id=self.cid).defer("history")}
        assert set(rows) == {(r.run_id, k) for r in self.runs for k in r.steps}
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT step_id, count(*) FILTER (WHERE new_state = ANY(%(t)s)),"
                " count(*) FILTER (WHERE old_state = ANY(%(t)s)) FROM model_step_audit GROUP BY step_id",
                {"t": list(TERMINAL)},
            )
            audit = {row[0]: row[1:] for row in cursor.fetchall()}
        for run in self.runs:
            db_run = runs[run.run_id]
            assert (db_run.state, db_run.steps_left, db_run.output) == (run.state, run.left, run.output)
            open_steps = 0
            for key, s in run.steps.items():
                row = rows[(run.run_id, key)]
                got = (row.state, row.deps_done, row.deps_blocked, row.attempts, row.lease_generation, row.expected)
                assert got == (s.state, s.deps_done, s.deps_blocked, s.attempts, s.gen, s.expected), (key, got)
                assert row.output == s.output, key
                if s.state == "failed":
                    assert row.failure_code == s.failure_code, key
                assert audit.get(row.id, (0, 0)) == (int(s.state in TERMINAL), 0), key
                open_steps += s.state not in TERMINAL
            assert db_run.steps_left == open_steps


REACH = (
    "event before the wait",
    "event during the wait",
    "event with no wait",
    "sleep waiting->succeeded",
    "map over 0",
    "map over 1",
    "map over 3",
)


def missing_reach() -> list[str]:
    """What the examples so far have not reached (the test is worthless without it)."""
    missing = [reached for reached in REACH if not SEEN[reached]]
    if not sum(SEEN[f"timeout {p}"] for p in ("fail", "continue", "skip_dependents")):
        missing.append("a wait timed out")
    if not SEEN["cancel while waiting"] + SEEN["cancel while mapping"]:
        missing.append("a cancel while a step waited")
    if not SEEN["map collected 3, 0 failed"] + SEEN["map collected 3, 1 failed"]:
        missing.append("a map of 3 items collected")
    return missing


def _run(examples: int, steps: int, rounds: int = 3) -> None:
    """Run the machine; while what it must reach is not reached, run it again (at most
    ``rounds`` times: random examples reach the rarer paths most of the time, not always)."""
    STATS.update(examples=0, steps=0)
    SEEN.clear()
    started = time.monotonic()
    with connection.cursor() as cursor:
        for statement in AUDIT:
            cursor.execute(statement)
    for _ in range(rounds):
        run_machine(WaitsMachine, examples, steps)
        if not missing_reach():
            break
    print(
        f"\nengine model (waits): {STATS['examples']} examples, {STATS['steps']} checked states, "
        f"{time.monotonic() - started:.1f} s"
    )
    print(", ".join(f"{k}: {n}" for k, n in sorted(SEEN.items())))
    assert not missing_reach(), f"the examples never reached: {', '.join(missing_reach())}"


def test_the_engine_agrees_with_the_model_of_its_waits():
    _run(examples=60, steps=40)


@pytest.mark.slow
def test_the_engine_agrees_with_the_model_of_its_waits_long():
    _run(examples=400, steps=80)
