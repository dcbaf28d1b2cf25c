"""Compensation on every way a run can end badly (SPEC 12 "Journal (SAGA)"): a cancel, a passed
``timeout_at`` and exhausted attempts send a run with compensations outstanding back to
``pending`` unwinding; a worker undoes its calls in reverse order, each once, and the run ends
``cancelled`` / ``timeout`` / ``failed``. Plus the exponential backoff of reclaimed runs."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections
from django.test import override_settings

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import (
    AlreadyTerminal,
    Cancelled,
    Finished,
    LeaseLost,
    Recorded,
    begin_compensation,
    cancel_agent_run,
    claim_agent_runs,
    complete_run,
    fail_run,
    finish_compensation,
    heartbeat,
    journal_call,
    reap_agent_runs,
    record_call_result,
)
from tests import agent_handlers as h
from tests.agents_support import AGENT, backdate_run_lease, claim, make_claimable, new_run
from tests.conftest import BARRIER_TIMEOUT

COUNTED = {"function": "tests.agent_handlers:counted_undo"}
IDEMPOTENT = {"function": "tests.agent_handlers:undo"}


@pytest.fixture(autouse=True)
def ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_LEDGER", str(tmp_path / "ledger.txt"))
    monkeypatch.delenv("AGENT_KILL", raising=False)


def never(ctx):
    raise AssertionError("an unwinding run never runs its handler again")


def with_calls(community, n: int = 3, compensation=COUNTED, **run_options):
    """A claimed run with ``n`` succeeded calls that carry ``compensation``; returns its lease."""
    run_id = new_run(community.id, **run_options)
    lease = claim(community.id, run_id)
    for seq in range(1, n + 1):
        assert journal_call(lease, "effect", {"n": seq}, compensation=compensation).seq == seq
        assert record_call_result(lease, seq, ok=True, output={"n": seq}) == Recorded("succeeded")
    return lease


def ran(run_id, verb: str = "ran") -> list[int]:
    """The seqs whose compensation ran, in ledger order (``ran``: every execution)."""
    prefix = f"{verb} {run_id}:"
    return [int(line[len(prefix) :].split(":")[0]) for line in h.ledger_lines() if line.startswith(prefix)]


def run_of(run_id) -> AgentRun:
    return AgentRun.objects.get(id=run_id)


def compensation_statuses(run_id) -> list[str | None]:
    return list(
        JournalEntry.objects.filter(run_id=run_id).order_by("seq").values_list("compensation_status", flat=True)
    )


def unwind_with_a_worker(community, worker: str = "w2") -> str:
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id=worker, lease_seconds=30)
    assert claimed.run.unwinding
    return run_claim(claimed, never)


@pytest.mark.django_db
def test_a_cancel_with_compensations_fences_the_holder_unwinds_once_and_ends_cancelled(community):
    lease = with_calls(community)
    run_id = lease.run_id
    assert cancel_agent_run(community.id, run_id, reason="ops") == Cancelled(run_id)
    row = run_of(run_id)
    assert (row.state, row.unwinding, row.failure_code, row.lease_generation) == ("pending", True, "cancelled", 2)
    # The holder learns it at its next heartbeat, and can neither journal, complete nor compensate.
    assert heartbeat(lease) == LeaseLost("cancelled")
    assert journal_call(lease, "effect", {"n": 4}) == LeaseLost("cancelled")
    assert complete_run(lease, {}) == LeaseLost("cancelled")
    assert begin_compensation(lease, 3) == LeaseLost("cancelled")
    # A second cancel changes nothing (it would only fence the compensating worker).
    # (The final fail_run answers the state it wrote: see the timeout test.)
    assert cancel_agent_run(community.id, run_id) == Cancelled(run_id)
    assert run_of(run_id).lease_generation == 2
    assert ran(run_id) == []

    assert unwind_with_a_worker(community) == "compensated"
    row = run_of(run_id)
    assert (row.state, row.failure_code, row.failure_message) == ("cancelled", "cancelled", "ops")
    assert ran(run_id) == [3, 2, 1]
    assert compensation_statuses(run_id) == ["compensated"] * 3
    assert cancel_agent_run(community.id, run_id) == AlreadyTerminal("cancelled")
    assert claim_agent_runs(community.id, [AGENT], worker_id="w3") == []


@pytest.mark.django_db
def test_a_cancel_without_compensations_still_ends_cancelled_at_once(community):
    lease = with_calls(community, compensation=None)
    assert cancel_agent_run(community.id, lease.run_id) == Cancelled(lease.run_id)
    assert (run_of(lease.run_id).state, run_of(lease.run_id).unwinding) == ("cancelled", False)


@pytest.mark.django_db
def test_a_cancel_while_unwinding_after_a_failure_fences_the_compensator_and_another_finishes_it(community):
    lease = with_calls(community, compensation=IDEMPOTENT)
    assert fail_run(lease, "tool_error").seqs == (3, 2, 1)
    assert isinstance(begin_compensation(lease, 3), dict)
    h.undo({"n": 3}, {"n": 3}, f"{lease.run_id}:3:compensate")  # made, then the cancel lands
    assert cancel_agent_run(community.id, lease.run_id) == Cancelled(lease.run_id)
    assert finish_compensation(lease, 3, ok=True) == LeaseLost("cancelled")
    assert unwind_with_a_worker(community) == "compensated"
    assert run_of(lease.run_id).state == "cancelled"
    assert ran(lease.run_id, "undo") == [3, 2, 1]  # the effect of each compensation once
    assert compensation_statuses(lease.run_id) == ["compensated"] * 3


def pass_timeout(run_id) -> None:
    with connection.cursor() as cursor:
        cursor.execute("UPDATE buzz_agents_run SET timeout_at = now() - interval '1 second' WHERE id = %s", [run_id])


@pytest.mark.django_db
def test_a_timeout_with_compensations_unwinds_once_and_ends_timeout(community):
    lease = with_calls(community, 2, timeout_seconds=60)
    pass_timeout(lease.run_id)
    result = reap_agent_runs()
    assert (result.unwinding, result.timed_out) == (1, 0)
    row = run_of(lease.run_id)
    assert (row.state, row.unwinding, row.failure_code) == ("pending", True, "timeout")
    assert isinstance(heartbeat(lease), LeaseLost)
    assert reap_agent_runs().total == 0  # unwinding: the reaper leaves it to its compensator
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w2", lease_seconds=30)
    assert fail_run(claimed.lease, "timeout").seqs == (2, 1)
    for seq in (2, 1):
        began = begin_compensation(claimed.lease, seq)
        h.counted_undo(began["args"], began["output"], began["key"])
        assert finish_compensation(claimed.lease, seq, ok=True) == Recorded("compensated")
    assert fail_run(claimed.lease, "timeout") == Finished("timeout")  # the outcome names the state
    assert (run_of(lease.run_id).state, run_of(lease.run_id).failure_code) == ("timeout", "timeout")
    assert ran(lease.run_id) == [2, 1]


@pytest.mark.django_db
def test_exhausted_attempts_with_compensations_unwind_once_and_end_failed(community):
    lease = with_calls(community, 3, max_attempts=1)
    backdate_run_lease(lease.run_id)
    result = reap_agent_runs()
    assert (result.unwinding, result.exhausted, result.reclaimed) == (1, 0, 0)
    row = run_of(lease.run_id)
    assert (row.state, row.unwinding, row.failure_code, row.attempts) == ("pending", True, "attempts_exhausted", 1)
    assert unwind_with_a_worker(community) == "compensated"
    row = run_of(lease.run_id)
    assert (row.state, row.failure_code) == ("failed", "attempts_exhausted")
    assert ran(lease.run_id) == [3, 2, 1]


@pytest.mark.django_db
def test_exhausted_attempts_without_compensations_still_end_failed_at_once(community):
    lease = with_calls(community, 2, compensation=None, max_attempts=1)
    backdate_run_lease(lease.run_id)
    assert reap_agent_runs().exhausted == 1
    assert run_of(lease.run_id).state == "failed"


@pytest.mark.django_db
def test_a_compensating_holder_that_lapses_is_reclaimed_whatever_its_attempts_and_each_undo_happens_once(community):
    lease = with_calls(community, 3, compensation=IDEMPOTENT, max_attempts=1)
    backdate_run_lease(lease.run_id)
    reap_agent_runs()
    (first,) = claim_agent_runs(community.id, [AGENT], worker_id="w2", lease_seconds=30)
    assert fail_run(first.lease, "attempts_exhausted").seqs == (3, 2, 1)
    began = begin_compensation(first.lease, 3)
    h.undo(began["args"], began["output"], began["key"])  # undone, then the worker dies
    backdate_run_lease(lease.run_id)
    assert reap_agent_runs().reclaimed == 1  # unwinding: reclaimed though its attempts are spent
    assert run_of(lease.run_id).attempts == 1
    make_claimable(lease.run_id)
    assert finish_compensation(first.lease, 3, ok=True) == LeaseLost()
    assert unwind_with_a_worker(community, "w3") == "compensated"
    assert run_of(lease.run_id).state == "failed"
    assert ran(lease.run_id, "undo") == [3, 2, 1]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("end", ["cancel", "timeout", "exhausted"])
def test_two_concurrent_workers_run_each_compensation_exactly_once(community, end):
    """Two real threads, each on its own connection, race from a barrier to claim and unwind the
    same run; the compensation is not idempotent, so a second execution would show."""
    lease = with_calls(community, 3, max_attempts=1, timeout_seconds=600)
    if end == "cancel":
        cancel_agent_run(community.id, lease.run_id)
    elif end == "timeout":
        pass_timeout(lease.run_id)
        assert reap_agent_runs().unwinding == 1
    else:
        backdate_run_lease(lease.run_id)
        assert reap_agent_runs().unwinding == 1
    barrier = threading.Barrier(2, timeout=BARRIER_TIMEOUT)
    outcomes: dict[str, list[str]] = {}
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            barrier.wait(timeout=10)
            mine = outcomes.setdefault(name, [])
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and run_of(lease.run_id).state not in ("cancelled", "timeout", "failed"):
                for claimed in claim_agent_runs(community.id, [AGENT], worker_id=name, lease_seconds=30):
                    mine.append(run_claim(claimed, never))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=work, args=(f"w-{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    expected_state = {"cancel": "cancelled", "timeout": "timeout", "exhausted": "failed"}[end]
    assert run_of(lease.run_id).state == expected_state
    assert ran(lease.run_id) == [3, 2, 1]
    assert sorted(o for v in outcomes.values() for o in v) == ["compensated"]
    assert compensation_statuses(lease.run_id) == ["compensated"] * 3


def next_attempt_in(run_id) -> float:
    with connection.cursor() as cursor:
        # The database clock the reap used (the statement's time, not the transaction's: this
        # test is one transaction, and now() falls behind by however long it has run), read on
        # its own: on Citus a read of a table is evaluated on the worker.
        cursor.execute("SELECT buzz_delivery_now()")
        (now,) = cursor.fetchone()
        cursor.execute("SELECT next_attempt_at FROM buzz_agents_run WHERE id = %s", [run_id])
        return (cursor.fetchone()[0] - now).total_seconds()


@pytest.mark.django_db
@override_settings(BUZZ_AGENTS={"RETRY_DELAY_SECONDS": 10, "RETRY_DELAY_MAX_SECONDS": 30})
def test_reclaimed_runs_back_off_exponentially_up_to_the_cap(community):
    from buzz_delivery.agents.services import set_policy

    # Five attempts is more than BUZZ_AGENTS' 3: the operator's policy allows it (issue 27: a
    # caller may no longer raise it itself).
    set_policy(community.id, max_attempts=5)
    run_id = new_run(community.id, max_attempts=5)
    delays = []
    for _ in range(4):
        claim(community.id, run_id)
        backdate_run_lease(run_id)
        assert reap_agent_runs().reclaimed == 1
        delays.append(next_attempt_in(run_id))
        assert claim_agent_runs(community.id, [AGENT], worker_id="w") == []  # the gate holds
        make_claimable(run_id)
    # Each capped, doubled delay with equal jitter (issue 29): within [1/2, 1] of it; the
    # measure is taken after the reap, so a little of the delay has passed (1 s of slack).
    for delay, expected in zip(delays, [10, 20, 30, 30], strict=True):
        assert expected / 2 - 1 <= delay <= expected, delays
    assert run_of(run_id).attempts == 4


@pytest.mark.django_db
def test_a_failing_compensation_stops_the_chain_of_a_cancelled_run_and_stays_visible(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    for seq, compensation in ((1, COUNTED), (2, {"function": "tests.agent_handlers:broken_undo"})):
        journal_call(lease, "effect", {"n": seq}, compensation=compensation)
        record_call_result(lease, seq, ok=True, output={"n": seq})
    assert cancel_agent_run(community.id, run_id) == Cancelled(run_id)
    assert unwind_with_a_worker(community) == "compensation_failed"
    assert run_of(run_id).state == "cancelled"
    assert compensation_statuses(run_id) == [None, "compensation_failed"]
    assert ran(run_id) == []  # the chain stopped at 2: 1 was never undone


@pytest.mark.django_db
def test_a_run_waiting_for_an_approval_past_its_timeout_expires_it_compensates_and_ends_timeout(community):
    from buzz_delivery.agents.services import request_approval
    from buzz_delivery.workflows.models import Approval

    lease = with_calls(community, 2, timeout_seconds=60)
    approval = request_approval(lease, prompt="go?")
    pass_timeout(lease.run_id)
    result = reap_agent_runs()
    assert (result.approvals_expired, result.unwinding) == (1, 1)
    assert Approval.objects.get(id=approval.approval_id).state == "expired"
    row = run_of(lease.run_id)
    assert (row.state, row.unwinding, row.failure_code) == ("pending", True, "timeout")
    assert reap_agent_runs().total == 0
    assert unwind_with_a_worker(community) == "compensated"
    assert run_of(lease.run_id).state == "timeout"
    assert ran(lease.run_id) == [2, 1]


@pytest.mark.django_db
@pytest.mark.parametrize("end", ["cancel", "exhausted"])
def test_a_call_pending_when_the_run_is_sent_to_unwind_is_marked_uncertain_and_compensated(community, end):
    lease = with_calls(community, 1, max_attempts=1)
    assert journal_call(lease, "effect", {"n": 2}, compensation=COUNTED).seq == 2  # the holder dies mid-call
    if end == "cancel":
        cancel_agent_run(community.id, lease.run_id)
    else:
        backdate_run_lease(lease.run_id)
        assert reap_agent_runs().unwinding == 1
    assert unwind_with_a_worker(community) == "compensated"
    assert run_of(lease.run_id).state == ("cancelled" if end == "cancel" else "failed")
    entries = JournalEntry.objects.filter(run_id=lease.run_id).order_by("seq")
    assert [(e.status, e.uncertain, e.compensation_status) for e in entries] == [
        ("succeeded", False, "compensated"),
        ("failed", True, "compensated"),
    ]
    assert ran(lease.run_id) == [2, 1]


@pytest.mark.django_db
def test_a_compensation_runs_as_the_login_role_with_its_community_like_a_handler(community):
    """User code in a compensation keeps the login's grants on the project's own tables (it
    could not write them as the tenant role: the demo's compensation was refused) and sees its
    community as context, as a handler does."""
    lease = with_calls(community, n=1, compensation={"function": "tests.agent_handlers:undo_as_login"})
    assert cancel_agent_run(community.id, lease.run_id) == Cancelled(lease.run_id)
    assert unwind_with_a_worker(community) == "compensated"
    (line,) = [x for x in h.ledger_lines() if x.startswith("role ")]
    assert line == f"role {lease.run_id}:1:compensate:True:{community.id}"
