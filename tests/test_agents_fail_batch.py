"""fail_run of many runs in one statement (issue 29, agents.services.batch.fail_runs): each run
fenced by its own lease and left exactly as the single ``fail_run`` leaves its twin."""

from __future__ import annotations

import dataclasses

import pytest
from django.core.exceptions import ValidationError

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import (
    AlreadyTerminal,
    Finished,
    LeaseLost,
    Unwinding,
    begin_compensation,
    cancel_agent_run,
    complete_run,
    fail_run,
    finish_compensation,
    journal_call,
    record_call_result,
)
from buzz_delivery.agents.services import batch as b
from tests.agents_support import claim, counts, new_run

pytestmark = pytest.mark.django_db(transaction=True)

UNDO = {"function": "m:undo"}


def _call(lease, *, ok: bool | None, compensation=UNDO) -> None:
    """Journal one call; record it succeeded (ok), failed (not ok) or leave it pending (None)."""
    seq = journal_call(lease, "t", {"n": 1}, compensation=compensation).seq
    if ok is not None:
        record_call_result(lease, seq, ok=ok, output={"n": 1} if ok else None, error=None if ok else "boom")


def _set_up(community_id, kind: str):
    """A claimed run in the state ``kind`` names; returns the lease to fail it with."""
    lease = claim(community_id, new_run(community_id))
    if kind == "two_succeeded":
        _call(lease, ok=True)
        _call(lease, ok=True)
    elif kind == "pending_with_compensation":
        _call(lease, ok=True)
        _call(lease, ok=None)
    elif kind == "pending_without_compensation":
        _call(lease, ok=None, compensation=None)
    elif kind == "failed_call":
        _call(lease, ok=False)
    elif kind == "stale":
        lease = dataclasses.replace(lease, lease_generation=lease.lease_generation - 1)
    elif kind == "completed":
        assert isinstance(complete_run(lease, {"done": 1}), Finished)
    elif kind == "cancelled":
        _call(lease, ok=None, compensation=None)
        cancel_agent_run(lease.community_id, lease.run_id)
    elif kind == "other_worker":
        lease = dataclasses.replace(lease, worker_id="someone-else")
    elif kind == "unwound_for_cancel":  # every compensation done: the next fail ends it cancelled
        _call(lease, ok=True)
        cancel_agent_run(lease.community_id, lease.run_id)
        lease = claim(community_id, lease.run_id)  # claimed again (a new generation)
        assert isinstance(fail_run(lease, "cancelled"), Unwinding)
        assert isinstance(begin_compensation(lease, 1), dict)
        finish_compensation(lease, 1, ok=True)
    return lease


KINDS = ("plain", "two_succeeded", "pending_with_compensation", "pending_without_compensation", "failed_call",
         "stale", "completed", "cancelled", "other_worker", "unwound_for_cancel")  # fmt: skip


def _state(run_id) -> tuple:
    run = AgentRun.objects.get(id=run_id)
    journal = list(
        JournalEntry.objects.filter(run_id=run_id)
        .order_by("seq")
        .values_list("seq", "status", "uncertain", "error", "compensation_status", "result_generation")
    )
    return (run.state, run.unwinding, run.failure_code, run.failure_message, run.lease_until is None,
            run.finished_at is None, len(run.history), journal)  # fmt: skip


def test_each_run_of_a_batch_ends_as_its_twin_failed_by_fail_run_and_a_stale_holder_is_refused_alone(community):
    singles = {kind: _set_up(community.id, kind) for kind in KINDS}
    batched = {kind: _set_up(community.id, kind) for kind in KINDS}
    expected = {kind: fail_run(lease, "handler_error", f"{kind}: x") for kind, lease in singles.items()}

    # A run of another worker's lease cannot share a batch (one holder per batch): sent on its own.
    one_holder = [k for k in KINDS if k != "other_worker"]
    outcomes = dict(
        zip(
            one_holder,
            b.fail_runs(community.id, [b.prepare_failure(batched[k], "handler_error", f"{k}: x") for k in one_holder]),
            strict=True,
        )
    )
    outcomes["other_worker"] = b.fail_runs(
        community.id, [b.prepare_failure(batched["other_worker"], "handler_error", "other_worker: x")]
    )[0]

    assert outcomes == expected
    assert outcomes["plain"] == Finished("failed")
    assert outcomes["two_succeeded"] == Unwinding((2, 1))
    assert outcomes["pending_with_compensation"] == Unwinding((2, 1))
    assert outcomes["stale"] == LeaseLost() and outcomes["other_worker"] == LeaseLost()
    assert outcomes["completed"] == AlreadyTerminal("completed")
    assert outcomes["cancelled"] == LeaseLost("cancelled")
    assert outcomes["unwound_for_cancel"] == Finished("cancelled")
    for kind in KINDS:
        assert _state(batched[kind].run_id) == _state(singles[kind].run_id), kind
    # The stale holder's run kept its current holder's lease.
    stale = AgentRun.objects.get(id=batched["stale"].run_id)
    assert (stale.state, stale.failure_code) == ("running", None)


def test_a_batch_locks_its_runs_writes_in_one_statement_and_reads_the_seqs_of_its_unwinding_runs_once(community):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    leases = [_set_up(community.id, kind) for kind in ("plain", "two_succeeded", "pending_with_compensation")]
    failures = [b.prepare_failure(lease, "boom") for lease in leases]
    with CaptureQueriesContext(connection) as sent:
        outcomes = b.fail_runs(community.id, failures)
    assert outcomes == [Finished("failed"), Unwinding((2, 1)), Unwinding((2, 1))]
    # Besides BEGIN, COMMIT and the tenant scope's set_config (sent ahead of a statement, in its
    # query, with tenant isolation on): the runs' lock (tests/test_agents_fail_race.py says why),
    # the statement and the read.
    statements = []
    for query in sent.captured_queries:
        text = query["sql"].strip()
        if text.startswith("SELECT set_config("):
            text = text.split(";", 1)[1].strip()
        if text and text not in ("BEGIN", "COMMIT"):
            statements.append(text)
    assert len(statements) == 3, statements
    assert "FOR NO KEY UPDATE" in statements[0] and statements[1].startswith("WITH u AS MATERIALIZED"), statements


def test_a_bad_item_is_refused_naming_its_field_before_any_sql(community, django_assert_num_queries):
    lease = _set_up(community.id, "plain")
    before = counts(), _state(lease.run_id)
    for field, make in {
        "failure_code": lambda: b.prepare_failure(lease, "  "),
        "failure_message": lambda: b.prepare_failure(lease, "x", "y" * 10_001),
        "lease": lambda: b.prepare_failure("not a lease", "x"),  # type: ignore[arg-type]
    }.items():
        with pytest.raises(ValidationError) as caught, django_assert_num_queries(0):
            make()
        assert field in caught.value.message_dict
    with pytest.raises(ValidationError, match="the same run twice"), django_assert_num_queries(0):
        b.fail_runs(community.id, [b.prepare_failure(lease, "x"), b.prepare_failure(lease, "y")])
    assert (counts(), _state(lease.run_id)) == before


def test_compensation_batches_leave_each_run_as_the_single_forms_leave_its_twin(community):
    """begin_compensations / finish_compensations: one statement each for many unwinding runs,
    each run fenced by its own lease, each entry moved only as the single form would move it."""

    def unwinding(kind: str):
        lease = _set_up(community.id, "two_succeeded")
        assert fail_run(lease, "boom") == Unwinding((2, 1))
        if kind == "stale":
            return dataclasses.replace(lease, lease_generation=lease.lease_generation - 1)
        return lease

    kinds = ("next", "not_next", "stale", "cancelled")
    seqs = {"next": 2, "not_next": 1, "stale": 2, "cancelled": 2}
    singles = {k: unwinding(k) for k in kinds}
    batched = {k: unwinding(k) for k in kinds}
    for leases in (singles, batched):  # once every run is claimed (a cancelled one is pending again)
        cancel_agent_run(community.id, leases["cancelled"].run_id)
    expected_begin = {k: begin_compensation(singles[k], seqs[k]) for k in kinds}
    began = b.begin_compensations(community.id, [b.prepare_compensation_begin(batched[k], seqs[k]) for k in kinds])
    for k, got in zip(kinds, began, strict=True):
        want = expected_begin[k]
        if isinstance(want, dict):  # the same entry of the twin: its own key
            assert got == {**want, "key": f"{batched[k].run_id}:{seqs[k]}:compensate"}, k
        else:
            assert got == (b.NotNext() if want is None else want), k
    assert isinstance(began[0], dict) and began[1] == b.NotNext() and began[2] == LeaseLost()
    expected_finish = {k: finish_compensation(singles[k], seqs[k], ok=k != "not_next", error="e") for k in kinds}
    finished = b.finish_compensations(
        community.id,
        [b.prepare_compensation_finish(batched[k], seqs[k], ok=k != "not_next", error="e") for k in kinds],
    )
    assert finished == [expected_finish[k] for k in kinds]
    for k in kinds:
        assert _state(batched[k].run_id) == _state(singles[k].run_id), k
