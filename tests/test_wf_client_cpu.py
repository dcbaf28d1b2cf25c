"""The orchestrator's client work per step and per run (issue 31, its client CPU), each saving
with what it must keep:

- the batch completion sends its arrays as their text (no per-element quoting by psycopg's
  dumper), and undoes the NOTIFY deferral by a statement of its own only inside a caller's
  transaction (``SET LOCAL`` ends with the batch's own commit): outputs and notifications as
  before;
- a step's execution enters its tenant scope once, and the check that routes a claim to the
  event loop (``prepare_call``) enters none for a step that is not ``async def``;
- a dispatcher that left its claim to the completer's batch waits for that batch through the
  wakes that change nothing (a NOTIFY a run), not a pass of its loop per wake;
- the completer gathers a batch with one wait (its linger slept out), not a wake per output."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from django.db import connection, connections, transaction

from buzz_delivery.services import Settled, tenancy
from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows import completer, executor
from buzz_delivery.workflows.models import Step
from buzz_delivery.workflows.orchestrator import Orchestrator, OrchestratorConfig
from buzz_delivery.workflows.services import claim_steps, complete_and_claim_steps, complete_steps
from buzz_delivery.workflows.services import sql as wf_sql
from buzz_delivery.workflows.testing import diamond, function_step
from tests.test_wf_batch_complete import _Heard
from tests.wf_support import start

OUTPUTS = [
    None,
    {},
    "null",
    'a "quoted" \\ backslash, {braces}, commas, and "\\"" both',
    {"k": ["\\", '"', "{", "}", ",", " ", "é", "\u2028", "NULL"], "n": 1.5, "t": True},
    ["NULL", None, "", "\\\\"],
    "😀 and \\u0000-looking text",
]


class _Sent:
    """The statements (and their parameters) the default connection runs."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def __call__(self, execute, sql, params, many, context):
        self.calls.append((sql, params))
        return execute(sql, params, many, context)

    def texts(self) -> list[str]:
        return [sql for sql, _ in self.calls]


@pytest.mark.django_db
def test_a_batch_stores_every_output_as_its_json_and_sends_its_arrays_as_text(community):
    workflow = WorkflowFactory(community=community)
    for _ in OUTPUTS:
        start(workflow, {"steps": [function_step("a")]})
    claims = claim_steps(community.id, limit=len(OUTPUTS), lease_seconds=30)
    sent = _Sent()
    with connection.execute_wrapper(sent):
        outcomes = complete_steps(community.id, [(c.lease, o) for c, o in zip(claims, OUTPUTS, strict=True)])
    assert outcomes == [Settled("succeeded")] * len(OUTPUTS)
    for claim, output in zip(claims, OUTPUTS, strict=True):
        assert Step.objects.get(pk=claim.lease.step_id).output == output
    arrays = [params for sql, params in sent.calls if isinstance(params, dict) and "step_ids" in params]
    assert len(arrays) == 1
    assert all(isinstance(arrays[0][name], str) for name in ("step_ids", "lease_generations", "outputs"))


@pytest.mark.django_db(transaction=True)
def test_the_completers_own_transaction_sends_no_undefer_and_later_releases_still_notify(community):
    """Outside a caller's transaction the deferral ends with the batch's commit: no statement
    of its own undoes it, and a release committed afterwards on the same connection NOTIFYs."""
    workflow = WorkflowFactory(community=community)
    start(workflow, diamond())
    (first,) = claim_steps(community.id, limit=10, lease_seconds=30)
    heard = _Heard()
    try:
        sent = _Sent()
        with connection.execute_wrapper(sent):
            batch = complete_and_claim_steps(community.id, [(first.lease, {})], claim_limit=1)
        assert len(batch.claims) == 1
        assert any(wf_sql.DEFER_NOTIFY in text for text in sent.texts())
        assert not any(wf_sql.UNDEFER_NOTIFY in text for text in sent.texts())
        assert heard.take(1) == [str(community.id)]  # the step it left ready
        # The same connection, a new transaction: the release of step4 NOTIFYs at its commit.
        (second,) = claim_steps(community.id, limit=10, lease_seconds=30)
        assert (
            complete_steps(community.id, [(c.lease, {}) for c in (batch.claims[0], second)])
            == [Settled("succeeded")] * 2
        )
        assert heard.take(1) == [str(community.id)]
    finally:
        heard.close()


@pytest.mark.django_db(transaction=True)
def test_inside_a_callers_transaction_the_deferral_is_undone_before_the_callers_own_releases(community):
    workflow = WorkflowFactory(community=community)
    start(workflow, diamond())
    start(workflow, {"steps": [function_step("a"), function_step("b", depends_on=["a"])]})
    firsts = {c.step.key: c for c in claim_steps(community.id, limit=10, lease_seconds=30)}
    heard = _Heard()
    try:
        sent = _Sent()
        with transaction.atomic(), connection.execute_wrapper(sent):
            batch = complete_and_claim_steps(community.id, [(firsts["step1"].lease, {})], claim_limit=2)
            assert len(batch.claims) == 2
            # The caller's own release in the same transaction notifies at its commit.
            assert complete_steps(community.id, [(firsts["a"].lease, {})]) == [Settled("succeeded")]
        assert any(wf_sql.UNDEFER_NOTIFY in text for text in sent.texts())
        assert heard.take(1) == [str(community.id)]
    finally:
        heard.close()


@pytest.fixture
def scopes(monkeypatch) -> list[str]:
    """The tenant scopes entered (their community), as the services' decorator enters them."""
    entered: list[str] = []
    original = tenancy.tenant

    def spy(community_id):
        entered.append(str(community_id))
        return original(community_id)

    monkeypatch.setattr(tenancy, "tenant", spy)
    return entered


@pytest.mark.django_db
def test_a_function_step_runs_in_one_tenant_scope_and_a_plain_one_is_routed_without_one(community, scopes):
    workflow = WorkflowFactory(community=community)
    start(workflow, {"steps": [function_step("a"), function_step("b", function="echo")]})
    claims = claim_steps(community.id, limit=10, lease_seconds=30)
    assert len(claims) == 2
    scopes.clear()
    for claim in claims:
        assert executor.prepare_call(claim) is None  # not async def: a step thread runs it
    assert scopes == []
    for claim in claims:
        scopes.clear()
        outcome = executor.execute(claim, defer_output=True)
        assert isinstance(outcome, executor.Output)
        assert scopes == [str(community.id)]
    assert executor.run_function(claims[0]) == executor.Output({})  # the public call keeps its scope


# The dispatcher's poll interval in the tests below: a pass that only a poll ends would come a
# minute later, so waiting up to half of it for the pass a wake makes at once is a wide margin
# on a loaded machine, and a deferral (which ends at a poll interval) outlasts the test's steps.
POLL = 60.0


def _dispatching(orchestrator: Orchestrator) -> tuple[threading.Thread, list[float], list[str]]:
    """Run ``orchestrator.dispatch()`` on a thread of its own; the list it returns gets the time
    of each pass of the dispatch loop (its dead-thread check runs once a pass), the other the
    reason it returned."""
    passes: list[float] = []
    reason: list[str] = []
    original = orchestrator._dead_thread

    def counted():
        passes.append(time.monotonic())
        return original()

    orchestrator._dead_thread = counted

    def body():
        try:
            reason.append(orchestrator.dispatch())
        finally:
            connections.close_all()

    thread = threading.Thread(target=body)
    thread.start()
    return thread, passes, reason


@pytest.mark.django_db(transaction=True)
def test_a_deferred_dispatcher_waits_through_wakes_until_the_batch_is_through(community):
    """The dispatcher left its claim to the completer (a result awaits it): wakes meanwhile (the
    NOTIFY of every run started) do not run its loop; the batch's own wake does, at once."""
    stop = threading.Event()
    orchestrator = Orchestrator(OrchestratorConfig(community_id=community.id, poll_interval=POLL), stop)
    orchestrator.leading = True  # no Leadership object: leads as the only orchestrator would
    with orchestrator.lock:  # one result waiting for the completer's batch
        orchestrator.awaiting = orchestrator.in_flight = 1
    thread, passes, reason = _dispatching(orchestrator)
    try:
        deadline = time.monotonic() + 5
        while not passes and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert len(passes) == 1
        for _ in range(20):  # NOTIFYs of steps the batch will claim
            orchestrator.wake.set()
            time.sleep(0.01)
        assert len(passes) == 1 and orchestrator.counts["claim_statements"] == 0
        orchestrator._after_batch()  # the batch is through: the dispatcher runs again, now
        deadline = time.monotonic() + POLL / 2  # not the poll a missed wake would wait for
        while len(passes) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(passes) == 2  # and, a result still waiting, leaves the claim to the next batch
        assert orchestrator.counts["claim_statements"] == 0
    finally:
        stop.set()
        orchestrator._after_batch()
        orchestrator.wake.set()
        thread.join(10)
    assert reason == ["stopped"]


class _CountedQueue:
    """A SimpleQueue that counts the blocking gets (each one a wake of the completer's thread
    when an item comes)."""

    def __init__(self) -> None:
        self.inner: queue.SimpleQueue = queue.SimpleQueue()
        self.blocking_gets = 0

    def put(self, item) -> None:
        self.inner.put(item)

    def get(self, block: bool = True, timeout: float | None = None):
        if block:
            self.blocking_gets += 1
        return self.inner.get(block, timeout)

    def get_nowait(self):
        return self.inner.get_nowait()


def test_the_completer_gathers_what_comes_within_its_linger_with_one_wait():
    source = _CountedQueue()
    source.put("a")

    def trickle():
        for item in "bcdef":
            time.sleep(0.005)
            source.put(item)

    thread = threading.Thread(target=trickle)
    thread.start()
    items, closing = completer.next_batch(source, 32, 0.2)
    thread.join()
    assert (items, closing) == (list("abcdef"), False)
    assert source.blocking_gets == 1  # the first item's; the others came while it slept


def test_the_completer_batch_stops_at_max_batch_and_at_the_close_marker(monkeypatch):
    source: queue.SimpleQueue = queue.SimpleQueue()
    for item in range(5):
        source.put(item)
    assert completer.next_batch(source, 3, 0.01) == ([0, 1, 2], False)
    source.put(None)
    assert completer.next_batch(source, 3, 0.01) == ([3, 4], True)
    source.put(None)
    assert completer.next_batch(source, 3, 0.01) == ([], True)
    source.put(7)
    slept: list[float] = []
    monkeypatch.setattr(completer.time, "sleep", slept.append)
    assert completer.next_batch(source, 3, 0.0) == ([7], False)  # no linger: what is there
    assert slept == []  # not waited out (seen, not timed: a loaded machine can miss a wall-clock bound)


class _BatchRightAfterDecision:
    """The orchestrator's lock, which runs the completer's ``after`` (a batch through, nothing
    left awaiting it) once, right after the dispatcher's block that decided to leave its claim
    to that batch released it: the batch lands between that decision and what follows."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self.inner = threading.Lock()
        self.orchestrator = orchestrator
        self.armed = True

    def __enter__(self):
        return self.inner.__enter__()

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)
        o = self.orchestrator
        if self.armed and o.deferred_wake:
            self.armed = False
            with self.inner:
                o.awaiting = o.in_flight = 0  # the batch took the last result
            o._after_batch()
        return False


@pytest.mark.django_db(transaction=True)
def test_a_batch_through_just_after_the_dispatcher_deferred_to_it_does_not_stall_it(community):
    """The completer's batch goes through between the dispatcher's decision to leave its claim
    to it (under the lock) and its wait: nothing awaits a batch any more, so no batch wakes it;
    a wake (a NOTIFY of new work) must run its loop, not be waited through until the poll
    interval (issue 31 review: the wait took the batch count after the batch, as if waiting for
    the next one)."""
    stop = threading.Event()
    orchestrator = Orchestrator(OrchestratorConfig(community_id=community.id, poll_interval=POLL), stop)
    orchestrator.leading = True
    orchestrator.lock = _BatchRightAfterDecision(orchestrator)  # type: ignore[assignment]
    with orchestrator.lock:
        orchestrator.awaiting = orchestrator.in_flight = 1
    thread, passes, reason = _dispatching(orchestrator)
    try:
        deadline = time.monotonic() + 5
        while orchestrator.lock.armed and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        orchestrator.wake.set()  # a NOTIFY: a run started
        deadline = time.monotonic() + POLL / 2  # not the poll a wake waited through would end
        while len(passes) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(passes) >= 2, "the dispatcher waited through the wake with no batch to come"
    finally:
        stop.set()
        orchestrator.wake.set()
        thread.join(10)
    assert reason == ["stopped"]
