"""Batched step completion and the claim that follows it (SPEC section 11, issue 12):
``complete_steps`` and ``complete_and_claim_steps``, each row fenced by its own lease, Advance
per row in the same statement, the successors claimed in the same transaction."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.core.exceptions import ValidationError
from django.db import connection, connections

from buzz_delivery.listening import Listener
from buzz_delivery.services import AlreadyTerminal, LeaseLost, Settled
from buzz_delivery.testing import CommunityFactory, WorkflowFactory, advance_to
from buzz_delivery.workflows.conf import NOTIFY_CHANNEL
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.services import (
    cancel_run,
    claim_steps,
    complete_and_claim_steps,
    complete_step,
    complete_steps,
)
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from buzz_delivery.workflows.testing import diamond, function_step
from project.database_url import database_url
from tests.conftest import BARRIER_TIMEOUT
from tests.wf_support import backdate_step_lease, run_state, start, states


@pytest.fixture
def workflow(community):
    return WorkflowFactory(community=community)


def claim_all(community_id, n: int = 100, **kwargs):
    return claim_steps(community_id, limit=n, lease_seconds=kwargs.pop("lease_seconds", 30), **kwargs)


def step_rows(community_id) -> list[tuple]:
    return list(
        Step.objects.filter(community_id=community_id)
        .order_by("id")
        .values_list("id", "state", "lease_generation", "output", "deps_done")
    )


@pytest.mark.django_db
def test_one_batch_completes_both_branches_of_a_diamond_and_releases_the_join_once(workflow):
    runs = [start(workflow, diamond()) for _ in range(3)]
    first = claim_all(workflow.community_id)
    assert complete_steps(workflow.community_id, [(c.lease, {"n": 1}) for c in first]) == [Settled("succeeded")] * 3
    branches = claim_all(workflow.community_id)
    assert sorted(c.step.key for c in branches) == ["step2"] * 3 + ["step3"] * 3
    # Both branches of every run in one statement: the join's counter sees both, once each.
    outcomes = complete_steps(workflow.community_id, [(c.lease, {"k": c.step.key}) for c in reversed(branches)])
    assert outcomes == [Settled("succeeded")] * 6
    for run in runs:
        assert states(run) == {"step1": "succeeded", "step2": "succeeded", "step3": "succeeded", "step4": "ready"}
        assert Step.objects.get(run_id=run.pk, key="step4").deps_done == 2
        assert Run.objects.get(pk=run.pk).steps_left == 1
    joins = claim_all(workflow.community_id)
    assert complete_steps(workflow.community_id, [(c.lease, None) for c in joins]) == [Settled("succeeded")] * 3
    assert [run_state(run) for run in runs] == ["succeeded"] * 3
    assert Step.objects.get(run_id=runs[0].pk, key="step2").output == {"k": "step2"}


@pytest.mark.django_db
def test_the_stale_holder_matrix_inside_one_batch(workflow):
    """In one batch: a reclaimed step's old lease gets LeaseLost, the true holder's repeat
    AlreadyTerminal, an expired (not yet reclaimed) lease LeaseLost, the current one Settled."""
    for _ in range(4):
        start(workflow, {"steps": [function_step("a", retry={"max_attempts": 3})]})
    reclaimed, done, expired, current = claim_all(workflow.community_id)
    backdate_step_lease(reclaimed.lease.step_id)
    assert reap_workflow_steps().reclaimed == 1
    [again] = claim_all(workflow.community_id)
    assert complete_step(done.lease, {"first": True}) == Settled("succeeded")
    backdate_step_lease(expired.lease.step_id)
    outcomes = complete_steps(
        workflow.community_id,
        [(reclaimed.lease, {}), (done.lease, {"second": True}), (expired.lease, {}), (current.lease, {"ok": 1})],
    )
    assert outcomes == [LeaseLost(), AlreadyTerminal("succeeded"), LeaseLost(), Settled("succeeded")]
    assert Step.objects.get(id=done.lease.step_id).output == {"first": True}
    assert Step.objects.get(id=again.lease.step_id).state == "running"
    assert Step.objects.get(id=expired.lease.step_id).state == "running"
    assert complete_steps(workflow.community_id, [(again.lease, 1)]) == [Settled("succeeded")]


@pytest.mark.django_db
def test_an_output_that_is_not_json_fails_its_step_and_not_the_batch(workflow):
    for _ in range(3):
        start(workflow, {"steps": [function_step("a", retry={"max_attempts": 3})]})
    a, b, c = claim_all(workflow.community_id)
    outcomes = complete_steps(workflow.community_id, [(a.lease, 1), (b.lease, object()), (c.lease, "x" * 400_000)])
    assert outcomes == [Settled("succeeded"), Settled("failed"), Settled("failed")]
    failed = dict(Step.objects.filter(id__in=[b.lease.step_id, c.lease.step_id]).values_list("id", "failure_code"))
    assert failed == {b.lease.step_id: "output_not_json", c.lease.step_id: "output_too_large"}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ("other_community", "completions[1]"),
        ("same_step_twice", "completions[1]"),
        ("not_a_pair", "completions[1]"),
        ("not_a_lease", "lease"),
        ("claim_limit", "claim_limit"),
        ("holder", "holder"),
        ("community_id", "community_id"),
    ],
)
def test_bad_input_names_the_field_and_writes_nothing(workflow, bad, field):
    other = WorkflowFactory(community=CommunityFactory())
    start(workflow, diamond())
    start(workflow, diamond())
    start(other, diamond())
    [x, y] = claim_all(workflow.community_id)
    [z] = claim_all(other.community_id)
    pairs = {
        "other_community": [(x.lease, 1), (z.lease, 1)],
        "same_step_twice": [(x.lease, 1), (x.lease, 2)],
        "not_a_pair": [(x.lease, 1), (y.lease,)],
        "not_a_lease": [(x.lease, 1), ("lease", 1)],
    }.get(bad, [(x.lease, 1), (y.lease, 1)])
    kwargs = {"claim_limit": {"claim_limit": 1001}, "holder": {"holder": "h" * 201}}.get(bad, {})
    community = "not-a-uuid" if bad == "community_id" else workflow.community_id
    before = step_rows(workflow.community_id), step_rows(other.community_id)
    with pytest.raises(ValidationError) as exc:
        complete_and_claim_steps(community, pairs, **kwargs)
    assert field in exc.value.message_dict
    assert (step_rows(workflow.community_id), step_rows(other.community_id)) == before


@pytest.mark.django_db
def test_a_fenced_community_completes_nothing(workflow):
    start(workflow, diamond())
    [claim] = claim_all(workflow.community_id)
    advance_to(workflow.community, "fenced")
    before = step_rows(workflow.community_id)
    batch = complete_and_claim_steps(workflow.community_id, [(claim.lease, 1)], claim_limit=10)
    assert (batch.outcomes, batch.claims) == ([LeaseLost()], [])
    assert step_rows(workflow.community_id) == before


@pytest.mark.django_db
def test_the_released_successors_are_claimed_in_the_completing_transaction(workflow):
    run = start(workflow, diamond())
    [first] = claim_all(workflow.community_id)
    batch = complete_and_claim_steps(
        workflow.community_id, [(first.lease, {})], claim_limit=1, lease_seconds=30, holder="h:1:orch"
    )
    assert batch.outcomes == [Settled("succeeded")]
    assert len(batch.claims) == 1 and batch.claims[0].step.key in ("step2", "step3")
    claimed = Step.objects.get(id=batch.claims[0].lease.step_id)
    assert (claimed.state, claimed.claimed_by, claimed.lease_generation) == ("running", "h:1:orch", 1)
    assert claimed.history[-1]["event"] == "claim"
    # The limit held: the other branch is still ready for anyone.
    assert sorted(states(run).values()) == ["pending", "ready", "running", "succeeded"]
    batch = complete_and_claim_steps(workflow.community_id, [(batch.claims[0].lease, {})], claim_limit=5)
    assert [c.step.key for c in batch.claims] == [k for k in ("step2", "step3") if states(run)[k] == "running"]
    batch = complete_and_claim_steps(workflow.community_id, [(batch.claims[0].lease, {})], claim_limit=5)
    assert [c.step.key for c in batch.claims] == ["step4"]
    batch = complete_and_claim_steps(workflow.community_id, [(batch.claims[0].lease, {})], claim_limit=5)
    assert (batch.outcomes, batch.claims, run_state(run)) == ([Settled("succeeded")], [], "succeeded")


class _Heard:
    """The payloads on the engine's channel, heard as the orchestrator hears them: through the
    shared listener, which on Citus LISTENs on every node too (the release trigger runs on the
    run's shard and sends its NOTIFY there)."""

    def __init__(self) -> None:
        self.payloads: list[str] = []
        listening, self.stop = threading.Event(), threading.Event()
        self.thread = Listener(
            name="test-release-notifies",
            channels=(NOTIFY_CHANNEL,),
            conn_params=connection.get_connection_params(),
            stop=self.stop,
            on_notify=lambda channel, payload: self.payloads.append(payload),
            on_listen=listening.set,
        )
        self.thread.start()
        assert listening.wait(BARRIER_TIMEOUT)

    def take(self, expected: int) -> list[str]:
        """The payloads heard since the last take: waits (bounded) for ``expected`` of them and a
        little longer for any more, or one second when none is expected."""
        deadline = time.monotonic() + (BARRIER_TIMEOUT if expected else 1.0)
        while len(self.payloads) < max(expected, 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        if expected:
            time.sleep(0.5)
        heard, self.payloads[:] = list(self.payloads), []
        return heard

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


@pytest.mark.django_db(transaction=True)
def test_a_completer_that_claims_every_released_step_wakes_nobody_else(workflow):
    start(workflow, diamond())
    [first] = claim_all(workflow.community_id)
    listener = _Heard()
    try:
        batch = complete_and_claim_steps(workflow.community_id, [(first.lease, {})], claim_limit=2)
        assert len(batch.claims) == 2
        assert listener.take(0) == []
        # Without a claim the releases NOTIFY as before.
        outcomes = complete_steps(workflow.community_id, [(c.lease, {}) for c in batch.claims])
        assert outcomes == [Settled("succeeded")] * 2
        assert listener.take(1) == [str(workflow.community_id)]
    finally:
        listener.close()


@pytest.mark.django_db(transaction=True)
def test_a_completer_that_leaves_ready_steps_wakes_the_others(workflow):
    start(workflow, diamond())
    [first] = claim_all(workflow.community_id)
    listener = _Heard()
    try:
        batch = complete_and_claim_steps(workflow.community_id, [(first.lease, {})], claim_limit=1)
        assert len(batch.claims) == 1
        assert listener.take(1) == [str(workflow.community_id)]
    finally:
        listener.close()


@pytest.mark.django_db(transaction=True)
def test_batches_in_opposite_orders_and_cancels_at_once_neither_deadlock_nor_double_advance(workflow):
    """Two threads complete the two branches of 30 diamonds (one in run order, one reversed)
    while a third cancels every third run: the runs are locked in id order, so no deadlock;
    every run ends succeeded-ready-for-the-join or canceled, and each join counted each branch
    at most once."""
    runs = [start(workflow, diamond()) for _ in range(30)]
    firsts = claim_all(workflow.community_id)
    complete_steps(workflow.community_id, [(c.lease, {}) for c in firsts])
    branches = claim_all(workflow.community_id)
    left = sorted([c for c in branches if c.step.key == "step2"], key=lambda c: c.lease.run_id)
    right = sorted([c for c in branches if c.step.key == "step3"], key=lambda c: c.lease.run_id, reverse=True)
    canceled = {r.pk for r in runs[::3]}
    barrier = threading.Barrier(3, timeout=BARRIER_TIMEOUT)
    errors: list[BaseException] = []
    results: dict[str, list] = {}

    def body(name, work):
        try:
            barrier.wait()
            results[name] = work()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    work = {
        "left": lambda: complete_steps(workflow.community_id, [(c.lease, 1) for c in left]),
        "right": lambda: complete_steps(workflow.community_id, [(c.lease, 2) for c in right]),
        "cancel": lambda: [cancel_run(workflow.community_id, r) for r in sorted(canceled, reverse=True)],
    }
    threads = [threading.Thread(target=body, args=item) for item in work.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for run in runs:
        run_steps = {s.key: s for s in Step.objects.filter(run_id=run.pk)}
        if run.pk in canceled:
            assert run_state(run) == "canceled"
            assert all(s.state in ("succeeded", "canceled") for s in run_steps.values())
        else:
            assert run_state(run) == "running"
            assert [run_steps[k].state for k in ("step2", "step3", "step4")] == ["succeeded", "succeeded", "ready"]
            assert run_steps["step4"].deps_done == 2
    for name, claims in (("left", left), ("right", right)):
        for claim, outcome in zip(claims, results[name], strict=True):
            if claim.lease.run_id in canceled:  # either side may have won
                assert outcome in (Settled("succeeded"), LeaseLost())
            else:
                assert outcome == Settled("succeeded")


@pytest.mark.django_db(transaction=True)
def test_the_orchestrator_completes_in_batches_and_claims_the_successors_as_it_completes(workflow):
    """20 diamonds through run_orchestrator: every step runs once, every run succeeds, fewer
    completion statements than steps (batches), and most successors claimed by the completer
    in the completing transaction rather than by a claim statement of their own."""
    from buzz_delivery.workflows.orchestrator import OrchestratorConfig, run_orchestrator

    runs = [start(workflow, diamond()) for _ in range(20)]
    config = OrchestratorConfig(community_id=workflow.community_id, concurrency=4, idle_exit=0.5, poll_interval=0.1)
    summary = run_orchestrator(config, handle_signals=False)
    assert (summary["exit_code"], summary["claimed"], summary["succeeded"]) == (0, 80, 80)
    assert [run_state(run) for run in runs] == ["succeeded"] * 20
    assert summary["complete_statements"] <= 40  # here: 5 (one step at a time would be 80)
    assert summary["chained"] >= 40  # steps 2-4 of most runs (here: 56-72)
    steps = Step.objects.filter(community_id=workflow.community_id)
    assert set(steps.values_list("attempts", "lease_generation")) == {(1, 1)}


@pytest.mark.django_db(transaction=True)
def test_a_run_locked_elsewhere_is_left_out_of_the_batch_and_completed_on_its_own(workflow):
    """The batch never waits for a run lock (a cancel, a fan-in or another batch holds it):
    that pair is returned not attempted, the rest completes; complete_steps then completes it
    on its own once the lock is gone."""
    busy, free = start(workflow, diamond()), start(workflow, diamond())
    claims = {c.lease.run_id: c for c in claim_all(workflow.community_id)}
    holder = psycopg.connect(database_url(connection.settings_dict))
    # The lock goes in 2 s whatever happens: a batch that waited for it would complete both
    # steps and fail the first assertion, rather than hang the test.
    release = threading.Timer(2.0, holder.rollback)
    try:
        holder.execute(  # the community named: a row lock Citus can route (SPEC 15)
            "SELECT 1 FROM buzz_workflows_run WHERE community_id = %s AND run_id = %s FOR NO KEY UPDATE",
            [workflow.community_id, busy.pk],
        )
        release.start()
        batch = complete_and_claim_steps(
            workflow.community_id, [(claims[busy.pk].lease, 1), (claims[free.pk].lease, 2)], claim_limit=10
        )
        assert batch.outcomes == [None, Settled("succeeded")]
        assert sorted(c.step.key for c in batch.claims) == ["step2", "step3"]
        assert {c.lease.run_id for c in batch.claims} == {free.pk}
        assert states(busy)["step1"] == "running"
        assert complete_steps(workflow.community_id, [(claims[busy.pk].lease, 1)]) == [Settled("succeeded")]
        assert states(busy) == {"step1": "succeeded", "step2": "ready", "step3": "ready", "step4": "pending"}
    finally:
        if release.is_alive():
            release.join()
        holder.close()


@pytest.mark.django_db
def test_start_run_returns_the_run_as_stored(workflow):
    run = start(workflow, diamond(), {"x": [1, {"y": "z"}]})
    stored = Run.objects.get(pk=run.pk)
    assert run.input == stored.input == {"x": [1, {"y": "z"}]}
    for field in ("state", "steps_total", "steps_left", "depth", "definition_id", "created_at", "cause_kind"):
        assert getattr(run, field) == getattr(stored, field), field
    assert run.definition.pk == stored.definition_id
