"""Approvals (SPEC section 11 "Approvals"): requested under a step lease, decided once."""

from __future__ import annotations

import json
import uuid

from django.db import transaction

from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.models import new_uuid7
from buzz_delivery.services import AlreadyTerminal, LeaseLost, Settled
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, retry_deadlocks, translated_errors
from buzz_delivery.services.tenancy import tenant_scoped
from buzz_delivery.workflows.exceptions import ApprovalNotFound
from buzz_delivery.workflows.models import Approval
from buzz_delivery.workflows.services import sql
from buzz_delivery.workflows.services.common import community_active
from buzz_delivery.workflows.services.runs import expire_deliveries_of_ended_runs
from buzz_delivery.workflows.services.steps import park_step_returning_deadline
from buzz_delivery.workflows.services.types import (
    AlreadyDecided,
    ApprovalRequested,
    Decided,
    DecideOutcome,
    Expired,
    StepLease,
)

DECISIONS = {"approved": "approved", "approve": "approved", "rejected": "rejected", "reject": "rejected"}
MAX_DEADLINE_SECONDS = 30 * 86400


@tenant_scoped
def request_approval(
    lease: StepLease, *, deadline_seconds: int, prompt: str = ""
) -> ApprovalRequested | AlreadyTerminal | LeaseLost:
    """In one transaction: release the holder's step lease, park the step ``waiting`` until
    ``deadline_seconds`` (1..30 days) from now (database clock), and create its pending
    :class:`Approval` (one per step attempt; the holder's repeat returns the same approval).

    Returns :class:`ApprovalRequested`, ``AlreadyTerminal(state)`` or ``LeaseLost``. Raises
    ``ValidationError`` keyed ``lease``, ``deadline_seconds`` or ``prompt`` before SQL. SPEC 11.
    """
    if not isinstance(lease, StepLease):
        raise v.invalid("lease", f"must be a StepLease, not {type(lease).__name__}")
    seconds = v.int_in_range(deadline_seconds, "deadline_seconds", 1, MAX_DEADLINE_SECONDS)
    text = v.optional_text(prompt, "prompt", 10_000) or ""
    with transaction.atomic(), translated_errors():
        outcome, deadline = park_step_returning_deadline(lease, wait_seconds=seconds)
        if not isinstance(outcome, Settled):
            return outcome
        if deadline is not None:
            fetch_all(
                sql.INSERT_APPROVAL,
                {
                    "id": new_uuid7(),
                    "community_id": lease.community_id,
                    "run_id": lease.run_id,
                    "step_id": lease.step_id,
                    "lease_generation": lease.lease_generation,
                    "prompt": text,
                    "wait_deadline": deadline,
                },
            )
        approval = Approval.objects.get(
            community_id=lease.community_id, step_id=lease.step_id, step_generation=lease.lease_generation
        )
    return ApprovalRequested(approval)


# A deadlock's victim runs again and answers the winner's outcome: deciding an agent's approval
# takes the approval, then (its trigger) the agent run; a workflow cancel's trigger takes the
# agent run, then the approval (agents migration 0017).
@retry_deadlocks
@tenant_scoped
def decide_approval(
    community_id: uuid.UUID | str, approval_id: uuid.UUID | str, decision: str, decided_by: str
) -> DecideOutcome:
    """Decide a pending approval once, before its deadline (database clock), and in the same
    transaction move its waiting step on exactly once: ``approved`` -> the step ``succeeded``
    (output ``{"decision", "decided_by"}``); ``rejected`` -> the step ``failed``
    (``approval_rejected``) and its ``on_error`` applies.

    ``decision``: ``approved``/``approve`` or ``rejected``/``reject``; ``decided_by``: 1..200
    characters (who decided). Returns :class:`Decided`, :class:`AlreadyDecided` (who decided
    first, and what) or :class:`Expired` (deadline passed, or the run ended first).

    Raises ``ValidationError`` keyed ``community_id``, ``approval_id``, ``decision`` or
    ``decided_by`` before SQL; :class:`ApprovalNotFound`;
    :class:`~buzz_delivery.exceptions.CommunityNotWritable` when the community is not active.
    SPEC section 11 "Approvals".
    """
    community = v.uuid_value(community_id, "community_id")
    approval = v.uuid_value(approval_id, "approval_id")
    if decision not in DECISIONS:
        raise v.invalid("decision", f"must be 'approved' or 'rejected', got {decision!r}")
    who = v.optional_text(decided_by, "decided_by", 200)
    if not who or not who.strip():
        raise v.invalid("decided_by", "must name who decided")
    params = {
        "community_id": community,
        "approval_id": approval,
        "decision": DECISIONS[decision],
        "decided_by": who,
    }
    with transaction.atomic(), translated_errors():
        run = fetch_all(sql.APPROVAL_RUN, params)
        if not run:
            raise ApprovalNotFound(f"no approval {approval} in community {community}")
        fetch_all(sql.LOCK_RUN, {**params, "run_id": run[0][0]})
        rows = fetch_all(sql.DECIDE_IF_PENDING, params)
        if rows:
            step_id, generation, closed_at = rows[0]
            resume = {
                **params,
                "step_id": step_id,
                "step_generation": generation,
                "output": json.dumps({"decision": params["decision"], "decided_by": who}),
                "failure_message": f"rejected by {who}",
            }
            statement = sql.RESUME_STEP_APPROVED if params["decision"] == "approved" else sql.RESUME_STEP_REJECTED
            fetch_all(statement, resume)
            expire_deliveries_of_ended_runs(community, [run[0][0]])
            return Decided(DECISIONS[decision], who, closed_at)
        state, by, closed_at, deadline_at = fetch_all(sql.APPROVAL_STATE, params)[0]
    if state in ("approved", "rejected"):
        return AlreadyDecided(state, by, closed_at)
    if state == "pending" and not community_active(community):
        raise CommunityNotWritable(f"community {community} is not active; its approvals cannot be decided")
    return Expired(deadline_at)
