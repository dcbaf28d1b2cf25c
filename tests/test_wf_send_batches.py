"""Batched ``send_message`` steps (issue 31): the orchestrator's completer sends the send steps
of one community in one transaction (``buzz_delivery.workflows.sends.send_messages``): the
identity locks, one fenced park judged by its rows, the message events and the deliveries of
every target, each one statement whatever the batch's size, and every guarantee of a single
send kept: a step whose lease was lost gets nothing written, a send is exactly-once per (run,
step), the deliveries carry their run's priority and trace context, each step its own typed
outcome; a refused batch is sent one step at a time."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, connections

from buzz_delivery import services
from buzz_delivery.models import Event, WorkflowAgentDelivery
from buzz_delivery.services import LeaseLost, Settled
from buzz_delivery.testing import CommunityFactory, WorkflowFactory, random32
from buzz_delivery.workflows import completer as completer_module
from buzz_delivery.workflows import executor
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.orchestrator import OrchestratorConfig, run_orchestrator
from buzz_delivery.workflows.sends import send_messages
from buzz_delivery.workflows.services import cancel_run, claim_steps, get_run
from buzz_delivery.workflows.testing import send_step
from tests.conftest import BARRIER_TIMEOUT
from tests.wf_support import backdate_step_lease, start


@pytest.fixture
def workflow(community):
    return WorkflowFactory(community=community)


TARGETS = [random32(), random32()]


def send_runs(workflow, n: int, **kwargs) -> list[Run]:
    return [start(workflow, {"steps": [send_step("send", TARGETS, content=f"m{i}")]}, **kwargs) for i in range(n)]


def claim_all(community_id, n: int = 100):
    return claim_steps(community_id, limit=n, lease_seconds=30)


def deliveries(run) -> list[WorkflowAgentDelivery]:
    return list(WorkflowAgentDelivery.objects.filter(community_id=run.community_id, run_id=run.pk))


def events(run) -> int:
    return Event.objects.filter(
        community_id=run.community_id, event_id=executor.message_event_id(run.pk, "send")
    ).count()


def send_step_of(run) -> Step:
    return Step.objects.get(community_id=run.community_id, run_id=run.pk, key="send")


class StatementCounter:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def __call__(self, execute, sql, params, many, context):
        self.sent.append(sql)
        return execute(sql, params, many, context)


def sent_by(workflow, n: int) -> tuple[list, int]:
    """Send ``n`` fresh send steps of ``workflow`` as one batch: (outcomes, statements)."""
    send_runs(workflow, n)
    claims = claim_all(workflow.community_id)
    counter = StatementCounter()
    with connection.execute_wrapper(counter):
        outcomes = send_messages(workflow.community_id, claims)
    return outcomes, len(counter.sent)


@pytest.mark.django_db
def test_a_batch_parks_every_step_and_commits_its_deliveries_with_its_runs_priority(workflow):
    runs = [start(workflow, {"steps": [send_step("send", TARGETS, content="x")]}, priority=p) for p in (-3, 0, 5)]
    claims = claim_all(workflow.community_id)
    assert send_messages(workflow.community_id, claims) == [Settled("waiting")] * 3
    for run, priority in zip(runs, (-3, 0, 5), strict=True):
        step = send_step_of(run)
        assert (step.state, step.expected, step.delivered_terminal, step.lease_until) == ("waiting", 2, 0, None)
        rows = deliveries(run)
        assert sorted(bytes(d.target_pubkey) for d in rows) == sorted(TARGETS)
        assert {d.priority for d in rows} == {priority}
        assert {bytes(d.message_event_id) for d in rows} == {executor.message_event_id(run.pk, "send")}
        assert {d.status for d in rows} == {"pending"}
        assert events(run) == 1
        assert step.history[-1]["event"] == "park"


@pytest.mark.django_db
def test_the_statements_of_a_batch_do_not_grow_with_its_size(workflow):
    other = WorkflowFactory(community=workflow.community)
    small, few = sent_by(workflow, 2)
    large, many = sent_by(other, 12)
    assert small == [Settled("waiting")] * 2 and large == [Settled("waiting")] * 12
    # 9: since issue 31 stage 2 the commit (services/fanout.commit_messages) inserts the queue rows
    # of the records it created in one more statement (producer.queue_created: one INSERT over the
    # created ids' array), once per batch whatever its size.
    assert many == few <= 9, (few, many)


@pytest.mark.django_db
def test_a_step_whose_lease_was_lost_gets_nothing_written_and_the_others_everything(workflow):
    runs = send_runs(workflow, 3)
    claims = claim_all(workflow.community_id)
    by_run = {c.lease.run_id: c for c in claims}
    ordered = [by_run[run.pk] for run in runs]
    backdate_step_lease(ordered[1].lease.step_id)  # its lease lapsed: another holder may take it
    outcomes = send_messages(workflow.community_id, ordered)
    assert outcomes == [Settled("waiting"), LeaseLost(), Settled("waiting")]
    lost = runs[1]
    assert deliveries(lost) == [] and events(lost) == 0
    assert (send_step_of(lost).state, send_step_of(lost).expected) == ("running", None)
    for run in (runs[0], runs[2]):
        assert len(deliveries(run)) == 2 and events(run) == 1
        assert send_step_of(run).state == "waiting"


@pytest.mark.django_db
def test_each_step_gets_the_outcome_a_single_send_would_have(workflow):
    runs = send_runs(workflow, 4)
    other = WorkflowFactory(community=CommunityFactory())
    send_runs(other, 1)
    claims = {c.lease.run_id: c for c in claim_all(workflow.community_id)}
    ordered = [claims[run.pk] for run in runs]
    (foreign,) = claim_all(other.community_id)
    assert send_messages(workflow.community_id, [ordered[0]]) == [Settled("waiting")]  # sent already
    assert cancel_run(workflow.community_id, runs[1].pk) is not None  # its step canceled
    backdate_step_lease(ordered[2].lease.step_id)
    outcomes = send_messages(workflow.community_id, [*ordered, foreign])
    # The holder's repeat, the step canceled, the lease lost, one sent now, one not attempted;
    # each what the single send says.
    assert outcomes == [Settled("waiting"), LeaseLost(), LeaseLost(), Settled("waiting"), None]
    assert [executor.execute(claim) for claim in ordered] == outcomes[:4]
    assert len(deliveries(runs[0])) == 2  # the repeat wrote nothing more
    assert deliveries(runs[1]) == [] and deliveries(runs[2]) == []
    assert WorkflowAgentDelivery.objects.filter(community_id=other.community_id).count() == 0


@pytest.mark.django_db
def test_a_replayed_batch_writes_nothing_twice_and_the_single_path_reads_it_as_the_same_send(workflow):
    runs = send_runs(workflow, 3)
    claims = claim_all(workflow.community_id)
    assert send_messages(workflow.community_id, claims) == [Settled("waiting")] * 3
    assert send_messages(workflow.community_id, claims) == [Settled("waiting")] * 3
    for claim in claims:
        assert executor.execute(claim) == Settled("waiting")
    for run in runs:
        assert len(deliveries(run)) == 2 and events(run) == 1


@pytest.mark.django_db
def test_a_batch_keeps_the_deliveries_an_earlier_attempt_committed(workflow):
    """A step whose earlier attempt committed its deliveries (here: the single path, then the
    step made running again as a retry would) is sent again: nothing is written twice, the step
    waits for its deliveries."""
    (run,) = send_runs(workflow, 1)
    (claim,) = claim_all(workflow.community_id)
    assert executor.execute(claim) == Settled("waiting")
    first = {d.id for d in deliveries(run)}
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_workflows_step SET state = 'ready', expected = NULL, waiting_since = NULL,"
            " wait_deadline = NULL WHERE id = %s",
            [claim.lease.step_id],
        )
    (again,) = claim_all(workflow.community_id)
    assert again.lease.lease_generation > claim.lease.lease_generation
    assert send_messages(workflow.community_id, [again]) == [Settled("waiting")]
    assert {d.id for d in deliveries(run)} == first and events(run) == 1
    assert (send_step_of(run).state, send_step_of(run).expected) == ("waiting", 2)


@pytest.mark.django_db(transaction=True)
def test_two_holders_replaying_the_same_batch_at_once_send_it_once(workflow):
    """Real threads, each on its own connection, send the same claims at the same moment: the
    identity locks serialise them, the fence lets one park; the other writes nothing."""
    runs = send_runs(workflow, 4)
    claims = claim_all(workflow.community_id)
    barrier = threading.Barrier(2, timeout=BARRIER_TIMEOUT)
    results: list[list] = []
    errors: list[BaseException] = []

    def send() -> None:
        try:
            barrier.wait()
            results.append(send_messages(workflow.community_id, claims))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=send) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BARRIER_TIMEOUT)
    assert not errors, errors
    assert results == [[Settled("waiting")] * 4] * 2
    for run in runs:
        assert len(deliveries(run)) == 2 and events(run) == 1
        assert send_step_of(run).expected == 2


@pytest.mark.django_db(transaction=True)
def test_the_orchestrator_sends_in_batches_and_the_fan_in_still_counts_them(workflow):
    runs = send_runs(workflow, 12)
    summary = run_orchestrator(
        OrchestratorConfig(community_id=workflow.community_id, concurrency=4, idle_exit=1.0, poll_interval=0.1),
        handle_signals=False,
    )
    assert summary["waiting"] == 12 and summary["errors"] == 0, summary
    assert 1 <= summary["send_statements"] <= 12, summary
    for run in runs:
        for d in deliveries(run):
            claim = services.claim_delivery(d.community_id, bytes(d.target_pubkey), delivery_id=d.id, lease_seconds=30)
            assert services.finish_delivery(claim.lease, "finished") == Settled("finished")
        assert get_run(workflow.community_id, run.pk).step("send").state == "succeeded"
        assert Run.objects.get(pk=run.pk).state == "succeeded"


@pytest.mark.django_db(transaction=True)
def test_a_refused_batch_is_sent_one_step_at_a_time(workflow, monkeypatch):
    runs = send_runs(workflow, 5)

    def refused(community, claims):
        raise RuntimeError("refused")

    monkeypatch.setattr(completer_module, "send_messages", refused)
    summary = run_orchestrator(
        OrchestratorConfig(community_id=workflow.community_id, concurrency=4, idle_exit=1.0, poll_interval=0.1),
        handle_signals=False,
    )
    assert summary["waiting"] == 5 and summary["errors"] == 0 and summary["send_statements"] == 0, summary
    for run in runs:
        assert len(deliveries(run)) == 2 and send_step_of(run).state == "waiting"


@pytest.mark.django_db
def test_a_batch_of_more_targets_than_one_commit_takes_is_still_sent_in_batches(workflow):
    """A delivery commit takes at most MAX_BINDINGS_PER_COMMIT (10,000) bindings; a step may
    name up to 10,000 targets. Three steps of 4,000 targets each are sent in transactions of at
    most 10,000 deliveries, not refused whole (which sent every step of the batch on its own)."""
    runs = [start(workflow, {"steps": [send_step("send", [random32() for _ in range(4000)])]}) for _ in range(3)]
    claims = claim_all(workflow.community_id)
    assert send_messages(workflow.community_id, claims) == [Settled("waiting")] * 3
    for run in runs:
        assert len(deliveries(run)) == 4000 and events(run) == 1
        assert (send_step_of(run).state, send_step_of(run).expected) == ("waiting", 4000)
