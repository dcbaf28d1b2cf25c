"""The agent runtime in one process (SPEC 12 "Runtime", "Resume"): replay, reconcile,
uncertain calls, compensation through the runtime, shadow mode, approvals, budgets."""

from __future__ import annotations

import pytest

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import claim_agent_runs, journal_call, reap_agent_runs
from buzz_delivery.workflows.services import decide_approval
from tests import agent_handlers as h
from tests.agents_support import AGENT, backdate_run_lease, make_claimable, new_run

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_LEDGER", str(tmp_path / "ledger.txt"))
    monkeypatch.delenv("AGENT_KILL", raising=False)


def claim_one(community, worker="w"):
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id=worker, lease_seconds=30)
    return claimed


def journal(run_id):
    return list(
        JournalEntry.objects.filter(run_id=run_id).order_by("seq").values_list("seq", "status", "compensation_status")
    )


def test_a_handler_runs_its_calls_through_the_journal_and_completes(community):
    run_id = new_run(community.id)
    assert run_claim(claim_one(community), h.three_calls) == "completed"
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.output["sum"], run.tool_calls_used) == ("completed", 6, 3)
    assert journal(run_id) == [(1, "succeeded", None), (2, "succeeded", None), (3, "succeeded", None)]
    assert h.ledger_lines() == [f"call {run_id}:{n}" for n in (1, 2, 3)]


def test_a_resumed_run_replays_succeeded_calls_and_reconciles_the_pending_one(community):
    run_id = new_run(community.id)
    claimed = claim_one(community)
    lease = claimed.lease
    from buzz_delivery.agents.services import record_call_result

    journal_call(lease, "effect", {"n": 1}, compensation={"function": "tests.agent_handlers:undo"})
    h.effect({"n": 1}, f"{run_id}:1")
    record_call_result(lease, 1, ok=True, output={"n": 1})
    journal_call(lease, "effect", {"n": 2}, compensation={"function": "tests.agent_handlers:undo"})
    h.effect({"n": 2}, f"{run_id}:2")  # made, but its holder 'crashed' before recording
    backdate_run_lease(run_id)
    reap_agent_runs()
    make_claimable(run_id)
    assert run_claim(claim_one(community, "w2"), h.three_calls) == "completed"
    assert h.ledger_lines() == [f"call {run_id}:{n}" for n in (1, 2, 3)]  # none made twice
    entries = JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    assert [(e.seq, e.status, e.generation, e.result_generation) for e in entries] == [
        (1, "succeeded", 1, 1),
        (2, "succeeded", 1, 3),
        (3, "succeeded", 3, 3),
    ]


def test_a_pending_call_without_reconcile_is_uncertain_and_compensated_with_the_others(community):
    run_id = new_run(community.id)
    lease = claim_one(community).lease
    from buzz_delivery.agents.services import record_call_result

    journal_call(lease, "effect", {"n": 1}, compensation={"function": "tests.agent_handlers:undo"})
    record_call_result(lease, 1, ok=True, output={"n": 1})
    journal_call(lease, "effect", {"n": 2}, compensation={"function": "tests.agent_handlers:undo"})
    backdate_run_lease(run_id)
    reap_agent_runs()
    make_claimable(run_id)
    assert run_claim(claim_one(community, "w2"), h.three_calls_no_reconcile) == "compensated"
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == ("failed", "uncertain_call")
    assert journal(run_id) == [(1, "succeeded", "compensated"), (2, "failed", "compensated")]
    assert h.ledger_lines() == [f"undo {run_id}:2:compensate", f"undo {run_id}:1:compensate"]


def test_a_run_failing_at_call_4_undoes_3_2_1_in_that_order_once_each(community):
    run_id = new_run(community.id)
    assert run_claim(claim_one(community), h.four_calls_fail) == "compensated"
    undos = [line for line in h.ledger_lines() if line.startswith("undo")]
    assert undos == [f"undo {run_id}:{n}:compensate" for n in (3, 2, 1)]
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == ("failed", "tool_call_failed")
    assert journal(run_id) == [
        (1, "succeeded", "compensated"),
        (2, "succeeded", "compensated"),
        (3, "succeeded", "compensated"),
        (4, "failed", None),
    ]


def test_a_failing_compensation_stops_the_chain_and_is_visible(community, monkeypatch):
    monkeypatch.setattr(h, "undo", h.broken_undo)
    run_id = new_run(community.id)
    assert run_claim(claim_one(community), h.four_calls_fail) == "compensation_failed"
    assert journal(run_id)[:3] == [
        (1, "succeeded", None),
        (2, "succeeded", None),
        (3, "succeeded", "compensation_failed"),
    ]
    entry = JournalEntry.objects.get(run_id=run_id, seq=3)
    assert "refund API is down" in entry.compensation_error
    assert AgentRun.objects.get(id=run_id).state == "failed"


def test_shadow_mode_blocks_destructive_calls_and_records_why(community):
    run_id = new_run(community.id, shadow=True)

    def handler(ctx):
        made = ctx.call("drop_table", h.effect, {"n": 1}, destructive=True)
        read = ctx.call("read", h.effect, {"n": 2})
        return {"made": made, "read": read}

    assert run_claim(claim_one(community), handler) == "completed"
    assert AgentRun.objects.get(id=run_id).output == {"made": None, "read": {"n": 2}}
    assert h.ledger_lines() == [f"call {run_id}:2"]
    assert JournalEntry.objects.get(run_id=run_id, seq=1).blocked_reason.startswith("shadow mode")


def test_a_budget_refusal_fails_the_run_with_nothing_journaled_for_it(community):
    run_id = new_run(community.id, max_tool_calls=2)
    assert run_claim(claim_one(community), h.noop_three) == "failed"
    run = AgentRun.objects.get(id=run_id)
    assert (run.failure_code, run.tool_calls_used, JournalEntry.objects.filter(run_id=run_id).count()) == (
        "budget_exceeded",
        2,
        2,
    )


def test_an_approval_parks_the_run_and_it_resumes_from_its_journal(community):
    run_id = new_run(community.id)
    assert run_claim(claim_one(community), h.approve_then_call) == "parked"
    assert claim_agent_runs(community.id, [AGENT], worker_id="w") == []
    run = AgentRun.objects.get(id=run_id)
    decide_approval(community.id, run.approval_id, "approved", "alice")
    assert run_claim(claim_one(community, "w2"), h.approve_then_call) == "completed"
    run.refresh_from_db()
    assert run.output == {"decision": "approved", "calls": [1, 2]}
    assert h.ledger_lines() == [f"call {run_id}:1", f"resumed {run_id}", f"call {run_id}:3"]


def test_a_rejected_approval_is_handed_to_the_handler(community):
    run_id = new_run(community.id)
    run_claim(claim_one(community), h.approve_then_call)
    decide_approval(community.id, AgentRun.objects.get(id=run_id).approval_id, "rejected", "bob")
    assert run_claim(claim_one(community), h.approve_then_call) == "completed"
    assert AgentRun.objects.get(id=run_id).output == {"decision": "rejected"}


def test_a_handler_that_changes_its_calls_on_replay_fails_the_run(community):
    run_id = new_run(community.id)
    run_claim(claim_one(community), h.approve_then_call)
    decide_approval(community.id, AgentRun.objects.get(id=run_id).approval_id, "approved", "alice")

    def other(ctx):
        ctx.call("something_else", h.effect, {"n": 9})

    assert run_claim(claim_one(community), other) == "compensated"
    assert AgentRun.objects.get(id=run_id).failure_code == "replay_mismatch"


def test_a_stored_compensation_name_is_looked_up_never_imported(community, tmp_path):
    """Issue 27 (critical): a descriptor is data anyone holding the agent's gateway key may have
    journaled. The in-process worker that unwinds the run looks its name up in the registry this
    process declared; an importable but unregistered callable (here ``shutil:rmtree``, which
    takes a compensation's three arguments) is never called: that one compensation fails with
    ``unregistered_compensation``, visibly, and the registered compensation after it still ran."""
    from buzz_delivery.agents.services import fail_run, record_call_result

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("still here")
    run_id = new_run(community.id)
    lease = claim_one(community).lease
    journal_call(lease, "effect", str(victim), compensation={"function": "shutil:rmtree"})
    record_call_result(lease, 1, ok=True, output=None)
    journal_call(lease, "effect", {"n": 2}, compensation={"function": "tests.agent_handlers:not_a_compensation"})
    record_call_result(lease, 2, ok=True, output={"n": 2})
    journal_call(lease, "effect", {"n": 3}, compensation={"function": "tests.agent_handlers:undo"})
    record_call_result(lease, 3, ok=True, output={"n": 3})
    fail_run(lease, "tool_call_failed")  # as a hostile remote holder would, then abandons the lease
    backdate_run_lease(run_id)
    reap_agent_runs()
    make_claimable(run_id)

    assert run_claim(claim_one(community, "in-process"), h.three_calls) == "compensation_failed"
    assert (victim / "keep.txt").read_text() == "still here"
    assert not any(line.startswith("forbidden") for line in h.ledger_lines())
    assert h.ledger_lines() == [f"undo {run_id}:3:compensate"]  # the registered one ran first
    assert journal(run_id) == [
        (1, "succeeded", None),
        (2, "succeeded", "compensation_failed"),
        (3, "succeeded", "compensated"),
    ]
    entry = JournalEntry.objects.get(run_id=run_id, seq=2)
    assert entry.compensation_error.startswith("LookupError: unregistered_compensation: ")
    assert "not_a_compensation" in entry.compensation_error
    assert AgentRun.objects.get(id=run_id).state == "failed"

    # The worker goes on: the community's next run is claimed and completes.
    next_id = new_run(community.id)
    assert run_claim(claim_one(community, "in-process"), h.three_calls) == "completed"
    assert AgentRun.objects.get(id=next_id).state == "completed"


def test_an_unregistered_compensate_is_refused_before_anything_is_journaled(community):
    run_id = new_run(community.id)

    def handler(ctx):
        return ctx.call("effect", h.effect, {"n": 1}, compensate=h.not_a_compensation)

    assert run_claim(claim_one(community), handler) == "failed"
    run = AgentRun.objects.get(id=run_id)
    assert run.failure_code == "handler_error"
    assert "is not a registered compensation" in run.failure_message
    assert journal(run_id) == []
    assert h.ledger_lines() == []
