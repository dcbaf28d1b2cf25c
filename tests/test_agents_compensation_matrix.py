"""The compensation matrix (issue 28): every way a run can end with its calls succeeded, or with
one still pending (in flight when the run ended), leaves each effect undone once, in reverse
order (the pending call, the last journaled, first), and no journal entry ``pending``."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, transaction

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import (
    Cancelled,
    cancel_agent_run,
    claim_agent_runs,
    journal_call,
    reap_agent_runs,
)
from tests import agent_handlers as h
from tests.agents_support import AGENT, backdate_run_lease, make_claimable, new_run
from tests.test_agents_compensation import COUNTED, ran, with_calls

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_LEDGER", str(tmp_path / "ledger.txt"))
    monkeypatch.delenv("AGENT_KILL", raising=False)


def tool(args: dict, key: str) -> dict:
    return {"n": args["n"]}


def interrupted(args: dict, key: str) -> dict:
    raise KeyboardInterrupt  # the handler stops mid-call: the entry is left pending


def unstorable(args: dict, key: str) -> object:
    return {"made": object()}  # the call happened; its result cannot be stored


def reconcile_raises(args: dict, key: str) -> Any:
    raise ConnectionError("the tool's status API is down")


def handler(k: int, last: str | None = None):
    """Calls 1..k succeed; then ``last`` decides how the handler ends."""

    def run(ctx):
        for n in range(1, k + 1):
            ctx.call("effect", tool, {"n": n}, compensate=h.counted_undo)
        if last == "interrupted":
            ctx.call("effect", interrupted, {"n": k + 1}, compensate=h.counted_undo)
        elif last == "unstorable":
            ctx.call("effect", unstorable, {"n": k + 1}, compensate=h.counted_undo)
        elif last == "reconcile":
            ctx.call("effect", tool, {"n": k + 1}, compensate=h.counted_undo, reconcile=reconcile_raises)
        elif last == "error":
            raise ValueError("the handler gave up")
        elif last == "left_open":
            transaction.atomic().__enter__()
        return {"done": k}

    return run


def drain(community) -> list[str]:
    """Claim and run whatever is claimable (an unwinding run's compensations)."""
    results = []
    while claims := claim_agent_runs(community.id, [AGENT], worker_id="w2", lease_seconds=30):
        results.append(run_claim(claims[0], handler(0, "error")))
    return results


def end_from_outside(community, lease, end: str) -> None:
    if end == "cancel":
        assert cancel_agent_run(community.id, lease.run_id) == Cancelled(lease.run_id)
    elif end == "timeout":
        with connection.cursor() as cursor:
            cursor.execute("UPDATE buzz_agents_run SET timeout_at = now() - interval '1 second' WHERE id = %s",
                           [lease.run_id])  # fmt: skip
        reap_agent_runs()
    else:  # exhausted: the last attempt's lease lapses
        backdate_run_lease(lease.run_id)
        reap_agent_runs()


END_STATE = {
    "cancel": ("cancelled", "cancelled"),
    "timeout": ("timeout", "timeout"),
    "exhausted": ("failed", "attempts_exhausted"),
    "interrupted": ("failed", "handler_aborted"),
    "unstorable": ("failed", "tool_call_failed"),
    "reconcile": ("failed", "uncertain_call"),
    "error": ("failed", "handler_error"),
    "left_open": ("failed", "transaction_left_open"),
}


def assert_undone_once_in_reverse(run_id, calls: int, end: str) -> None:
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == END_STATE[end], run.failure_message
    assert ran(run_id) == list(range(calls, 0, -1))  # each once, the last journaled first
    entries = JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    assert len(entries) == calls
    assert [e.compensation_status for e in entries] == ["compensated"] * calls
    assert "pending" not in [e.status for e in entries]


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("end", ["cancel", "timeout", "exhausted"])
def test_a_run_ended_from_outside_with_a_call_in_flight_undoes_it_first_then_the_others(community, end, k):
    lease = with_calls(community, k, max_attempts=1)
    assert journal_call(lease, "effect", {"n": k + 1}, compensation=COUNTED).seq == k + 1  # its holder is mid-call

    end_from_outside(community, lease, end)
    drain(community)

    assert_undone_once_in_reverse(lease.run_id, k + 1, end)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("end", ["cancel", "timeout", "exhausted"])
def test_a_run_ended_from_outside_with_its_calls_succeeded_undoes_each_once_in_reverse(community, end, k):
    lease = with_calls(community, k, max_attempts=1)

    end_from_outside(community, lease, end)
    drain(community)

    assert_undone_once_in_reverse(lease.run_id, k, end)


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("end", ["interrupted", "unstorable"])
def test_a_handler_that_ends_with_a_call_in_flight_undoes_it_first_then_the_others(community, end, k):
    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w1", lease_seconds=30)

    assert run_claim(claimed, handler(k, end)) == "compensated"

    assert_undone_once_in_reverse(run_id, k + 1, end)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_a_reconcile_hook_that_raises_makes_the_pending_call_uncertain_and_undoes_it_first(community, k):
    lease = with_calls(community, k, max_attempts=3)
    journal_call(lease, "effect", {"n": k + 1}, compensation=COUNTED)  # the holder dies mid-call
    backdate_run_lease(lease.run_id)
    assert reap_agent_runs().reclaimed == 1
    make_claimable(lease.run_id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w2", lease_seconds=30)

    assert run_claim(claimed, handler(k, "reconcile")) == "compensated"

    assert_undone_once_in_reverse(lease.run_id, k + 1, "reconcile")
    entry = JournalEntry.objects.get(run_id=lease.run_id, seq=k + 1)
    assert entry.uncertain and "reconcile hook raised ConnectionError" in entry.error


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("end", ["error", "left_open"])
def test_a_handler_that_fails_after_its_calls_succeeded_undoes_each_once_in_reverse(community, end, k):
    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w1", lease_seconds=30)

    assert run_claim(claimed, handler(k, end)) == "compensated"

    assert_undone_once_in_reverse(run_id, k, end)


@pytest.mark.parametrize("end", ["cancel", "timeout", "exhausted"])
def test_a_call_in_flight_without_a_compensation_is_closed_with_its_run_never_left_pending(community, end):
    run_id = new_run(community.id, max_attempts=1)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w1", lease_seconds=30)
    journal_call(claimed.lease, "effect", {"n": 1})

    end_from_outside(community, claimed.lease, end)

    assert (AgentRun.objects.get(id=run_id).state, drain(community)) == (END_STATE[end][0], [])
    (entry,) = JournalEntry.objects.filter(run_id=run_id)
    assert (entry.status, entry.uncertain) == ("failed", True)
