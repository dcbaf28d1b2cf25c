"""Agent-run approvals through the workflow engine's (SPEC 11 "Approvals", SPEC 12).

The approval is an engine :class:`~buzz_delivery.workflows.models.Approval` without run or
step, decided by the engine's :func:`~buzz_delivery.workflows.services.decide_approval` (and its
admin queue); a trigger of migration ``0002`` answers the run's journal entry and makes the run
claimable again in the deciding transaction. Expiry (either maintenance) makes it unwind.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction

from buzz_delivery.agents.services import sql
from buzz_delivery.agents.services.common import holds, json_value, lease_params, sha256_json
from buzz_delivery.agents.services.journal import budget_or_missed, idempotency_key, scope_params
from buzz_delivery.agents.services.types import (
    AgentLease,
    AlreadyTerminal,
    ApprovalRequested,
    BudgetExceeded,
    CallsInFlight,
    LeaseLost,
)
from buzz_delivery.models import new_uuid7
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, translated_errors
from buzz_delivery.services.tenancy import tenant_scoped
from buzz_delivery.workflows.services.approvals import MAX_DEADLINE_SECONDS


@tenant_scoped
def request_approval(
    lease: AgentLease,
    *,
    prompt: str = "",
    deadline_seconds: int = 86400,
    scope: str = "",
    index: int | None = None,
) -> ApprovalRequested | CallsInFlight | BudgetExceeded | AlreadyTerminal | LeaseLost:
    """In one transaction: the run moves to ``waiting_approval`` and releases its lease (one
    fenced statement that also spends a journal slot), an engine approval is created with
    ``prompt`` (<= 10,000 chars) and a deadline ``deadline_seconds`` (1..30 days) from now
    (database clock), and a journal entry (kind ``approval``) records it. Once decided the run
    is claimable again and the decision is replayed from the journal.

    The run parks only with none of the holder's own tool calls in flight (journaled under its
    generation, not yet recorded): a call's result could not be recorded once the lease is
    released. While one is, nothing is written and the answer is :class:`CallsInFlight` naming
    them (the lease holds: record them, then ask again).

    ``scope`` and ``index``: the entry's replay key, as :func:`~.journal.journal_call`'s.

    Returns :class:`ApprovalRequested`, :class:`CallsInFlight`, :class:`BudgetExceeded`,
    ``AlreadyTerminal`` or ``LeaseLost``. Raises ``ValidationError`` keyed ``lease``, ``prompt`` or
    ``deadline_seconds`` before SQL. SPEC 12 "Approvals"."""
    params = lease_params(
        lease,
        prompt=v.optional_text(prompt, "prompt", 10_000) or "",
        deadline_seconds=v.int_in_range(deadline_seconds, "deadline_seconds", 1, MAX_DEADLINE_SECONDS),
        approval_id=new_uuid7(),
        entry_id=new_uuid7(),
        cost=0,
        **scope_params(scope, index),
    )
    try:
        return _park(params)
    except _InFlight as exc:  # the park rolled back
        return CallsInFlight(exc.seqs)


class _InFlight(Exception):
    def __init__(self, seqs: tuple[int, ...]) -> None:
        self.seqs = seqs


def _park(params: dict[str, Any]) -> ApprovalRequested | CallsInFlight | BudgetExceeded | AlreadyTerminal | LeaseLost:
    with transaction.atomic(), translated_errors():
        rows = fetch_all(sql.PARK_FOR_APPROVAL_IF_CURRENT, params)
        if not rows:
            in_flight = tuple(row[0] for row in fetch_all(sql.CALLS_IN_FLIGHT, params))
            refused = budget_or_missed(params)
            if in_flight and isinstance(refused, LeaseLost) and holds(params):
                return CallsInFlight(in_flight)
            return refused
        in_flight = tuple(row[0] for row in fetch_all(sql.CALLS_IN_FLIGHT, params))
        if in_flight:  # journaled by a transaction that committed while the park waited for the row
            raise _InFlight(in_flight)
        seq = rows[0][0]
        fetch_all(sql.INSERT_AGENT_APPROVAL, params)
        params.update(
            seq=seq,
            idempotency_key=idempotency_key(params["run_id"], seq),
            kind="approval",
            tool_name="approval",
            destructive=False,
            compensation=None,
            status="pending",
            blocked_reason=None,
            error=None,
        )
        params["args"] = json_value({"prompt": params["prompt"]}, "prompt", 100_000)
        params["input_hash"] = sha256_json({"prompt": params["prompt"]})
        fetch_all(sql.INSERT_PENDING_JOURNAL_ENTRY, params)
    return ApprovalRequested(params["approval_id"], seq)
