"""Row triggers of the agent tables (django-pgtrigger), raising SQLSTATE ``BD003``
(:data:`buzz_delivery.triggers.HISTORY_SQLSTATE`). The journal sequence check, the fan-in back
to the workflow and the approval resume are plain SQL in migration ``0002``."""

from __future__ import annotations

import pgtrigger

from buzz_delivery.triggers import HISTORY_SQLSTATE


def _refuse(message: str) -> str:
    return f"RAISE EXCEPTION USING ERRCODE = '{HISTORY_SQLSTATE}', MESSAGE = {message};"


def counters_step_by_one() -> pgtrigger.Trigger:
    """The run's ``tool_calls_used`` moves by 0 or +1 per update and ``cost_used`` never goes
    back: the journal's contiguous sequence and the budgets cannot be skipped or refunded."""
    return pgtrigger.Trigger(
        name="ag_run_counters_step_by_one",
        when=pgtrigger.Before,
        operation=pgtrigger.Update,
        condition=pgtrigger.Condition(
            "NEW.tool_calls_used NOT IN (OLD.tool_calls_used, OLD.tool_calls_used + 1) OR NEW.cost_used < OLD.cost_used"
        ),
        func=_refuse("'buzz_agents: tool_calls_used moves by one and cost_used never goes back'"),
    )


def compensation_forward_only() -> pgtrigger.Trigger:
    """Compensation status: NULL -> compensating -> compensated | compensation_failed, once."""
    return pgtrigger.Trigger(
        name="ag_journal_compensation_forward_only",
        when=pgtrigger.Before,
        operation=pgtrigger.Update,
        condition=pgtrigger.Condition(
            "NEW.compensation_status IS DISTINCT FROM OLD.compensation_status AND NOT ("
            "(OLD.compensation_status IS NULL AND NEW.compensation_status = 'compensating') OR "
            "(OLD.compensation_status = 'compensating' AND NEW.compensation_status IN "
            "('compensated', 'compensation_failed')))"
        ),
        func=_refuse(
            "format('buzz_agents: compensation cannot move from %s to %s', "
            "OLD.compensation_status, NEW.compensation_status)"
        ),
    )


def journal_identity_immutable() -> pgtrigger.Trigger:
    """What was journaled before the call (run, seq, tool, key, input, compensation descriptor,
    the writing generation) never changes."""
    cols = (
        "run_id",
        "seq",
        "kind",
        "tool_name",
        "idempotency_key",
        "input_hash",
        "args",
        "cost",
        "destructive",
        "compensation",
        "generation",
    )
    changed = " OR ".join(f"NEW.{c} IS DISTINCT FROM OLD.{c}" for c in cols)
    return pgtrigger.Trigger(
        name="ag_journal_identity_immutable",
        when=pgtrigger.Before,
        operation=pgtrigger.Update,
        condition=pgtrigger.Condition(changed),
        func=_refuse("'buzz_agents: a journal entry''s call identity is immutable'"),
    )


def status_once() -> pgtrigger.Trigger:
    """A journal entry is answered once: ``succeeded``/``failed`` never change."""
    return pgtrigger.Trigger(
        name="ag_journal_status_once",
        when=pgtrigger.Before,
        operation=pgtrigger.Update,
        condition=pgtrigger.Condition(
            "OLD.status IN ('succeeded', 'failed') AND NEW.status IS DISTINCT FROM OLD.status"
        ),
        func=_refuse("format('buzz_agents: journal entry is %s: an answer never changes', OLD.status)"),
    )
