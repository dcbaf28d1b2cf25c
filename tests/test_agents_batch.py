"""The batched holder statements of the event-loop worker (issue 29): one statement for many
runs of one community, each row fenced by its own lease and judged on its own, with the outcome
the single form would give."""

from __future__ import annotations

import dataclasses

import pytest

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import (
    AlreadyTerminal,
    BudgetExceeded,
    Finished,
    Journaled,
    LeaseLost,
    Recorded,
    Renewed,
    cancel_agent_run,
    complete_run,
)
from buzz_delivery.agents.services import batch as b
from buzz_delivery.testing import CommunityFactory
from tests.agents_support import claim, new_run

pytestmark = pytest.mark.django_db(transaction=True)


def stale(lease):
    return dataclasses.replace(lease, lease_generation=lease.lease_generation - 1)


def test_one_journal_statement_judges_each_run_as_journal_call_would(community):
    ok, old, capped, ended = (new_run(community.id, max_tool_calls=0 if i == 2 else None) for i in range(4))
    leases = [claim(community.id, run_id) for run_id in (ok, old, capped, ended)]
    assert isinstance(complete_run(leases[3], {"done": True}), Finished)
    calls = [
        b.prepare_call(leases[0], "search", {"q": 1}, cost=2),
        b.prepare_call(stale(leases[1]), "search", {"q": 2}),
        b.prepare_call(leases[2], "search", {"q": 3}),
        b.prepare_call(leases[3], "search", {"q": 4}),
    ]
    outcomes = b.journal_calls(community.id, calls)
    assert outcomes[0] == Journaled(1, f"{ok}:1")
    assert outcomes[1] == LeaseLost()
    assert outcomes[2] == BudgetExceeded("tool_calls", 0, 0)
    assert outcomes[3] == AlreadyTerminal("completed")
    # Only the current holder's call was journaled, with its slot and cost spent.
    assert list(JournalEntry.objects.filter(community_id=community.id).values_list("run_id", "seq", "status")) == [
        (ok, 1, "pending")
    ]
    run = AgentRun.objects.get(id=ok)
    assert (run.state, run.tool_calls_used, run.cost_used) == ("waiting_tool", 1, 2)
    assert AgentRun.objects.get(id=old).tool_calls_used == 0


def test_results_renewals_and_completions_are_batched_and_fenced_per_row(community):
    a, c = new_run(community.id), new_run(community.id)
    la, lc = claim(community.id, a), claim(community.id, c)
    (ja, jc) = b.journal_calls(community.id, [b.prepare_call(la, "t", {}), b.prepare_call(lc, "t", {})])
    assert isinstance(ja, Journaled) and isinstance(jc, Journaled)
    assert cancel_agent_run(community.id, c).__class__.__name__ == "Cancelled"  # c's holder is fenced
    results = b.record_results(
        community.id, [b.prepare_result(la, 1, ok=True, output={"x": 1}), b.prepare_result(lc, 1, ok=True, output={})]
    )
    assert results == [Recorded("succeeded"), LeaseLost("cancelled")]
    renewed = b.heartbeat_runs(community.id, [la, lc], 30)
    assert isinstance(renewed[0], Renewed) and renewed[0].lease.lease_until >= la.lease_until
    assert renewed[1] == LeaseLost("cancelled")
    done = b.complete_runs(community.id, [b.prepare_completion(la, {"ok": 1}), b.prepare_completion(lc, {"ok": 2})])
    assert done == [Finished("completed"), LeaseLost("cancelled")]
    assert AgentRun.objects.get(id=a).output == {"ok": 1}
    assert AgentRun.objects.get(id=c).state == "cancelled" and AgentRun.objects.get(id=c).output is None
    # The true holder's retry of a completion is told apart from a lost lease, as the single form does.
    assert b.complete_runs(community.id, [b.prepare_completion(la, {"ok": 1})]) == [AlreadyTerminal("completed")]


def test_a_batch_refuses_two_items_of_one_run_and_leases_of_another_community(community):
    other_community = CommunityFactory()
    lease = claim(community.id, new_run(community.id))
    with pytest.raises(Exception, match="the same run twice"):
        b.journal_calls(community.id, [b.prepare_call(lease, "t", {}), b.prepare_call(lease, "t", {})])
    with pytest.raises(Exception, match="another community"):
        b.heartbeat_runs(other_community.id, [lease], 30)
    assert JournalEntry.objects.count() == 0


def test_a_journal_batch_that_raises_after_its_write_wrote_nothing_so_its_replay_journals_once(community, monkeypatch):
    """The batch's write and the reads that judge its missed runs are one transaction: a read
    that fails (a statement timeout, a reset connection) after the write leaves nothing, so the
    callers' replay one call at a time (the gateway's batch endpoint, the in-process batcher)
    journals each call, and spends its budget, once."""
    from django.db import OperationalError

    from buzz_delivery.agents.services import journal

    ok, old = new_run(community.id), new_run(community.id)
    lease_ok, lease_old = claim(community.id, ok), claim(community.id, old)
    stale = dataclasses.replace(lease_old, lease_generation=lease_old.lease_generation - 1)
    calls = [b.prepare_call(lease_ok, "search", {"q": 1}, cost=2), b.prepare_call(stale, "search", {"q": 2})]

    def failing_read(params):  # the missed run's read fails after the batch wrote ok's entry
        raise OperationalError("canceling statement due to statement timeout")

    monkeypatch.setattr(journal, "budget_or_missed", failing_read)
    with pytest.raises(OperationalError):
        b.journal_calls(community.id, calls)
    monkeypatch.undo()
    assert not JournalEntry.objects.filter(run_id=ok).exists()
    assert AgentRun.objects.get(id=ok).tool_calls_used == 0

    [b.replay_call(c) for c in calls]
    assert list(JournalEntry.objects.filter(run_id=ok).values_list("seq", flat=True)) == [1]
    run = AgentRun.objects.get(id=ok)
    assert (run.tool_calls_used, run.cost_used) == (1, 2)
