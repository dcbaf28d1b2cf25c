"""Agent-run services (SPEC section 12) in one process: start, fences, journal, budgets,
compensation order, approvals, cancel and the reaper."""

from __future__ import annotations

import uuid

import pytest
from django.core.exceptions import ValidationError
from django.db import DatabaseError, connection, transaction

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import (
    Accepted,
    AlreadyRecorded,
    AlreadyTerminal,
    ApprovalRequested,
    Blocked,
    BudgetExceeded,
    Cancelled,
    Duplicate,
    Finished,
    IdempotencyConflict,
    Journaled,
    LeaseLost,
    NotFound,
    Recorded,
    Renewed,
    Unwinding,
    accept_delivery,
    begin_compensation,
    cancel_agent_run,
    claim_agent_runs,
    complete_run,
    fail_run,
    finish_compensation,
    heartbeat,
    intake_event,
    journal_call,
    reap_agent_runs,
    record_call_result,
    request_approval,
)
from buzz_delivery.agents.services import sql as agents_sql
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import Expr, advance_to, random32, set_delivery_state
from buzz_delivery.workflows.models import Approval
from buzz_delivery.workflows.services import Decided, decide_approval
from tests.agents_support import (
    AGENT,
    backdate_run_lease,
    claim,
    counts,
    delivery_lease,
    make_claimable,
    new_run,
)

pytestmark = pytest.mark.django_db


def run_of(run_id):
    return AgentRun.objects.get(id=run_id)


# --- start -------------------------------------------------------------------------------


def test_accept_delivery_settles_the_delivery_and_creates_its_run_in_one_transaction(run):
    lease = delivery_lease(run)
    outcome = accept_delivery(lease, input={"extra": 1}, max_tool_calls=5)
    assert isinstance(outcome, Accepted)
    agent_run = run_of(outcome.run_id)
    delivery = WorkflowAgentDelivery.objects.get(id=lease.delivery_id)
    assert delivery.status == "finished"
    assert (agent_run.state, agent_run.delivery_id, agent_run.source_run_id) == ("pending", delivery.id, run.id)
    assert agent_run.source_step_key == delivery.step_id and bytes(agent_run.agent_pubkey) == AGENT
    assert agent_run.input["extra"] == 1 and agent_run.input["delivery_id"] == str(delivery.id)
    assert len(bytes(agent_run.input_hash)) == 32 and agent_run.max_tool_calls == 5


def test_the_true_holders_retried_accept_is_already_terminal_and_creates_nothing(run):
    lease = delivery_lease(run)
    assert isinstance(accept_delivery(lease), Accepted)
    before = counts()
    assert accept_delivery(lease) == AlreadyTerminal("finished")
    assert counts() == before


def test_a_stale_delivery_holder_cannot_accept(run):
    lease = delivery_lease(run)
    set_delivery_state(  # a reap: generation + 1
        lease.delivery_id,
        status="pending",
        lease_until=None,
        claimed_at=None,
        lease_generation=Expr("lease_generation + 1"),
    )
    before = counts()
    assert isinstance(accept_delivery(lease), LeaseLost)
    assert counts() == before


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"input": [1]}, "input"),
        ({"max_tool_calls": -1}, "max_tool_calls"),
        ({"max_cost": "x"}, "max_cost"),
        ({"timeout_seconds": 0}, "timeout_seconds"),
        ({"shadow": "yes"}, "shadow"),
    ],
)
def test_accept_delivery_refuses_bad_input_by_name_and_writes_nothing(run, kwargs, field):
    lease = delivery_lease(run)
    before = counts()
    with pytest.raises(ValidationError) as info:
        accept_delivery(lease, **kwargs)
    assert field in info.value.message_dict
    assert counts() == before
    assert WorkflowAgentDelivery.objects.get(id=lease.delivery_id).status == "claimed"


def test_intake_is_created_once_duplicate_for_same_payload_and_conflict_for_another(community):
    first = intake_event(community.id, "slack", "ev-1", {"text": "hi"}, AGENT)
    assert intake_event(community.id, "slack", "ev-1", {"text": "hi"}, AGENT) == Duplicate(first.run_id)
    before = counts()
    assert intake_event(community.id, "slack", "ev-1", {"text": "bye"}, AGENT) == IdempotencyConflict(first.run_id)
    assert counts() == before
    assert run_of(first.run_id).input == {"text": "hi"}


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("not-a-uuid", "slack", "e", {}, AGENT), "community_id"),
        ((None, " ", "e", {}, AGENT), "channel_type"),
        ((None, "slack", "", {}, AGENT), "provider_event_id"),
        ((None, "slack", "e", {"x": float("nan")}, AGENT), "payload"),
        ((None, "slack", "e", {}, b"short"), "agent_pubkey"),
    ],
)
def test_intake_refuses_bad_input_by_name_and_writes_nothing(community, args, field):
    args = (args[0] if args[0] is not None else community.id, *args[1:])
    before = counts()
    with pytest.raises(ValidationError) as info:
        intake_event(*args)
    assert field in info.value.message_dict
    assert counts() == before


# --- fences: the stale-holder matrix ----------------------------------------------------------


def stale_and_true(community):
    """A run claimed by w1, reclaimed by the reaper and claimed again by w2."""
    run_id = new_run(community.id)
    stale = claim(community.id, run_id, "w1")
    backdate_run_lease(run_id)
    assert reap_agent_runs().reclaimed == 1
    make_claimable(run_id)
    return stale, claim(community.id, run_id, "w2")


def test_a_claim_returns_each_run_as_the_orm_reads_it_after_the_claim_with_its_history_deferred(community):
    """The claim is one statement: each claimed run is built from the row it returned, with
    every column (JSON decoded, timestamps aware) equal to a fresh ORM read of the run."""
    first = new_run(community.id, timeout_seconds=600)
    second = new_run(community.id, shadow=True, max_cost=7)
    claims = claim_agent_runs(community.id, [AGENT], worker_id="w1", limit=5, lease_seconds=30)
    assert [c.lease.run_id for c in claims] == [first, second]
    for c in claims:
        fresh = run_of(c.lease.run_id)
        assert c.run.get_deferred_fields() == {"history"}
        for field in AgentRun._meta.concrete_fields:
            if field.name != "history":
                assert getattr(c.run, field.attname) == getattr(fresh, field.attname), field.name
        assert c.run.state == "running" and c.run.lease_generation == c.lease.lease_generation
        assert c.run.lease_until == c.lease.lease_until and c.run.worker_id == "w1"
        assert c.run.history == fresh.history  # deferred: read on demand, as before
    assert claims[0].run.input == run_of(first).input and claims[0].run.timeout_at is not None
    columns = {f.column for f in AgentRun._meta.concrete_fields} - {"history"}
    assert set(agents_sql.CLAIMED_RUN_COLUMNS) == columns  # a new column is returned by the claim too


def test_a_reclaimed_holder_can_neither_heartbeat_journal_record_complete_fail_nor_compensate(community):
    stale, true = stale_and_true(community)
    assert true.lease_generation == stale.lease_generation + 2  # the reap, then the claim
    before = counts()
    assert isinstance(heartbeat(stale), LeaseLost)
    assert isinstance(journal_call(stale, "t", {}), LeaseLost)
    assert isinstance(record_call_result(stale, 1, ok=True), LeaseLost)
    assert isinstance(complete_run(stale, {}), LeaseLost)
    assert isinstance(fail_run(stale, "x"), LeaseLost)
    assert isinstance(begin_compensation(stale, 1), LeaseLost)
    assert isinstance(finish_compensation(stale, 1, ok=True), LeaseLost)
    assert isinstance(request_approval(stale), LeaseLost)
    assert counts() == before
    assert isinstance(heartbeat(true), Renewed)
    assert complete_run(true, {"ok": 1}) == Finished("completed")
    assert complete_run(true, {"ok": 1}) == AlreadyTerminal("completed")
    assert isinstance(complete_run(stale, {"ok": 1}), LeaseLost)  # never told of the newer settlement


def test_the_same_generation_with_another_worker_id_is_not_the_holder(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id, "w1")
    from dataclasses import replace

    forged = replace(lease, worker_id="w2")
    assert isinstance(heartbeat(forged), LeaseLost)
    assert isinstance(journal_call(forged, "t", {}), LeaseLost)


def test_a_cancelled_holder_learns_it_at_its_next_heartbeat_and_can_do_nothing(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    assert journal_call(lease, "t", {"a": 1}) == Journaled(1, f"{run_id}:1")
    assert cancel_agent_run(community.id, run_id, reason="operator") == Cancelled(run_id)
    assert heartbeat(lease) == LeaseLost("cancelled")
    assert isinstance(record_call_result(lease, 1, ok=True), LeaseLost)
    assert isinstance(journal_call(lease, "t", {}), LeaseLost)
    assert isinstance(complete_run(lease, {}), LeaseLost)
    assert isinstance(begin_compensation(lease, 1), LeaseLost)
    assert run_of(run_id).state == "cancelled"
    assert cancel_agent_run(community.id, run_id) == AlreadyTerminal("cancelled")
    assert cancel_agent_run(community.id, uuid.uuid4()) == NotFound()


def test_a_lapsed_lease_is_refused_even_before_the_reaper_runs(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    backdate_run_lease(run_id)
    assert isinstance(heartbeat(lease), LeaseLost)
    assert isinstance(journal_call(lease, "t", {}), LeaseLost)
    assert isinstance(complete_run(lease, {}), LeaseLost)


def test_a_fenced_community_refuses_every_holder_transition(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    advance_to(community, "quiescing")
    assert isinstance(heartbeat(lease), LeaseLost)
    assert isinstance(journal_call(lease, "t", {}), LeaseLost)
    assert isinstance(complete_run(lease, {}), LeaseLost)
    assert claim_agent_runs(community.id, [AGENT], worker_id="w") == []


# --- journal and budgets -----------------------------------------------------------------------


def test_calls_are_journaled_before_and_answered_after_with_hashes_and_the_writing_generation(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    assert journal_call(lease, "search", {"q": "x"}, cost=3) == Journaled(1, f"{run_id}:1")
    assert run_of(run_id).state == "waiting_tool"
    assert record_call_result(lease, 1, ok=True, output={"hits": 2}, latency_ms=12) == Recorded("succeeded")
    assert record_call_result(lease, 1, ok=False, error="late") == AlreadyRecorded("succeeded")
    entry = JournalEntry.objects.get(run_id=run_id, seq=1)
    assert (entry.status, entry.output, entry.latency_ms, entry.generation) == (
        "succeeded",
        {"hits": 2},
        12,
        lease.lease_generation,
    )
    assert len(bytes(entry.input_hash)) == 32 and len(bytes(entry.output_hash)) == 32
    agent_run = run_of(run_id)
    assert (agent_run.state, agent_run.tool_calls_used, agent_run.cost_used) == ("running", 1, 3)


def test_a_call_past_the_tool_call_cap_is_refused_and_nothing_is_journaled(community):
    run_id = new_run(community.id, max_tool_calls=2)
    lease = claim(community.id, run_id)
    for seq in (1, 2):
        assert isinstance(journal_call(lease, "t", {"n": seq}), Journaled)
        record_call_result(lease, seq, ok=True, output=None)
    before = counts()
    assert journal_call(lease, "t", {"n": 3}) == BudgetExceeded("tool_calls", 2, 2)
    assert counts() == before and run_of(run_id).tool_calls_used == 2


def test_a_call_past_the_cost_cap_is_refused_and_nothing_is_journaled(community):
    run_id = new_run(community.id, max_cost=10)
    lease = claim(community.id, run_id)
    assert isinstance(journal_call(lease, "t", {}, cost=7), Journaled)
    record_call_result(lease, 1, ok=True)
    before = counts()
    assert journal_call(lease, "t", {}, cost=4) == BudgetExceeded("cost", 7, 10)
    assert counts() == before


def test_raw_sql_cannot_overspend_a_budget_nor_journal_out_of_sequence(community):
    run_id = new_run(community.id, max_tool_calls=1, max_cost=5)
    statements = [
        "UPDATE buzz_agents_run SET tool_calls_used = 2 WHERE id = %(id)s",
        "UPDATE buzz_agents_run SET tool_calls_used = 1, cost_used = 6 WHERE id = %(id)s",
        "UPDATE buzz_agents_run SET max_tool_calls = -1 WHERE id = %(id)s",
        # seq 1 without spending the slot (the run's counter is 0)
        "INSERT INTO buzz_agents_journal (id, community_id, run_id, seq, kind, tool_name, idempotency_key,"
        " input_hash, cost, destructive, status, uncertain, generation)"
        " VALUES (gen_random_uuid(), %(c)s, %(id)s, 1, 'tool', 't', 'k', decode(repeat('00', 32), 'hex'), 0,"
        " false, 'pending', false, 0)",
    ]
    for statement in statements:
        with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(statement, {"id": run_id, "c": community.id})
    with transaction.atomic(), connection.cursor() as cursor:  # spent, then seq 2 skips 1
        cursor.execute("UPDATE buzz_agents_run SET tool_calls_used = 1 WHERE id = %s", [run_id])
    with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(statements[3].replace(", 1, 'tool'", ", 2, 'tool'"), {"id": run_id, "c": community.id})
    assert JournalEntry.objects.filter(run_id=run_id).count() == 0


def test_shadow_runs_journal_destructive_calls_as_blocked_and_make_the_others(community):
    run_id = new_run(community.id, shadow=True)
    lease = claim(community.id, run_id)
    assert journal_call(lease, "delete_repo", {"r": 1}, destructive=True) == Blocked(
        1, "shadow mode: destructive call not made"
    )
    assert isinstance(journal_call(lease, "read", {}), Journaled)
    entry = JournalEntry.objects.get(run_id=run_id, seq=1)
    assert (entry.status, entry.blocked_reason, entry.destructive) == (
        "failed",
        "shadow mode: destructive call not made",
        True,
    )


def test_journal_call_refuses_bad_input_by_name_and_writes_nothing(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    before = counts()
    for kwargs, field in [
        ({"tool_name": " ", "args": {}}, "tool_name"),
        ({"tool_name": "t", "args": {1, 2}}, "args"),
        ({"tool_name": "t", "args": {}, "cost": -1}, "cost"),
        ({"tool_name": "t", "args": {}, "compensation": "undo"}, "compensation"),
    ]:
        with pytest.raises(ValidationError) as info:
            journal_call(lease, **kwargs)
        assert field in info.value.message_dict
    with pytest.raises(ValidationError) as info:
        journal_call("lease", "t", {})
    assert "lease" in info.value.message_dict
    assert counts() == before


# --- compensation ---------------------------------------------------------------------------------


def three_compensable_calls(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    for seq in (1, 2, 3):
        journal_call(lease, f"tool{seq}", {"n": seq}, compensation={"function": "x:undo"})
        record_call_result(lease, seq, ok=True, output={"n": seq})
    return run_id, lease


def test_fail_run_unwinds_in_reverse_order_each_once_and_then_ends_failed(community):
    run_id, lease = three_compensable_calls(community)
    assert fail_run(lease, "call_4_failed") == Unwinding((3, 2, 1))
    assert begin_compensation(lease, 1) is None  # not next: 3 first
    assert begin_compensation(lease, 2) is None
    for seq in (3, 2, 1):
        began = begin_compensation(lease, seq)
        assert began["key"] == f"{run_id}:{seq}:compensate" and began["args"] == {"n": seq}
        assert finish_compensation(lease, seq, ok=True) == Recorded("compensated")
        assert begin_compensation(lease, seq) is None  # once
    assert isinstance(complete_run(lease, {}), LeaseLost)  # an unwinding run cannot complete
    assert fail_run(lease, "call_4_failed") == Finished("failed")
    statuses = list(JournalEntry.objects.filter(run_id=run_id).values_list("seq", "compensation_status"))
    assert statuses == [(1, "compensated"), (2, "compensated"), (3, "compensated")]
    assert run_of(run_id).failure_code == "call_4_failed"


def test_a_failing_compensation_stops_the_chain_and_the_run_ends_failed(community):
    run_id, lease = three_compensable_calls(community)
    fail_run(lease, "boom")
    begin_compensation(lease, 3)
    finish_compensation(lease, 3, ok=True)
    begin_compensation(lease, 2)
    assert finish_compensation(lease, 2, ok=False, error="refund api down") == Recorded("compensation_failed")
    assert fail_run(lease, "boom") == Finished("failed")
    statuses = dict(JournalEntry.objects.filter(run_id=run_id).values_list("seq", "compensation_status"))
    assert statuses == {1: None, 2: "compensation_failed", 3: "compensated"}


def test_raw_sql_cannot_move_a_compensation_backwards(community):
    run_id, lease = three_compensable_calls(community)
    fail_run(lease, "boom")
    begin_compensation(lease, 3)
    finish_compensation(lease, 3, ok=True)
    with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_agents_journal SET compensation_status = 'compensating', compensated_at = NULL"
            " WHERE run_id = %s AND seq = 3",
            [run_id],
        )
    with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("UPDATE buzz_agents_journal SET status = 'pending' WHERE run_id = %s AND seq = 3", [run_id])


# --- approvals -------------------------------------------------------------------------------------


def test_a_run_waiting_for_approval_holds_no_lease_and_resumes_once_decided(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    requested = request_approval(lease, prompt="ship it?", deadline_seconds=600)
    assert isinstance(requested, ApprovalRequested) and requested.seq == 1
    waiting = run_of(run_id)
    assert (waiting.state, waiting.lease_until, waiting.claimed_at) == ("waiting_approval", None, None)
    assert claim_agent_runs(community.id, [AGENT], worker_id="w2") == []
    assert isinstance(heartbeat(lease), LeaseLost)
    approval = Approval.objects.get(id=requested.approval_id)
    assert (approval.state, approval.run_id, approval.step_id) == ("pending", None, None)
    assert isinstance(decide_approval(community.id, approval.id, "approved", "alice"), Decided)
    entry = JournalEntry.objects.get(run_id=run_id, seq=1)
    # What the agent reads back names no operator (issue 27); the run's history, the operators', does.
    assert (entry.kind, entry.status, entry.output) == (
        "approval",
        "succeeded",
        {"decision": "approved", "decided_by": "operator"},
    )
    again = claim(community.id, run_id, "w2")
    assert again.lease_generation == lease.lease_generation + 1
    assert claim_agent_runs(community.id, [AGENT], worker_id="w3") == []


def test_an_expired_approval_makes_the_run_unwind_and_fail(community):
    run_id, lease = three_compensable_calls(community)
    requested = request_approval(lease, deadline_seconds=1)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_workflows_approval SET requested_at = now() - interval '2 hours',"
            " deadline_at = now() - interval '1 hour' WHERE id = %s",
            [requested.approval_id],
        )
    assert reap_agent_runs().approvals_expired == 1
    agent_run = run_of(run_id)
    assert (agent_run.state, agent_run.unwinding, agent_run.failure_code) == ("pending", True, "approval_expired")
    lease2 = claim(community.id, run_id, "w2")
    assert fail_run(lease2, "approval_expired") == Unwinding((3, 2, 1))


def test_cancel_expires_the_pending_approval(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    requested = request_approval(lease)
    assert cancel_agent_run(community.id, run_id) == Cancelled(run_id)
    assert Approval.objects.get(id=requested.approval_id).state == "expired"
    assert run_of(run_id).state == "cancelled"


# --- reaper -----------------------------------------------------------------------------------------


def test_lapsed_leases_are_reclaimed_with_an_attempt_until_exhausted(community):
    run_id = new_run(community.id, max_attempts=2)
    claim(community.id, run_id)
    backdate_run_lease(run_id)
    assert reap_agent_runs().reclaimed == 1
    reclaimed = run_of(run_id)
    assert (reclaimed.state, reclaimed.attempts, reclaimed.lease_until) == ("pending", 1, None)
    assert reclaimed.next_attempt_at is not None
    assert claim_agent_runs(community.id, [AGENT], worker_id="w") == []  # backoff gate
    make_claimable(run_id)
    claim(community.id, run_id)
    backdate_run_lease(run_id)
    assert reap_agent_runs().exhausted == 1
    assert (run_of(run_id).state, run_of(run_id).failure_code) == ("failed", "attempts_exhausted")


def test_timeout_at_ends_the_run_timeout(community):
    run_id = new_run(community.id, timeout_seconds=60)
    lease = claim(community.id, run_id)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE buzz_agents_run SET timeout_at = now() - interval '1 second' WHERE id = %s", [run_id])
    assert reap_agent_runs().timed_out == 1
    assert run_of(run_id).state == "timeout"
    assert isinstance(heartbeat(lease), LeaseLost)


def test_the_reaper_skips_fenced_communities_and_reaps_healthy_ones(community):
    from buzz_delivery.testing import CommunityFactory

    other = CommunityFactory()
    fenced_run, healthy_run = new_run(community.id), new_run(other.id)
    claim(community.id, fenced_run)
    claim(other.id, healthy_run)
    backdate_run_lease(fenced_run)
    backdate_run_lease(healthy_run)
    advance_to(community, "quiescing")
    assert reap_agent_runs().reclaimed == 1
    assert (run_of(fenced_run).state, run_of(healthy_run).state) == ("running", "pending")


def test_raw_sql_cannot_leave_a_terminal_state_or_move_the_generation_back(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    complete_run(lease, {"x": 1})
    for statement in (
        "UPDATE buzz_agents_run SET state = 'pending', finished_at = NULL, output_hash = NULL WHERE id = %s",
        "UPDATE buzz_agents_run SET lease_generation = 0 WHERE id = %s",
    ):
        with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(statement, [run_id])


def test_agent_keys_lead_with_community_id():
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT t.relname, pg_get_constraintdef(c.oid) FROM pg_constraint c JOIN pg_class t ON t.oid = c.conrelid
               WHERE t.relname LIKE 'buzz_agents_%%' AND c.contype IN ('p', 'u', 'f')"""
        )
        rows = cursor.fetchall()
    assert rows
    for table, definition in rows:
        if definition.startswith("FOREIGN KEY (community_id) REFERENCES buzz_delivery_community"):
            continue
        assert "(community_id," in definition, (table, definition)


def test_random32_is_not_the_default_agent():
    assert random32() != AGENT


# --- bad input on the other services ---------------------------------------------------------------


def test_the_other_services_refuse_bad_input_by_name_and_write_nothing(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    before = counts()
    cases = [
        (lambda: claim_agent_runs(community.id, [], worker_id="w"), "agent_pubkeys"),
        (lambda: claim_agent_runs(community.id, [b"x"], worker_id="w"), "agent_pubkeys[0]"),
        (lambda: claim_agent_runs(community.id, [AGENT], worker_id=" "), "worker_id"),
        (lambda: claim_agent_runs(community.id, [AGENT], worker_id="w", limit=0), "limit"),
        (lambda: claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=0), "lease_seconds"),
        (lambda: heartbeat(lease, lease_seconds=-1), "lease_seconds"),
        (lambda: heartbeat(None), "lease"),
        (lambda: record_call_result(lease, 0, ok=True), "seq"),
        (lambda: record_call_result(lease, 1, ok="yes"), "ok"),
        (lambda: record_call_result(lease, 1, ok=True, uncertain=True), "uncertain"),
        (lambda: record_call_result(lease, 1, ok=True, latency_ms=-5), "latency_ms"),
        (lambda: complete_run(lease, {"x": object()}), "output"),
        (lambda: fail_run(lease, ""), "failure_code"),
        (lambda: request_approval(lease, deadline_seconds=0), "deadline_seconds"),
        (lambda: request_approval(lease, prompt=5), "prompt"),
        (lambda: cancel_agent_run("nope", run_id), "community_id"),
        (lambda: cancel_agent_run(community.id, "nope"), "run_id"),
        (lambda: reap_agent_runs(batch_size=0), "batch_size"),
    ]
    for call, field in cases:
        with pytest.raises(ValidationError) as info:
            call()
        assert field in info.value.message_dict, (field, info.value.message_dict)
    assert counts() == before
    assert run_of(run_id).state == "running"


def test_the_engine_reaper_leaves_an_overdue_agent_approval_to_the_agents_reaper(community):
    """An agent's approval has no workflow run (``run_id`` and ``step_id`` NULL). The engine's
    reaper once took it for one of its own and sorted its NULL run id with a real one: a
    TypeError stopped every pass in that community (found by the demo, issue 17)."""
    from buzz_delivery.testing import WorkflowFactory
    from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
    from buzz_delivery.workflows.testing import DefinitionVersionFactory, RunFactory

    run_id, lease = three_compensable_calls(community)
    requested = request_approval(lease, deadline_seconds=1)
    workflow_run = RunFactory(version=DefinitionVersionFactory(workflow=WorkflowFactory(community=community)))
    with connection.cursor() as cursor:  # both overdue: the agent's approval and the workflow run
        cursor.execute(
            "UPDATE buzz_workflows_approval SET requested_at = now() - interval '2 hours',"
            " deadline_at = now() - interval '1 hour' WHERE id = %s",
            [requested.approval_id],
        )
        cursor.execute(
            "UPDATE buzz_workflows_run SET deadline_at = now() - interval '1 second' WHERE run_id = %s",
            [workflow_run.pk],
        )

    engine = reap_workflow_steps()

    assert engine.runs_timed_out == 1 and engine.approvals_expired == 0
    assert Approval.objects.get(id=requested.approval_id).state == "pending"
    assert reap_agent_runs().approvals_expired == 1
    assert Approval.objects.get(id=requested.approval_id).state == "expired"
    assert run_of(run_id).failure_code == "approval_expired"
