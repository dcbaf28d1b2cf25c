"""The engine agrees with a pure-Python model of SPEC section 11 on random DAGs of every step
kind: ``function``, ``send_message`` (deliveries claimed, finished, failed, crashed and
reclaimed or exhausted by the core reaper, expired past a TTL, force-failed and requeued by an
operator, all through the core services), ``approval`` (approved, rejected, expired past its
deadline), ``sub_workflow`` (a child run of a second random workflow), and ``when`` conditions
on the run input and on the outputs of each kind. Operations: step claims, completions and
failures (current and stale leases), crashes (step leases back-dated, then reclaimed or
exhausted by the maintenance), wait timeouts, cancels (root or child runs) and restarts.

After every operation the database must equal the model: every run's state, ``steps_left``,
output and delivery-expiry mark; every step's state, counters, generation, output, failure
code and child run; every delivery's status, attempt and generation; every approval's state.
Beyond the model: each step became terminal exactly once (an audit trigger counts every state
change; the step's own history has at most one terminal entry), ``steps_left`` equals the
non-terminal steps, a waiting ``send_message`` step's fan-in counters equal its terminal
deliveries in the core table, and a running child run has a parent step waiting for it.

It can fail: each of these local breaks was caught (the shallow ones in every run, the deep
ones in two runs of three or more): the fan-in trigger not counting ``expired`` as a failure,
or not taking a requeued delivery's count back; Advance ending the run under ``fail_run`` for
``function`` steps only; ``decide_approval`` not expiring the deliveries of the run it failed;
the maintenance not canceling a timed-out ``sub_workflow`` step's child run; the model not
blocking the dependents of a ``skip_dependents`` failure. The printed line counts what the
examples reached (each kind's transitions, decisions, run ends)."""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

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

from buzz_delivery import services as core
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.services import AlreadyTerminal, Cause, LeaseLost, Settled
from buzz_delivery.testing import CommunityFactory, WorkflowFactory, backdate
from buzz_delivery.workflows import executor
from buzz_delivery.workflows.models import Approval, Run, Step
from buzz_delivery.workflows.services import (
    AlreadyDecided,
    Canceled,
    Decided,
    Expired,
    cancel_run,
    claim_steps,
    complete_step,
    decide_approval,
    fail_step,
    publish_definition,
    restart_run,
    start_run,
)
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from tests.citus_mode import repetitions
from tests.citus_support import CITUS_MODE
from tests.conftest import backdate_lease
from tests.model_support import run_machine

pytestmark = pytest.mark.django_db
TERMINAL = ("succeeded", "failed", "skipped", "canceled")
D_TERMINAL = ("finished", "failed", "expired")
TARGETS = [bytes([n]) * 32 for n in (1, 2, 3, 4)]
MAX_RUNS = 8
STATS = {"examples": 0, "steps": 0}
SEEN: Counter[str] = Counter()  # what the examples reached (printed: the test must exercise every kind)
UNSET = object()

# Every state change of a step, recorded by a trigger the test installs (in its own
# transaction, rolled back with it): how often each step became terminal, or left a terminal
# state, whatever path moved it. SECURITY DEFINER: the services run as the tenant role.
# One statement per execute (Citus propagates DDL one statement at a time). On the cluster the
# audit table is distributed beside the steps, by community, so the trigger on a step's shard
# writes to the audit shard on the same node.
AUDIT = [
    "CREATE TABLE model_step_audit (community_id uuid NOT NULL, step_id uuid NOT NULL,"
    " old_state text NOT NULL, new_state text NOT NULL)",
    *(
        ["SELECT create_distributed_table('model_step_audit', 'community_id', colocate_with => 'buzz_workflows_step')"]
        if CITUS_MODE
        else []
    ),
    """CREATE FUNCTION model_step_audit() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    INSERT INTO model_step_audit VALUES (NEW.community_id, NEW.id, OLD.state, NEW.state);
    RETURN NULL;
END;
$$""",
    "CREATE TRIGGER model_step_audit AFTER UPDATE OF state ON buzz_workflows_step"
    " FOR EACH ROW WHEN (NEW.state IS DISTINCT FROM OLD.state) EXECUTE FUNCTION model_step_audit()",
]


def walk(value: Any, path: list[str]) -> Any:
    """``value #> path`` as jsonb does it (None for a missing element)."""
    for part in path:
        if isinstance(value, dict):
            value = value.get(part)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def json_equal(a: Any, b: Any) -> bool:
    """jsonb ``=``: no True == 1 as in Python."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@dataclass(eq=False)
class MDelivery:
    id: Any
    run: MRun
    key: str
    target: bytes
    gen: int
    max_attempts: int
    status: str = "pending"
    attempt: int = 0


@dataclass(eq=False)
class MApproval:
    id: Any
    run: MRun
    key: str
    gen: int
    state: str = "pending"
    decided_by: str | None = None


@dataclass(eq=False)
class MStep:
    spec: dict[str, Any]
    dependents: list[str]
    state: str = "pending"
    deps_done: int = 0
    deps_blocked: int = 0
    attempts: int = 0
    gen: int = 0
    output: Any = None
    failure_code: str | None = None
    expected: int | None = None
    dterm: int = 0
    dfail: int = 0
    child: MRun | None = None
    approval: MApproval | None = None

    @property
    def key(self) -> str:
        return self.spec["key"]

    @property
    def kind(self) -> str:
        return self.spec["kind"]

    @property
    def deps(self) -> list[str]:
        return self.spec["depends_on"]


@dataclass(eq=False)
class MRun:
    run_id: Any
    workflow: str  # "main" or "child"
    input: dict[str, Any]
    steps: dict[str, MStep]
    order: list[str]
    parent: tuple[MRun, str] | None = None
    state: str = "running"
    left: int = 0
    output: Any = None
    to_expire: bool = False
    children: list[MRun] = field(default_factory=list)
    deliveries: list[MDelivery] = field(default_factory=list)
    approvals: list[MApproval] = field(default_factory=list)

    def start(self) -> None:
        self.left = len(self.steps)
        for key in self.order:
            if not self.steps[key].deps:
                self.release(self.steps[key])

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
        left = self.left
        if self.state != "running" or state == "canceled":
            return
        if state == "failed" and s.spec["on_error"] == "fail_run":
            self.end("failed")
            return
        blocked = state == "skipped" or (state == "failed" and s.spec["on_error"] == "skip_dependents")
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
        if s.deps_blocked or ("when" in s.spec and not self.holds(s.spec["when"])):
            self.finish(s, "skipped")
        else:
            s.state = "ready"

    def holds(self, cond: dict[str, Any]) -> bool:
        ref = cond["ref"]
        value = walk(self.input, ref[1:]) if ref[0] == "input" else walk(self.steps[ref[1]].output, ref[3:])
        result = json_equal(value, cond["equals"]) if "equals" in cond else (value is not None) == cond["exists"]
        return not result if cond.get("not") else result

    def end(self, state: str) -> bool:
        """``buzz_workflows_end_run``: end the run once, cancel what is open, cascade to the
        child runs, and move the parent's waiting step."""
        if self.state != "running":
            return False
        if state != "succeeded":
            for s in self.steps.values():
                if s.state not in TERMINAL:
                    s.state = "canceled"
                    s.gen += 1
                    self.left -= 1
            for a in self.approvals:
                if a.state == "pending":
                    a.state = "expired"
        sinks = {k: s.output for k, s in self.steps.items() if not s.dependents and s.state == "succeeded"}
        self.output = sinks or None
        SEEN[f"{self.workflow} run {state}"] += 1
        self.state = state
        self.to_expire = state != "succeeded"
        if state != "succeeded":
            for child in self.children:
                child.end("canceled")
        if self.parent is not None:
            parent, key = self.parent
            ps = parent.steps[key]
            if ps.state == "waiting" and ps.child is self:
                if state == "succeeded":
                    parent.finish(ps, "succeeded", output=self.output or {})
                else:
                    parent.finish(ps, "failed", code=f"child_run_{state}")
        return True

    def tree(self) -> list[MRun]:
        out = [self]
        for child in self.children:
            out.extend(child.tree())
        return out


def expire_pending(run: MRun) -> int:
    """The core's ``expire_run_deliveries``: the run's pending deliveries -> expired (no
    generation bump: a pending delivery has no holder to fence)."""
    n = 0
    for d in run.deliveries:
        if d.status == "pending":
            d.status = "expired"
            n += 1
    return n


def expire_ended(runs: list[MRun]) -> None:
    """``expire_deliveries_of_ended_runs``: marked runs' trees expired, their marks cleared."""
    ended = [r for r in runs if r.to_expire]
    for r in ended:
        for t in r.tree():
            expire_pending(t)
    for r in ended:
        r.to_expire = False


def when_on(dep: dict[str, Any], child_sinks: list[str], draw: st.DrawFn) -> dict[str, Any]:
    key = dep["key"]
    kind = dep["kind"]
    if kind == "function":
        cond: dict[str, Any] = {"ref": f"steps.{key}.output.v", "equals": True}
    elif kind == "send_message":
        cond = {"ref": f"steps.{key}.output.failed", "equals": 0}
    elif kind == "approval":
        cond = {"ref": f"steps.{key}.output.decision", "equals": "approved"}
    else:
        cond = {"ref": f"steps.{key}.output.{draw(st.sampled_from(child_sinks))}", "exists": True}
    if draw(st.booleans()):
        cond["not"] = True
    return cond


@st.composite
def dags(
    draw: st.DrawFn, prefix: str, each: list[str], kinds: list[str], extra: int, child_sinks: list[str]
) -> list[dict]:
    """A random DAG with one step of each kind of ``each`` and up to ``extra`` more of
    ``kinds``, in random order."""
    chosen = draw(st.permutations(each + draw(st.lists(st.sampled_from(kinds), max_size=extra))))
    steps: list[dict[str, Any]] = []
    for i, kind in enumerate(chosen):
        earlier = [s["key"] for s in steps]
        deps = draw(st.lists(st.sampled_from(earlier), unique=True, max_size=2)) if earlier else []
        step: dict[str, Any] = {
            "key": f"{prefix}{i}",
            "kind": kind,
            "depends_on": deps,
            "on_error": draw(st.sampled_from(["fail_run", "continue", "skip_dependents"])),
            "retry": {"max_attempts": draw(st.integers(min_value=1, max_value=2)), "base_seconds": 0},
        }
        if kind == "function":
            step["function"] = "noop"
        elif kind == "send_message":
            chosen = draw(st.lists(st.sampled_from(range(len(TARGETS))), unique=True, min_size=1, max_size=3))
            step["targets"] = [TARGETS[t].hex() for t in chosen]
            step["content"] = step["key"]
            step["tolerate_failures"] = draw(st.integers(min_value=0, max_value=len(chosen)))
            if draw(st.booleans()):
                step["wait_timeout_seconds"] = 3600
        elif kind == "approval":
            step["deadline_seconds"] = 600
            step["prompt"] = "ok?"
        else:
            step["workflow"] = "CHILD"
            step["input"] = {"flag": {"$ref": "input.flag"}}
            if draw(st.booleans()):
                step["wait_timeout_seconds"] = 3600
        # Conditions are kept to about a third of the steps: a false one skips every descendant.
        choice = draw(st.sampled_from(["none", "none", "none", "none", "none", "flag", "dep", "dep"]))
        if choice == "flag":
            step["when"] = {"ref": "input.flag", "equals": draw(st.booleans())}
        elif choice == "dep" and deps:
            picked = draw(st.sampled_from(deps))
            dep = next(s for s in steps if s["key"] == picked)
            step["when"] = when_on(dep, child_sinks, draw)
        steps.append(step)
    return steps


@st.composite
def definitions(draw: st.DrawFn) -> tuple[list[dict], list[dict]]:
    child = draw(
        dags(
            "c", [draw(st.sampled_from(["send_message", "approval"]))], ["function", "send_message", "approval"], 2, []
        )
    )
    sinks = [s["key"] for s in child if not any(s["key"] in t["depends_on"] for t in child)]
    kinds = ["function", "send_message", "approval", "sub_workflow"]
    main = draw(dags("s", kinds, kinds, 2, sinks))
    return child, main


def normalized(definition: list[dict[str, Any]], child_workflow: Any) -> list[dict[str, Any]]:
    """The definition as the engine stores it: references as lists of parts."""
    out = []
    for s in definition:
        s = dict(s)
        if "when" in s:
            s["when"] = {**s["when"], "ref": s["when"]["ref"].split(".")}
        if s.get("workflow") == "CHILD":
            s["workflow"] = str(child_workflow)
        out.append(s)
    return out


class KindsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        STATS["examples"] += 1
        self._atomic = transaction.atomic()
        self._atomic.__enter__()
        self.community = CommunityFactory()
        self.cid = self.community.id
        self.workflows = {
            "main": WorkflowFactory(community=self.community),
            "child": WorkflowFactory(community=self.community),
        }
        self.definitions: dict[str, list[dict[str, Any]]] = {}
        self.runs: list[MRun] = []
        self.claims: list[tuple[MRun, str, Any]] = []  # (run, key, StepClaim)
        self.dleases: list[tuple[MDelivery, Any]] = []  # (delivery, core Lease)

    def teardown(self) -> None:
        transaction.set_rollback(True)
        self._atomic.__exit__(None, None, None)

    # --- the model's helpers ---------------------------------------------------------

    @property
    def deliveries(self) -> list[MDelivery]:
        return [d for r in self.runs for d in r.deliveries]

    @property
    def approvals(self) -> list[MApproval]:
        return [a for r in self.runs for a in r.approvals]

    def _model_run(self, run_id: Any, workflow: str, input: dict[str, Any], parent: Any = None) -> MRun:
        steps = {}
        definition = self.definitions[workflow]
        for s in definition:
            dependents = [t["key"] for t in definition if s["key"] in t["depends_on"]]
            steps[s["key"]] = MStep(s, dependents)
        return MRun(run_id, workflow, input, steps, [s["key"] for s in definition], parent=parent)

    def _delivery_terminal(self, d: MDelivery, old: str, new: str) -> None:
        """Move a delivery; the fan-in trigger counts it for its waiting step."""
        d.status = new
        if (old in D_TERMINAL) == (new in D_TERMINAL):
            return
        run, s = d.run, d.run.steps[d.key]
        if run.state != "running" or s.state != "waiting":
            return
        if new in D_TERMINAL:
            s.dterm += 1
            s.dfail += int(new != "finished")
        else:
            s.dterm -= 1
            s.dfail -= int(old != "finished")
            return
        if s.dterm >= s.expected:
            summary = {"delivered": s.expected - s.dfail, "failed": s.dfail}
            if s.dfail > s.spec["tolerate_failures"]:
                run.finish(s, "failed", output=summary, code="deliveries_failed")
            else:
                run.finish(s, "succeeded", output=summary)

    @staticmethod
    def _pick(candidates: list[MDelivery], i: int, live: bool) -> MDelivery:
        """One of ``candidates``; with ``live``, one whose step still waits on it if any does
        (the moves the fan-in counts)."""
        waiting = [d for d in candidates if d.run.state == "running" and d.run.steps[d.key].state == "waiting"]
        pool = waiting if live and waiting else candidates
        return pool[i % len(pool)]

    def _expire_left(self) -> None:
        """The maintenance's first pass: runs marked ``deliveries_to_expire``."""
        expire_ended([r for r in self.runs if r.to_expire])

    def _expected(self, run: MRun, key: str, lease: Any, *, still_fine: str | None = None) -> Any:
        s = run.steps[key]
        if s.state == "running" and s.gen == lease.lease_generation:
            return None  # the lease is current
        if s.gen == lease.lease_generation and s.state in TERMINAL:
            return AlreadyTerminal(s.state)
        if still_fine is not None and s.gen == lease.lease_generation and s.state == still_fine:
            return Settled(still_fine)
        return LeaseLost()

    # --- runs ------------------------------------------------------------------------

    @initialize(defs=definitions())
    def publish(self, defs: tuple[list[dict], list[dict]]) -> None:
        child, main = defs
        child_id = self.workflows["child"].id
        self.definitions = {"child": normalized(child, child_id), "main": normalized(main, child_id)}
        for name in ("child", "main"):
            publish_definition(self.cid, self.workflows[name].id, {"steps": self.definitions[name]})

    @precondition(lambda self: len(self.runs) < MAX_RUNS)
    @rule(flag=st.booleans())
    def start(self, flag: bool) -> None:
        run = start_run(self.cid, self.workflows["main"].id, {"flag": flag}, cause=Cause.event(os.urandom(32)))
        model = self._model_run(run.pk, "main", {"flag": flag})
        self.runs.append(model)
        model.start()

    @precondition(lambda self: self.runs)
    @rule(i=st.integers(min_value=0, max_value=50), now=st.integers(min_value=0, max_value=2))
    def cancel(self, i: int, now: int) -> None:
        if now:  # a third as likely as the other rules: a canceled run stops being interesting
            return
        run = self.runs[i % len(self.runs)]
        outcome = cancel_run(self.cid, run.run_id)
        if run.state != "running":
            assert outcome == AlreadyTerminal(run.state)
            return
        live = [r for r in run.tree() if r.state == "running"]
        run.end("canceled")
        expired = sum(expire_pending(r) for r in live)
        for r in live:
            r.to_expire = False
        assert outcome == Canceled(runs=len(live), deliveries=expired)

    @precondition(lambda self: any(r.state != "running" for r in self.runs) and len(self.runs) < MAX_RUNS)
    @rule(i=st.integers(min_value=0, max_value=50), from_failure=st.booleans())
    def restart(self, i: int, from_failure: bool) -> None:
        ended = [r for r in self.runs if r.state != "running"]
        old = ended[i % len(ended)]
        new = restart_run(self.cid, old.run_id, from_failure=from_failure)
        model = self._model_run(new.pk, old.workflow, old.input)
        self.runs.append(model)
        model.start()
        if from_failure:
            kept: set[str] = set()
            for key in old.order:  # definition order is topological here (deps come first)
                s = old.steps[key]
                if s.state == "succeeded" and all(d in kept for d in s.deps):
                    kept.add(key)
            for key in model.order:
                if key in kept and model.steps[key].state == "ready":
                    model.finish(model.steps[key], "succeeded", output=old.steps[key].output)

    # --- steps -----------------------------------------------------------------------

    def claim_all(self, plan: list[str], v: bool) -> None:
        """Claim every ready step; the holders of the first few then work or fail at once
        (the rest hold their leases for the rules below)."""
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
                self._work(first + offset, v)
            elif what == "fail":
                self._fail(first + offset, True)

    PROGRESS = {
        "steps": st.lists(st.sampled_from(["work", "work", "work", "fail", "hold"]), max_size=6),
        "agents": st.lists(
            st.sampled_from(["finished", "finished", "failed", "hold", "skip", "expire", "force_fail"]), max_size=6
        ),
        "decisions": st.lists(st.sampled_from(["approved", "approved", "rejected", "hold"]), min_size=1, max_size=3),
        "requeue": st.booleans(),
        "timeout": st.integers(min_value=0, max_value=3),
        "v": st.booleans(),
    }

    @rule(**PROGRESS)
    def progress_again(self, **kwargs: Any) -> None:
        """:meth:`progress` twice over, so plain progress is the likeliest rule."""
        self.progress(**kwargs)

    @rule(**PROGRESS)
    def progress(
        self, steps: list[str], agents: list[str], decisions: list[str], requeue: bool, timeout: int, v: bool
    ) -> None:
        """Everyone does some work at once: the orchestrator (claims and runs steps), agents
        (claim and settle deliveries), operators (requeue a failed delivery a step waits on,
        decide pending approvals), and now and then a sub_workflow step's wait times out while
        its child still runs."""
        self.claim_all(steps, v)
        if any(d.status == "pending" for d in self.deliveries):
            self.agents(agents)
        if requeue and any(d.status in ("failed", "expired") for d in self.deliveries):
            self.requeue_delivery(0, True)
        pending = [a for a in self.approvals if a.state == "pending"]
        for a, what in zip(pending, decisions, strict=False):
            if what != "hold":
                self._decide(a, what == "approved", "carol")
        live = [
            s
            for r in self.runs
            for s in r.steps.values()
            if s.state == "waiting" and "wait_timeout_seconds" in s.spec and s.child and s.child.state == "running"
        ]
        if timeout == 0 and live:
            self.wait_times_out(0, True)

    @precondition(lambda self: any(r.state == "running" for r in self.runs))
    @rule(v=st.booleans(), approve=st.booleans())
    def drain(self, v: bool, approve: bool) -> None:
        """Everyone finishes: held steps are worked, ready ones claimed and worked, held and
        pending deliveries finished, pending approvals decided, until every run has ended, in
        the state the model predicts (the invariant checks it after this rule)."""
        for _ in range(50):
            if all(r.state != "running" for r in self.runs):
                return
            for i, (run, key, claim) in enumerate(list(self.claims)):
                s = run.steps[key]
                if s.state == "running" and s.gen == claim.lease.lease_generation:
                    self._work(i, v)
            for i, (d, lease) in enumerate(list(self.dleases)):
                if d.status == "claimed" and d.gen == lease.lease_generation:
                    self._finish_delivery(i, "finished")
            self.progress(
                ["work"] * 100, ["finished"] * 100, ["approved" if approve else "rejected"] * 100, False, 1, v
            )
        raise AssertionError(
            "runs still running after the drain: "
            + ", ".join(
                f"{r.workflow} {r.run_id}: { ({k: s.state for k, s in r.steps.items()}) }"
                for r in self.runs
                if r.state == "running"
            )
        )

    @precondition(lambda self: self.claims)
    @rule(i=st.integers(min_value=0, max_value=50), v=st.booleans())
    def work(self, i: int, v: bool) -> None:
        self._work(i, v)

    def _work(self, i: int, v: bool) -> None:
        """The holder does the step's work: a function completes with ``{"k", "v"}``; the other
        kinds run through the orchestrator's executor (deliveries committed, a child run
        started, an approval requested; the step parked ``waiting``)."""
        run, key, claim = self.claims[i % len(self.claims)]
        s = run.steps[key]
        if s.kind == "function":
            expected = self._expected(run, key, claim.lease)
            outcome = complete_step(claim.lease, {"k": key, "v": v})
            if expected is None:
                expected = Settled("succeeded")
                run.finish(s, "succeeded", output={"k": key, "v": v})
            assert outcome == expected
            return
        expected = self._expected(run, key, claim.lease, still_fine="waiting")
        before = WorkflowAgentDelivery.objects.filter(community_id=self.cid, run_id=run.run_id).count()
        outcome = executor.execute(claim)
        if expected is not None:  # stale, or the holder's repeat: nothing new
            assert outcome == expected
            assert WorkflowAgentDelivery.objects.filter(community_id=self.cid, run_id=run.run_id).count() == before
            return
        assert outcome == Settled("waiting")
        s.state = "waiting"
        if s.kind == "send_message":
            s.expected = len(s.spec["targets"])
            rows = WorkflowAgentDelivery.objects.filter(community_id=self.cid, run_id=run.run_id, step_id=key)
            assert sorted(bytes(d.target_pubkey).hex() for d in rows) == sorted(s.spec["targets"])
            for d in rows:
                assert (d.status, d.attempt) == ("pending", 0)
                run.deliveries.append(
                    MDelivery(d.id, run, key, bytes(d.target_pubkey), d.lease_generation, d.max_attempts)
                )
        elif s.kind == "approval":
            a = Approval.objects.get(community_id=self.cid, step_id=claim.lease.step_id)
            assert (a.state, a.step_generation) == ("pending", s.gen)
            s.approval = MApproval(a.id, run, key, s.gen)
            run.approvals.append(s.approval)
        else:
            child_id = Step.objects.get(community_id=self.cid, id=claim.lease.step_id).child_run_id
            child = self._model_run(child_id, "child", {"flag": run.input["flag"]}, parent=(run, key))
            s.child = child
            run.children.append(child)
            self.runs.append(child)
            child.start()

    @precondition(lambda self: self.claims)
    @rule(i=st.integers(min_value=0, max_value=50), retryable=st.booleans())
    def fail(self, i: int, retryable: bool) -> None:
        self._fail(i, retryable)

    def _fail(self, i: int, retryable: bool) -> None:
        run, key, claim = self.claims[i % len(self.claims)]
        s = run.steps[key]
        lease = claim.lease
        retry_path = retryable and lease.attempts < s.spec["retry"]["max_attempts"]
        expected = self._expected(run, key, lease, still_fine="ready" if retry_path else None)
        outcome = fail_step(lease, "boom", retryable=retryable)
        if expected is None:
            if retry_path:
                s.state = "ready"
                expected = Settled("ready")
            else:
                expected = Settled("failed")
                run.finish(s, "failed", code="attempts_exhausted" if retryable else "boom")
                expire_ended([run])
        assert outcome == expected

    @precondition(lambda self: self.claims)
    @rule(i=st.integers(min_value=0, max_value=50))
    def crash(self, i: int) -> None:
        """The holder dies: its lease lapses and the maintenance reclaims (or exhausts) it."""
        run, key, claim = self.claims[i % len(self.claims)]
        lease = claim.lease
        s = run.steps[key]
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE buzz_workflows_step SET lease_until = now() - interval '1 hour',"
                " claimed_at = now() - interval '2 hours' WHERE community_id = %s AND id = %s AND state = 'running'"
                " AND lease_generation = %s",
                [lease.community_id, lease.step_id, lease.lease_generation],
            )
        result = reap_workflow_steps()
        self._expire_left()
        if s.state == "running" and s.gen == lease.lease_generation:
            s.gen += 1
            if s.attempts < s.spec["retry"]["max_attempts"]:
                s.state = "ready"
                assert (result.reclaimed, result.exhausted) == (1, 0)
            else:
                assert (result.reclaimed, result.exhausted) == (0, 1)
                run.finish(s, "failed", code="attempts_exhausted")
                expire_ended([run])
        else:
            assert result.total == 0

    @precondition(
        lambda self: any(
            s.state == "waiting" and "wait_timeout_seconds" in s.spec for r in self.runs for s in r.steps.values()
        )
    )
    @rule(i=st.integers(min_value=0, max_value=50), live=st.booleans())
    def wait_times_out(self, i: int, live: bool) -> None:
        """A send_message or sub_workflow step waits past its ``wait_timeout_seconds``
        (back-dated); with ``live``, preferably a sub_workflow step whose child still runs."""
        waiting = [
            (r, s)
            for r in self.runs
            for s in r.steps.values()
            if s.state == "waiting" and "wait_timeout_seconds" in s.spec
        ]
        children = [(r, s) for r, s in waiting if s.child is not None and s.child.state == "running"]
        pool = children if live and children else waiting
        run, s = pool[i % len(pool)]
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE buzz_workflows_step SET wait_deadline = now() - interval '1 second',"
                " waiting_since = now() - interval '1 hour' WHERE community_id = %s AND run_id = %s AND key = %s",
                [self.cid, run.run_id, s.key],
            )
        result = reap_workflow_steps()
        self._expire_left()
        assert result.wait_timed_out == 1
        child = s.child
        run.finish(s, "failed", code="wait_timeout")
        if child is not None and child.end("canceled"):  # the parent gave up waiting for it
            SEEN["child canceled by its parent's wait timeout"] += 1
        expire_ended([run, *([child] if child else [])])

    @rule()
    def maintain(self) -> None:
        """A maintenance pass with nothing due: it expires what runs ended in a trigger left."""
        result = reap_workflow_steps()
        self._expire_left()
        assert result.total == 0

    # --- deliveries (core services) ----------------------------------------------------

    @precondition(lambda self: any(d.status == "pending" for d in self.deliveries))
    @rule(i=st.integers(min_value=0, max_value=50))
    def claim_delivery(self, i: int) -> None:
        pending = [d for d in self.deliveries if d.status == "pending"]
        self._claim_delivery(pending[i % len(pending)])

    def _claim_delivery(self, d: MDelivery) -> None:
        claim = core.claim_delivery(self.cid, d.target, delivery_id=d.id, lease_seconds=120)
        assert claim is not None
        d.status, d.attempt, d.gen = "claimed", d.attempt + 1, d.gen + 1
        assert claim.lease.lease_generation == d.gen
        self.dleases.append((d, claim.lease))

    def agents(self, plan: list[str]) -> None:
        """Agents claim pending deliveries (oldest first) and finish or fail them at once, or
        hold their leases; "skip" leaves one pending, "expire" lets its TTL pass, "force_fail":
        an operator fails the claimed delivery."""
        pending = [d for d in self.deliveries if d.status == "pending"]
        for d, what in zip(pending, plan, strict=False):
            if what == "skip" or d.status != "pending":
                continue
            if what == "expire":
                self._expire_delivery(d)
                continue
            self._claim_delivery(d)
            if what == "force_fail":
                self._force_fail_delivery(d)
            elif what != "hold":
                self._finish_delivery(len(self.dleases) - 1, what)

    @precondition(lambda self: self.dleases)
    @rule(i=st.integers(min_value=0, max_value=50), outcome=st.sampled_from(["finished", "finished", "failed"]))
    def finish_delivery(self, i: int, outcome: str) -> None:
        self._finish_delivery(i, outcome)

    def _finish_delivery(self, i: int, outcome: str) -> None:
        d, lease = self.dleases[i % len(self.dleases)]
        got = core.finish_delivery(lease, outcome)
        if d.status == "claimed" and d.gen == lease.lease_generation:
            assert got == Settled(outcome)
            self._delivery_terminal(d, "claimed", outcome)
        elif d.gen == lease.lease_generation and d.status in D_TERMINAL:
            assert got == AlreadyTerminal(d.status)
        else:
            assert got == LeaseLost()

    @precondition(lambda self: any(d.status == "claimed" for d in self.deliveries))
    @rule(i=st.integers(min_value=0, max_value=50), live=st.booleans())
    def crash_delivery(self, i: int, live: bool) -> None:
        """The agent dies: the core reaper reclaims the delivery, or exhausts its last attempt."""
        claimed = [d for d in self.deliveries if d.status == "claimed"]
        d = self._pick(claimed, i, live)
        backdate_lease(d.id)
        assert core.reap_expired_deliveries() == 1
        d.gen += 1
        if d.attempt >= d.max_attempts:
            self._delivery_terminal(d, "claimed", "failed")
        else:
            self._delivery_terminal(d, "claimed", "pending")

    @precondition(lambda self: any(d.status == "pending" for d in self.deliveries))
    @rule(i=st.integers(min_value=0, max_value=50), live=st.booleans())
    def expire_delivery(self, i: int, live: bool) -> None:
        """A pending delivery's TTL passes (back-dated) and the core reaper expires it."""
        self._expire_delivery(self._pick([d for d in self.deliveries if d.status == "pending"], i, live))

    def _expire_delivery(self, d: MDelivery) -> None:
        backdate((self.cid, d.id), expires_at=1)
        assert core.reap_expired_deliveries() == 1
        d.gen += 1
        self._delivery_terminal(d, "pending", "expired")

    @precondition(lambda self: any(d.status == "claimed" for d in self.deliveries))
    @rule(i=st.integers(min_value=0, max_value=50), live=st.booleans())
    def force_fail_delivery(self, i: int, live: bool) -> None:
        self._force_fail_delivery(self._pick([d for d in self.deliveries if d.status == "claimed"], i, live))

    def _force_fail_delivery(self, d: MDelivery) -> None:
        assert core.force_fail_delivery(self.cid, d.id).done
        d.gen += 1
        self._delivery_terminal(d, "claimed", "failed")

    @precondition(lambda self: any(d.status in ("failed", "expired") for d in self.deliveries))
    @rule(i=st.integers(min_value=0, max_value=50), live=st.booleans())
    def requeue_delivery(self, i: int, live: bool) -> None:
        failed = [d for d in self.deliveries if d.status in ("failed", "expired")]
        d = self._pick(failed, i, live)
        assert core.requeue_delivery(self.cid, d.id).done
        d.gen, d.attempt = d.gen + 1, 0
        self._delivery_terminal(d, d.status, "pending")

    # --- approvals -------------------------------------------------------------------

    @precondition(lambda self: self.approvals)
    @rule(i=st.integers(min_value=0, max_value=50), approve=st.booleans(), who=st.sampled_from(["alice", "bob"]))
    def decide(self, i: int, approve: bool, who: str) -> None:
        self._decide(self.approvals[i % len(self.approvals)], approve, who)

    def _decide(self, a: MApproval, approve: bool, who: str) -> None:
        decision = "approved" if approve else "rejected"
        outcome = decide_approval(self.cid, a.id, decision, who)
        SEEN[f"decide {a.state} {decision}"] += 1
        if a.state == "pending":
            assert isinstance(outcome, Decided) and (outcome.state, outcome.decided_by) == (decision, who)
            a.state, a.decided_by = decision, who
            run, s = a.run, a.run.steps[a.key]
            assert s.state == "waiting" and s.gen == a.gen
            output = {"decision": decision, "decided_by": who}
            if approve:
                run.finish(s, "succeeded", output=output)
            else:
                run.finish(s, "failed", output=output, code="approval_rejected")
            expire_ended([run])
        elif a.state in ("approved", "rejected"):
            assert isinstance(outcome, AlreadyDecided) and (outcome.state, outcome.decided_by) == (
                a.state,
                a.decided_by,
            )
        else:
            assert isinstance(outcome, Expired)

    @precondition(lambda self: any(a.state == "pending" for a in self.approvals))
    @rule(i=st.integers(min_value=0, max_value=50))
    def approval_expires(self, i: int) -> None:
        """The approval's deadline passes (back-dated, with its step's wait) and the maintenance
        expires it: the step fails ``approval_expired``."""
        pending = [a for a in self.approvals if a.state == "pending"]
        a = pending[i % len(pending)]
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE buzz_workflows_approval SET requested_at = buzz_delivery_plus_seconds(requested_at, -3600),"
                " deadline_at = buzz_delivery_plus_seconds(requested_at, -3599)"
                " WHERE community_id = %s AND id = %s",
                [self.cid, a.id],
            )
            cursor.execute(
                "UPDATE buzz_workflows_step SET wait_deadline = now() - interval '1 second',"
                " waiting_since = now() - interval '1 hour' WHERE community_id = %s AND run_id = %s AND key = %s",
                [self.cid, a.run.run_id, a.key],
            )
        result = reap_workflow_steps()
        self._expire_left()
        assert (result.approvals_expired, result.wait_timed_out) == (1, 0)
        a.state = "expired"
        run, s = a.run, a.run.steps[a.key]
        run.finish(s, "failed", code="approval_expired")
        expire_ended([run])

    # --- the database agrees ---------------------------------------------------------

    @invariant()
    def database_agrees_with_the_model(self) -> None:
        if not self.definitions:
            return
        STATS["steps"] += 1
        runs = {r.run_id: r for r in Run.objects.filter(community_id=self.cid)}
        assert set(runs) == {r.run_id for r in self.runs}
        steps: dict[tuple[Any, str], Step] = {
            (s.run_id, s.key): s for s in Step.objects.filter(community_id=self.cid).defer("history")
        }
        deliveries = {
            d.id: d
            for d in WorkflowAgentDelivery.objects.filter(community_id=self.cid).only(
                "id", "run_id", "step_id", "status", "attempt", "lease_generation"
            )
        }
        assert set(deliveries) == {d.id for d in self.deliveries}
        approvals = {a.id: a for a in Approval.objects.filter(community_id=self.cid)}
        assert set(approvals) == {a.id for a in self.approvals}
        with connection.cursor() as cursor:
            # Per step: how often it became terminal and left a terminal state (the audit
            # trigger), and how many entries of its own history are terminal.
            cursor.execute(
                "SELECT s.id, coalesce(a.became, 0), coalesce(a.left_, 0),"
                " (SELECT count(*) FROM jsonb_array_elements(s.history) e WHERE e->>'status' = ANY(%(t)s))"
                " FROM buzz_workflows_step s LEFT JOIN ("
                "   SELECT step_id, count(*) FILTER (WHERE new_state = ANY(%(t)s)) AS became,"
                "   count(*) FILTER (WHERE old_state = ANY(%(t)s)) AS left_ FROM model_step_audit GROUP BY step_id"
                " ) a ON a.step_id = s.id WHERE s.community_id = %(c)s",
                {"t": list(TERMINAL), "c": self.cid},
            )
            audit = {row[0]: row[1:] for row in cursor.fetchall()}
        for run in self.runs:
            db_run = runs[run.run_id]
            assert (db_run.state, db_run.steps_left, db_run.deliveries_to_expire) == (
                run.state,
                run.left,
                run.to_expire,
            ), run.run_id
            assert db_run.output == run.output
            parent = run.parent
            assert (db_run.parent_run_id, db_run.parent_step_key) == (
                (parent[0].run_id, parent[1]) if parent else (None, None)
            )
            if db_run.parent_run_id is not None and db_run.state == "running":
                # No orphan: a running child run has a parent step still waiting for it.
                waiting_for = steps[(db_run.parent_run_id, db_run.parent_step_key)]
                assert (waiting_for.state, waiting_for.child_run_id) == ("waiting", run.run_id)
            open_steps = 0
            for key, s in run.steps.items():
                row = steps[(run.run_id, key)]
                got = (row.state, row.deps_done, row.deps_blocked, row.attempts, row.lease_generation)
                assert got == (s.state, s.deps_done, s.deps_blocked, s.attempts, s.gen), (key, got)
                assert (row.expected, row.delivered_terminal, row.delivered_failed) == (s.expected, s.dterm, s.dfail)
                assert row.output == s.output, key
                assert row.child_run_id == (s.child.run_id if s.child else None), key
                if s.state == "failed":
                    assert row.failure_code == s.failure_code, key
                # Terminal exactly once, whatever path moved it, and never left again.
                became, left, in_history = audit[row.id]
                assert (became, left) == (int(s.state in TERMINAL), 0), key
                assert in_history <= 1, key
                open_steps += s.state not in TERMINAL
                if s.kind == "send_message" and s.state == "waiting":
                    # No fan-in lost or doubled: the counters are the terminal deliveries.
                    mine = [d for d in deliveries.values() if d.run_id == run.run_id and d.step_id == key]
                    assert row.delivered_terminal == sum(d.status in D_TERMINAL for d in mine)
                    assert row.delivered_failed == sum(d.status in ("failed", "expired") for d in mine)
                if run.state != "running":
                    assert s.state in TERMINAL, key
            assert db_run.steps_left == open_steps
        for d in self.deliveries:
            row = deliveries[d.id]
            assert (row.status, row.attempt, row.lease_generation) == (d.status, d.attempt, d.gen), d.id
        for a in self.approvals:
            assert (approvals[a.id].state, approvals[a.id].decided_by) == (a.state, a.decided_by)


def _run(examples: int, steps: int) -> None:
    STATS.update(examples=0, steps=0)
    SEEN.clear()
    started = time.monotonic()
    with connection.cursor() as cursor:
        for statement in AUDIT:
            cursor.execute(statement)
    run_machine(KindsMachine, examples, steps)
    print(
        f"\nengine model (every kind): {STATS['examples']} examples, {STATS['steps']} checked states, "
        f"{time.monotonic() - started:.1f} s"
    )
    print(", ".join(f"{k}: {n}" for k, n in sorted(SEEN.items())))


def test_the_engine_agrees_with_the_model_on_every_step_kind():
    _run(examples=repetitions("tests/test_wf_model_based_kinds.py", full=60, on_cluster=20), steps=40)


@pytest.mark.slow
def test_the_engine_agrees_with_the_model_on_every_step_kind_long():
    _run(examples=500, steps=80)
