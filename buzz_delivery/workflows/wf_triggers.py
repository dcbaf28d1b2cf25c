"""Row triggers of the engine's tables (django-pgtrigger), all raising SQLSTATE ``BD003``
(:data:`buzz_delivery.triggers.HISTORY_SQLSTATE`, mapped to ``DeliveryWriteRefused``-style
refusals by the services). The Advance and fan-in triggers are plain SQL in migration 0001
(``0002_keys_and_advance``)."""

from __future__ import annotations

from collections.abc import Sequence

import pgtrigger

from buzz_delivery.triggers import HISTORY_SQLSTATE


def immutable(name: str) -> pgtrigger.Trigger:
    """Refuse every UPDATE: the row is immutable once written."""
    return pgtrigger.Trigger(
        name=name,
        when=pgtrigger.Before,
        operation=pgtrigger.Update,
        func=f"""
            RAISE EXCEPTION USING ERRCODE = '{HISTORY_SQLSTATE}',
                MESSAGE = format('buzz_workflows: %s rows are immutable', TG_TABLE_NAME);
        """,
    )


def terminal_once(name: str, terminal: Sequence[str]) -> pgtrigger.Trigger:
    """Refuse an UPDATE that moves a terminal row to another state (terminal once)."""
    states = ", ".join(f"'{s}'" for s in terminal)
    return pgtrigger.Trigger(
        name=name,
        when=pgtrigger.Before,
        operation=pgtrigger.Update,
        condition=pgtrigger.Condition(f"OLD.state IN ({states}) AND NEW.state IS DISTINCT FROM OLD.state"),
        func=f"""
            RAISE EXCEPTION USING ERRCODE = '{HISTORY_SQLSTATE}',
                MESSAGE = format('buzz_workflows: %s row is %s: a terminal state never changes',
                                 TG_TABLE_NAME, OLD.state);
        """,
    )


def generation_monotonic(name: str) -> pgtrigger.Trigger:
    """Refuse an UPDATE that moves ``lease_generation`` backwards (a fence token is never reused)."""
    return pgtrigger.Trigger(
        name=name,
        when=pgtrigger.Before,
        operation=pgtrigger.Update,
        condition=pgtrigger.Condition("NEW.lease_generation < OLD.lease_generation"),
        func=f"""
            RAISE EXCEPTION USING ERRCODE = '{HISTORY_SQLSTATE}',
                MESSAGE = 'buzz_workflows: lease_generation cannot go back';
        """,
    )
