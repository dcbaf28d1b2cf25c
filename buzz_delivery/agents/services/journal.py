"""The tool-call journal (SPEC 12 "Journal (SAGA)", "Budgets", "Shadow mode").

A call is journaled before it is made, under the run's current lease, by one fenced statement
that spends a journal slot and its cost within the run's budgets (CHECKs and a trigger back it:
a call past a cap is refused as :class:`BudgetExceeded` and nothing is journaled); the entry's
``seq`` is the run's new ``tool_calls_used`` (the order entries were journaled in); a resumed
handler replays an entry by its scope and its index in that scope (``journal_scope``).
Compensations run in reverse ``seq`` order: a statement begins one only for the highest
compensable entry not yet compensated, fenced by the lease.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from buzz_delivery import journal_scope
from buzz_delivery.agents.conf import MAX_COST_UNITS, get_settings
from buzz_delivery.agents.services import sql
from buzz_delivery.agents.services.common import json_value, lease_params, missed, sha256_json
from buzz_delivery.agents.services.types import (
    AgentLease,
    AlreadyRecorded,
    AlreadyTerminal,
    Blocked,
    BudgetExceeded,
    Journaled,
    LeaseLost,
    Recorded,
)
from buzz_delivery.models import new_uuid7
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import atomic_within_bound, fetch_all, translated_errors
from buzz_delivery.services.tenancy import tenant_scoped

SHADOW_REASON = "shadow mode: destructive call not made"
MAX_ARGS_BYTES = 1_000_000


def idempotency_key(run_id: uuid.UUID, seq: int) -> str:
    """The stable key handed to the tool of entry ``seq`` of run ``run_id``."""
    return f"{run_id}:{seq}"


def compensation_key(run_id: uuid.UUID, seq: int) -> str:
    """The stable key of the compensation of entry ``seq`` (its own key, SPEC 12)."""
    return f"{run_id}:{seq}:compensate"


def _tool_name(value: Any) -> str:
    text = v.optional_text(value, "tool_name", 200)
    if not text or not text.strip():
        raise v.invalid("tool_name", "must be 1..200 characters")
    return text


def scope_params(scope: Any, index: Any) -> dict[str, Any]:
    """The replay key of an entry: ``scope`` (text, ``""`` the run's root, at most 200
    characters) and ``index`` (its call's position in the scope, >= 1; None: the entry's seq,
    as every entry journaled before scopes, which only a root-scope caller may pass)."""
    try:
        scope = journal_scope.check_scope(scope)
    except journal_scope.ScopeError as exc:
        raise v.invalid("scope", str(exc)) from None
    if index is None:
        if scope:
            raise v.invalid("index", "a call in a scope other than the root needs its index")
        return {"scope": scope, "scope_index": None}
    return {"scope": scope, "scope_index": v.int_in_range(index, "index", 1, 10**9)}


def budget_or_missed(params: dict[str, Any]) -> BudgetExceeded | AlreadyTerminal | LeaseLost:
    """After a spend matched nothing: a holder whose fence holds was refused by a budget."""
    rows = fetch_all(sql.RUN_AT, params)
    if rows:
        state, generation, worker, used, cap, cost_used, cost_cap, unwinding, current, active = rows[0]
        holds = (
            generation == params["lease_generation"]
            and worker == params["worker_id"]
            and state in ("running", "waiting_tool")  # another call of the holder's may be in flight
            and current
            and active
            and not unwinding
        )
        if holds and used >= cap:
            return BudgetExceeded("tool_calls", used, cap)
        if holds and cost_used + params.get("cost", 0) > cost_cap:
            return BudgetExceeded("cost", cost_used, cost_cap)
    return missed(params)


@tenant_scoped
def journal_call(
    lease: AgentLease,
    tool_name: str,
    args: Any,
    *,
    cost: int = 0,
    compensation: dict[str, Any] | None = None,
    destructive: bool = False,
    scope: str = "",
    index: int | None = None,
) -> Journaled | Blocked | BudgetExceeded | AlreadyTerminal | LeaseLost:
    """Journal a tool call before it is made: entry ``seq`` (contiguous from 1), ``pending``,
    with ``tool_name`` (1..200), the SHA-256 of ``args`` (JSON), ``cost`` (cost units >= 0,
    counted against ``max_cost``), the ``compensation`` descriptor (JSON, e.g.
    ``{"function": "pkg.mod:undo"}``) and the writing generation; the run moves to
    ``waiting_tool``. ``scope`` and ``index``: the entry's replay key, call ``index`` of scope
    ``scope`` (:func:`scope_params`; unique per run: a second entry at the same key is refused,
    ``ValidationError`` keyed ``index``, nothing written). A shadow run's ``destructive`` call is
    journaled ``failed`` with ``blocked_reason`` and the run stays ``running``: :class:`Blocked`,
    do not make it.

    Returns :class:`Journaled`, :class:`Blocked`, :class:`BudgetExceeded` (nothing journaled),
    ``AlreadyTerminal`` or ``LeaseLost`` (a stale or cancelled holder cannot journal). Raises
    ``ValidationError`` keyed by the argument before SQL. SPEC 12 "Journal", "Budgets"."""
    if not isinstance(destructive, bool):
        raise v.invalid("destructive", "must be a bool")
    if compensation is not None and not isinstance(compensation, dict):
        raise v.invalid("compensation", "must be a dict or None")
    params = lease_params(
        lease,
        tool_name=_tool_name(tool_name),
        args=json_value(args, "args", MAX_ARGS_BYTES),
        input_hash=sha256_json(args),
        cost=v.int_in_range(cost, "cost", 0, MAX_COST_UNITS),
        compensation=None if compensation is None else json_value(compensation, "compensation", 100_000),
        destructive=destructive,
        kind="tool",
        approval_id=None,
        entry_id=new_uuid7(),
        **scope_params(scope, index),
    )
    with atomic_within_bound(), translated_errors():
        rows = fetch_all(sql.SPEND_CALL_IF_CURRENT_AND_WITHIN_BUDGET, params)
        if not rows:
            return budget_or_missed(params)
        seq, shadow = rows[0]
        params.update(seq=seq, idempotency_key=idempotency_key(lease.run_id, seq))
        if shadow and destructive:
            params.update(status="failed", blocked_reason=SHADOW_REASON, error="blocked")
            fetch_all(sql.INSERT_ANSWERED_JOURNAL_ENTRY, params)
            return Blocked(seq, SHADOW_REASON)
        params.update(status="pending", blocked_reason=None, error=None)
        fetch_all(sql.INSERT_PENDING_JOURNAL_ENTRY, params)
    return Journaled(seq, params["idempotency_key"])


@tenant_scoped
def record_call_result(
    lease: AgentLease,
    seq: int,
    *,
    ok: bool,
    output: Any = None,
    error: str | None = None,
    latency_ms: int | None = None,
    uncertain: bool = False,
) -> Recorded | AlreadyRecorded | AlreadyTerminal | LeaseLost:
    """Answer pending entry ``seq`` under the current lease: ``succeeded`` with ``output``
    (JSON, its SHA-256 recorded) or ``failed`` with ``error``; ``uncertain=True`` (failed only)
    marks a call whose effect is unknown for compensation. ``latency_ms`` >= 0. The run moves
    back to ``running``. Returns :class:`Recorded`, :class:`AlreadyRecorded` (answered before;
    the answer never changes), ``AlreadyTerminal`` or ``LeaseLost``. Raises ``ValidationError``
    keyed by the argument before SQL. SPEC 12 "Journal"."""
    if not isinstance(ok, bool):
        raise v.invalid("ok", "must be a bool")
    if uncertain and ok:
        raise v.invalid("uncertain", "only a failed call can be uncertain")
    params = lease_params(
        lease,
        seq=v.int_in_range(seq, "seq", 1, 10**9),
        status="succeeded" if ok else "failed",
        uncertain=bool(uncertain),
        output=json_value(output, "output", get_settings().max_output_bytes) if ok else None,
        output_hash=sha256_json(output) if ok else None,
        error=v.optional_text(error, "error", 10_000),
        latency_ms=None if latency_ms is None else v.int_in_range(latency_ms, "latency_ms", 0, 2**31 - 1),
    )
    with atomic_within_bound(), translated_errors():
        rows = fetch_all(sql.RECORD_RESULT_IF_CURRENT, params)
        if rows:
            return Recorded(rows[0][0])
        outcome = missed(params)
        if isinstance(outcome, LeaseLost) and _fence_holds(params):
            entry = fetch_all(sql.ENTRY_STATUS, params)
            if entry:
                return AlreadyRecorded(entry[0][0])
        return outcome


def _loaded(value: Any) -> Any:
    """jsonb read through a raw cursor arrives as text (Django keeps psycopg's loader off)."""
    return json.loads(value) if isinstance(value, str) else value


def _fence_holds(params: dict[str, Any]) -> bool:
    rows = fetch_all(sql.RUN_AT, params)
    if not rows:
        return False
    state, generation, worker, *_, current, active = rows[0]
    return bool(
        generation == params["lease_generation"]
        and worker == params["worker_id"]
        and state in ("running", "waiting_tool")
        and current
        and active
    )


@tenant_scoped
def begin_compensation(lease: AgentLease, seq: int) -> dict[str, Any] | AlreadyTerminal | LeaseLost | None:
    """Begin (or, after a crash, resume) the compensation of entry ``seq`` of an unwinding run:
    allowed only for the highest compensable entry not yet compensated (reverse order, in the
    statement) and under the current lease. Returns the entry's ``{"compensation", "args",
    "output", "key"}`` (``key``: the compensation's own idempotency key), ``None`` when the
    entry is not next (or already done), ``AlreadyTerminal`` or ``LeaseLost``. SPEC 12."""
    params = lease_params(lease, seq=v.int_in_range(seq, "seq", 1, 10**9))
    with atomic_within_bound(), translated_errors():
        rows = fetch_all(sql.BEGIN_COMPENSATION_IF_CURRENT_AND_LAST, params)
        if rows:
            compensation, args, output, _key = rows[0]
            return {
                "compensation": _loaded(compensation),
                "args": _loaded(args),
                "output": _loaded(output),
                "key": compensation_key(lease.run_id, params["seq"]),
            }
        if _fence_holds(params):
            return None
        return missed(params)


@tenant_scoped
def finish_compensation(
    lease: AgentLease, seq: int, *, ok: bool, error: str | None = None
) -> Recorded | AlreadyRecorded | AlreadyTerminal | LeaseLost:
    """Record the compensation of entry ``seq``: ``compensated`` or ``compensation_failed``
    (which stops the chain; ``fail_run`` then ends the run ``failed``), once, under the current
    lease. Returns :class:`Recorded`, :class:`AlreadyRecorded`, ``AlreadyTerminal`` or
    ``LeaseLost``. SPEC 12."""
    if not isinstance(ok, bool):
        raise v.invalid("ok", "must be a bool")
    params = lease_params(
        lease,
        seq=v.int_in_range(seq, "seq", 1, 10**9),
        compensation_status="compensated" if ok else "compensation_failed",
        error=v.optional_text(error, "error", 10_000),
    )
    with atomic_within_bound(), translated_errors():
        rows = fetch_all(sql.FINISH_COMPENSATION_IF_CURRENT, params)
        if rows:
            return Recorded(rows[0][0])
        if _fence_holds(params):
            entry = fetch_all(sql.ENTRY_STATUS, params)
            return AlreadyRecorded(entry[0][1] if entry else "unknown")
        return missed(params)
