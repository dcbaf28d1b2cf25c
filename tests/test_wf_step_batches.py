"""Batched lease renewals and batched failures of ``function`` steps (issue 29): an orchestrator
renews the leases it holds with one statement per community per round (``renew_steps``), and
records the failures of its ``async def`` steps like their successes, one transaction per
community per batch (``fail_steps``), each row fenced by its own lease, with the outcome a
single renewal or failure would have had."""

from __future__ import annotations

import threading
import time

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, connections, transaction

from buzz_delivery.services import AlreadyTerminal, LeaseLost, Settled
from buzz_delivery.testing import CommunityFactory, WorkflowFactory, advance_to
from buzz_delivery.workflows.completer import Completer
from buzz_delivery.workflows.executor import Failure
from buzz_delivery.workflows.models import Step
from buzz_delivery.workflows.orchestrator import Orchestrator, OrchestratorConfig, _key
from buzz_delivery.workflows.services import (
    StepFailure,
    StepRenewed,
    claim_steps,
    complete_step,
    complete_steps,
    fail_steps,
    fail_steps_skip_locked,
    renew_steps,
)
from buzz_delivery.workflows.services import sql as wf_sql
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from buzz_delivery.workflows.testing import function_step
from tests.citus_support import waits_for_a_row_lock
from tests.conftest import BARRIER_TIMEOUT
from tests.wf_support import backdate_step_lease, start


@pytest.fixture
def workflow(community):
    return WorkflowFactory(community=community)


def one_step_runs(workflow, n: int, **retry) -> None:
    for _ in range(n):
        start(workflow, {"steps": [function_step("a", retry={"max_attempts": 3, **retry})]})


def claim_all(community_id, n: int = 100, holder: str = "host:1:a"):
    return claim_steps(community_id, limit=n, lease_seconds=30, holder=holder)


def db_now():
    with connection.cursor() as cursor:
        cursor.execute("SELECT buzz_delivery_now()")
        return cursor.fetchone()[0]


class StatementCounter:
    """Counts the statements a connection sends (a Django execute_wrapper), by SQL text."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def __call__(self, execute, sql, params, many, context):
        self.sent.append(sql)
        return execute(sql, params, many, context)

    def count(self, statement: str) -> int:
        return sum(sql == statement for sql in self.sent)


def renewal_waits_for_a_lock(pid: int) -> bool:
    return waits_for_a_row_lock(pid, "%renewals%")


# --- renewals -----------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_batch_renewal_extends_every_current_lease_and_reports_the_stale_ones_lost(workflow):
    one_step_runs(workflow, 5)
    reclaimed, done, expired, a, b = claim_all(workflow.community_id)
    backdate_step_lease(reclaimed.lease.step_id)
    assert reap_workflow_steps().reclaimed == 1
    [again] = claim_all(workflow.community_id, holder="host:2:b")
    assert complete_step(done.lease, {"ok": 1}) == Settled("succeeded")
    backdate_step_lease(expired.lease.step_id)
    leases = [reclaimed.lease, done.lease, expired.lease, a.lease, b.lease]
    outcomes = renew_steps(workflow.community_id, leases, 120)
    assert [type(o) for o in outcomes] == [LeaseLost, LeaseLost, LeaseLost, StepRenewed, StepRenewed]
    for held, renewed in zip((a, b), outcomes[3:], strict=True):
        assert renewed.lease.step_id == held.lease.step_id
        assert renewed.lease.lease_generation == held.lease.lease_generation  # a renewal never bumps it
        assert renewed.lease.lease_until > held.lease.lease_until
        row = Step.objects.get(id=held.lease.step_id)
        assert (row.lease_until, row.renewals) == (renewed.lease.lease_until, 1)
    # The new holder's lease was not touched by the old holder's renewal.
    assert Step.objects.get(id=again.lease.step_id).renewals == 0
    assert renew_steps(workflow.community_id, []) == []


@pytest.mark.django_db
def test_a_fenced_community_renews_nothing(workflow):
    one_step_runs(workflow, 2)
    claims = claim_all(workflow.community_id)
    advance_to(workflow.community, "fenced")
    assert renew_steps(workflow.community_id, [c.lease for c in claims], 60) == [LeaseLost(), LeaseLost()]


@pytest.mark.django_db
@pytest.mark.parametrize("bad", ["other_community", "same_lease_twice", "not_a_lease", "too_many", "lease_seconds"])
def test_bad_renewal_input_names_the_field(workflow, bad):
    one_step_runs(workflow, 1)
    other = WorkflowFactory(community=CommunityFactory())
    one_step_runs(other, 1)
    [mine] = claim_all(workflow.community_id)
    [theirs] = claim_all(other.community_id)
    args, field = {
        "other_community": (([mine.lease, theirs.lease], 30), "leases[1]"),
        "same_lease_twice": (([mine.lease, mine.lease], 30), "leases[1]"),
        "not_a_lease": (([mine.lease, "x"], 30), "lease"),
        "too_many": (([mine.lease] * 1001, 30), "leases"),
        "lease_seconds": (([mine.lease], -1), "lease_seconds"),
    }[bad]
    with pytest.raises(ValidationError) as info:
        renew_steps(workflow.community_id, *args)
    assert field in info.value.message_dict
    assert Step.objects.get(id=mine.lease.step_id).renewals == 0


@pytest.mark.django_db(transaction=True)
def test_a_renewal_round_that_meets_a_lease_taken_by_another_holder_renews_the_others_and_reports_it_lost(workflow):
    """Real threads, each on its own connection: holder B takes over one of holder A's steps
    (its lease lapsed: reaped and claimed again) in a transaction still open when A's renewal
    round comes; A's one statement waits for that row, then renews A's other leases and reports
    that one lost. A's result for it is not written afterwards (its completion is told
    LeaseLost or AlreadyTerminal); B's is."""
    one_step_runs(workflow, 6)
    claims = claim_all(workflow.community_id)
    taken = claims[2]
    b_took_it = threading.Event()
    b_may_commit = threading.Event()
    renewal_pid: list[int] = []
    results: dict[str, object] = {}
    errors: list[BaseException] = []

    def holder_b() -> None:
        try:
            with transaction.atomic():
                backdate_step_lease(taken.lease.step_id)  # A's lease lapsed (seen only here until commit)
                results["reaped"] = reap_workflow_steps().reclaimed
                [results["theirs"]] = claim_all(workflow.community_id, holder="host:2:b")
                b_took_it.set()
                assert b_may_commit.wait(BARRIER_TIMEOUT)
        except BaseException as exc:
            errors.append(exc)
            b_took_it.set()
        finally:
            connections.close_all()

    def holder_a() -> None:
        try:
            assert b_took_it.wait(BARRIER_TIMEOUT)
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                renewal_pid.append(cursor.fetchone()[0])
            results["a"] = renew_steps(workflow.community_id, [c.lease for c in claims], 120)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=holder_b), threading.Thread(target=holder_a)]
    for t in threads:
        t.start()
    # A's renewal waits on the row B holds (seen by PostgreSQL), then B commits.
    deadline = time.monotonic() + BARRIER_TIMEOUT
    while True:
        assert not errors, errors
        assert time.monotonic() < deadline, "the renewal never waited for the row B holds"
        if renewal_pid and renewal_waits_for_a_lock(renewal_pid[0]):
            break
        time.sleep(0.01)
    b_may_commit.set()
    for t in threads:
        t.join(BARRIER_TIMEOUT)
    assert not errors, errors
    theirs = results["theirs"]
    assert results["reaped"] == 1 and theirs.lease.step_id == taken.lease.step_id
    assert theirs.lease.lease_generation > taken.lease.lease_generation
    outcomes = results["a"]
    assert outcomes[2] == LeaseLost()
    assert all(isinstance(o, StepRenewed) for i, o in enumerate(outcomes) if i != 2), outcomes
    assert Step.objects.get(id=taken.lease.step_id).renewals == 0  # B's lease was not renewed by A
    # A's late result for the step it lost writes nothing; B's is recorded.
    assert complete_steps(workflow.community_id, [(taken.lease, {"by": "a"})]) == [LeaseLost()]
    assert fail_steps(workflow.community_id, [StepFailure(taken.lease, "late")]) == [LeaseLost()]
    assert complete_step(theirs.lease, {"by": "b"}) == Settled("succeeded")
    assert complete_steps(workflow.community_id, [(taken.lease, {"by": "a"})]) == [LeaseLost()]
    row = Step.objects.get(id=taken.lease.step_id)
    assert (row.state, row.output) == ("succeeded", {"by": "b"})


@pytest.mark.django_db
def test_a_renewal_round_sends_one_statement_per_community_and_drops_the_lost_leases(workflow):
    """The orchestrator's renewal round over 12 held steps of two communities: two renewal
    statements (not twelve); a lease another holder took is no longer held."""
    other = WorkflowFactory(community=CommunityFactory())
    one_step_runs(workflow, 7)
    one_step_runs(other, 5)
    mine = claim_all(workflow.community_id)
    others = claim_all(other.community_id)
    lost = mine[0]
    backdate_step_lease(lost.lease.step_id)
    assert reap_workflow_steps().reclaimed == 1
    orchestrator = Orchestrator(OrchestratorConfig(community_id=None, lease_seconds=60), threading.Event())
    orchestrator.held = {_key(c.lease): c.lease for c in [*mine, *others]}
    counter = StatementCounter()
    with connection.execute_wrapper(counter):
        orchestrator._renew_round(list(orchestrator.held.values()))
    assert counter.count(wf_sql.RENEW_MANY_IF_CURRENT_GENERATION) == 2
    assert counter.count(wf_sql.RENEW_IF_CURRENT_GENERATION) == 0
    assert len(counter.sent) == 2, counter.sent
    assert orchestrator.counts["renew_statements"] == 2
    assert orchestrator.counts["renewed"] == 11
    assert _key(lost.lease) not in orchestrator.held
    for claim in [*mine[1:], *others]:
        held = orchestrator.held[_key(claim.lease)]
        assert held.lease_until > claim.lease.lease_until
        assert held.lease_until == Step.objects.get(id=claim.lease.step_id).lease_until


# --- failures -----------------------------------------------------------------------------


def retry_bounds(attempt: int, base: float, cap: float = 300.0) -> tuple[float, float]:
    full = min(cap, base * 2 ** (attempt - 1))
    return full * 0.5, full


@pytest.mark.django_db
def test_many_failures_in_one_batch_are_recorded_as_one_at_a_time_would(workflow):
    """Retried with their own backoff from the attempt their lease holds (jitter within its
    bounds, not before a retry_after), ended ``failed`` when not retryable or out of attempts
    (``attempts_exhausted``), LeaseLost/AlreadyTerminal for stale leases."""
    definition = {"steps": [function_step("a", retry={"max_attempts": 3, "base_seconds": 10, "cap_seconds": 300})]}
    for _ in range(6):
        start(workflow, definition)
    start(workflow, {"steps": [function_step("a", retry={"max_attempts": 1})]})
    claims = claim_all(workflow.community_id)
    [last] = [c for c in claims if c.step.max_attempts == 1]
    first, second, after, permanent, done, lost = [c for c in claims if c is not last]
    retried = [first, second]
    assert complete_step(done.lease, {"ok": 1}) == Settled("succeeded")
    backdate_step_lease(lost.lease.step_id)
    assert reap_workflow_steps().reclaimed == 1
    before = db_now()
    failures = [
        StepFailure(retried[0].lease, "function_error", "RuntimeError: one"),
        StepFailure(retried[1].lease, "function_error", "RuntimeError: two"),
        StepFailure(after.lease, "function_error", "RetryAfter", retry_after=3600),
        StepFailure(permanent.lease, "refused", "no", retryable=False),
        StepFailure(done.lease, "function_error", "late"),
        StepFailure(lost.lease, "function_error", "stale"),
        StepFailure(last.lease, "function_error", "RuntimeError: last"),
    ]
    outcomes = fail_steps(workflow.community_id, failures)
    assert outcomes == [
        Settled("ready"),
        Settled("ready"),
        Settled("ready"),
        Settled("failed"),
        AlreadyTerminal("succeeded"),
        LeaseLost(),
        Settled("failed"),
    ]
    after_call = db_now()
    low, high = retry_bounds(1, 10)
    for claim, message in ((retried[0], "RuntimeError: one"), (retried[1], "RuntimeError: two")):
        row = Step.objects.get(id=claim.lease.step_id)
        assert (row.state, row.attempts, row.failure_code, row.failure_message) == (
            "ready", 1, "function_error", message
        )  # fmt: skip
        assert row.lease_until is None and row.claimed_at is None
        assert low <= (row.next_attempt_at - before).total_seconds()
        assert (row.next_attempt_at - after_call).total_seconds() <= high
        assert [e["event"] for e in row.history][-1] == "retry"
    row = Step.objects.get(id=after.lease.step_id)
    assert row.state == "ready" and (row.next_attempt_at - before).total_seconds() >= 3600
    row = Step.objects.get(id=permanent.lease.step_id)
    assert (row.state, row.failure_code, row.failure_message) == ("failed", "refused", "no")
    row = Step.objects.get(id=last.lease.step_id)
    assert (row.state, row.failure_code, row.failure_message) == (
        "failed", "attempts_exhausted", "function_error: RuntimeError: last"
    )  # fmt: skip
    assert Step.objects.get(id=done.lease.step_id).output == {"ok": 1}

    # The next attempt of a retried step backs off from its own attempt number (2: twice the base).
    Step.objects.filter(id=retried[0].lease.step_id).update(next_attempt_at=None)
    [second] = [c for c in claim_all(workflow.community_id) if c.lease.step_id == retried[0].lease.step_id]
    assert second.lease.attempts == 2
    assert fail_steps(workflow.community_id, [StepFailure(second.lease, "function_error", "again")]) == [
        Settled("ready")
    ]
    moment = db_now()
    low, high = retry_bounds(2, 10)
    row = Step.objects.get(id=second.lease.step_id)
    assert row.attempts == 2
    assert low <= (row.next_attempt_at - before).total_seconds()
    assert (row.next_attempt_at - moment).total_seconds() <= high


@pytest.mark.django_db
def test_a_failure_batch_sends_the_same_statements_for_three_steps_as_for_thirty(workflow):
    one_step_runs(workflow, 33)
    claims = claim_all(workflow.community_id)
    sent = []
    for chunk in (claims[:3], claims[3:]):
        counter = StatementCounter()
        with connection.execute_wrapper(counter):
            outcomes = fail_steps(workflow.community_id, [StepFailure(c.lease, "function_error", "x") for c in chunk])
        assert outcomes == [Settled("ready")] * len(chunk)
        sent.append(len(counter.sent))
    assert sent[0] == sent[1], sent
    assert sent[1] < 30


@pytest.mark.django_db(transaction=True)
def test_a_failure_whose_run_is_locked_elsewhere_is_left_out_of_the_batch(workflow):
    one_step_runs(workflow, 3)
    claims = claim_all(workflow.community_id)
    busy = claims[1]
    locked = threading.Event()
    release = threading.Event()

    def lock_run() -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(
                    wf_sql.LOCK_RUN.replace("%(community_id)s", "%s").replace("%(run_id)s", "%s"),
                    [workflow.community_id, busy.lease.run_id],
                )
                locked.set()
                release.wait(BARRIER_TIMEOUT)
        finally:
            locked.set()
            connections.close_all()

    holder = threading.Thread(target=lock_run)
    holder.start()
    try:
        assert locked.wait(BARRIER_TIMEOUT)
        failures = [StepFailure(c.lease, "function_error", "x") for c in claims]
        outcomes = fail_steps_skip_locked(workflow.community_id, failures)
        assert outcomes == [Settled("ready"), None, Settled("ready")]
        assert Step.objects.get(id=busy.lease.step_id).state == "running"
    finally:
        release.set()
        holder.join(BARRIER_TIMEOUT)
    assert fail_steps(workflow.community_id, [failures[1]]) == [Settled("ready")]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ("other_community", "failures[1]"),
        ("same_step_twice", "failures[1]"),
        ("not_a_failure", "failures[1]"),
        ("empty_code", "failure_code"),
        ("retryable", "retryable"),
        ("retry_after", "retry_after"),
    ],
)
def test_bad_failure_input_names_the_field_and_writes_nothing(workflow, bad, field):
    one_step_runs(workflow, 2)
    other = WorkflowFactory(community=CommunityFactory())
    one_step_runs(other, 1)
    a, b = claim_all(workflow.community_id)
    [theirs] = claim_all(other.community_id)
    second = {
        "other_community": StepFailure(theirs.lease, "x"),
        "same_step_twice": StepFailure(a.lease, "x"),
        "not_a_failure": ("lease", "x"),
        "empty_code": StepFailure(b.lease, ""),
        "retryable": StepFailure(b.lease, "x", retryable="yes"),  # type: ignore[arg-type]
        "retry_after": StepFailure(b.lease, "x", retry_after=-1),
    }[bad]
    with pytest.raises(ValidationError) as info:
        fail_steps(workflow.community_id, [StepFailure(a.lease, "x"), second])
    assert field in info.value.message_dict
    assert set(Step.objects.filter(community_id=workflow.community_id).values_list("state", flat=True)) == {"running"}


@pytest.mark.django_db(transaction=True)
def test_the_completer_records_the_failures_of_one_round_in_one_batch_per_community(workflow):
    """Failures of ``async def`` steps queued together (one round of the loop) go to the
    database in one fail transaction per community, each retried with its own attempt's
    backoff; none recorded one at a time."""
    other = WorkflowFactory(community=CommunityFactory())
    one_step_runs(workflow, 20, base_seconds=10)
    one_step_runs(other, 10, base_seconds=10)
    claims = [*claim_all(workflow.community_id), *claim_all(other.community_id)]
    done: list[tuple[object, object]] = []
    completer = Completer(
        max_batch=64,
        linger=0.0,
        done=lambda claim, outcome: done.append((claim, outcome)),
        room=lambda claims, community: 0,
        accept=lambda claims: None,
        after=lambda: None,
        lease_seconds=30,
        holder="host:1:a",
    )
    for claim in claims:
        completer.put_failure(claim, Failure("function_error", "RuntimeError: boom", True, None))
    completer.close()
    counter = StatementCounter()
    before = db_now()

    def run() -> None:
        with connection.execute_wrapper(counter):
            completer.run()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(BARRIER_TIMEOUT)
    assert not thread.is_alive()
    assert completer.fail_batches == 2
    assert counter.count(wf_sql.RETRY_MANY_IF_CURRENT_GENERATION) == 2
    assert counter.count(wf_sql.RETRY_IF_CURRENT_GENERATION) == 0
    assert sorted(str(c.lease.step_id) for c, _ in done) == sorted(str(c.lease.step_id) for c in claims)
    assert {outcome for _, outcome in done} == {Settled("ready")}
    after = db_now()
    low, high = retry_bounds(1, 10)
    rows = Step.objects.filter(id__in=[c.lease.step_id for c in claims])
    assert rows.count() == 30
    for row in rows:
        assert (row.state, row.attempts, row.failure_code) == ("ready", 1, "function_error")
        assert low <= (row.next_attempt_at - before).total_seconds()
        assert (row.next_attempt_at - after).total_seconds() <= high
