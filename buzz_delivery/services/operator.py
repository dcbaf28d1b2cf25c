"""Operator actions on single deliveries (SPEC section 8), used by the admin.

Each bumps the generation, so whoever holds the delivery is fenced, and each returns
an :class:`OperatorOutcome` instead of raising on a race.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django.db import transaction

from buzz_delivery.models import HOLDER_MAX_CHARS
from buzz_delivery.services import sql
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, retry_deadlocks, translated_errors
from buzz_delivery.services.ending import RecordOutOfStep, end_on_record
from buzz_delivery.services.tenancy import fleet_scoped


@dataclass(frozen=True, slots=True)
class OperatorOutcome:
    """``done`` is True when the row moved; otherwise ``reason`` says why it was skipped."""

    done: bool
    reason: str = ""


def _actor(actor: str | None) -> str:
    return v.optional_text(actor, "actor", HOLDER_MAX_CHARS) or "operator"


@fleet_scoped
def requeue_delivery(
    community_id: uuid.UUID | str, delivery_id: uuid.UUID | str, *, actor: str | None = None
) -> OperatorOutcome:
    """Move a ``failed`` or ``expired`` delivery back to ``pending`` with a fresh attempt count.

    Clears the failure columns and a deadline that has already passed; bumps the generation.
    Skipped (``done=False``) when the row is in another status, gone, or its community is
    not active. ``actor``: who acts (at most 200 characters, e.g. ``operator:alice``), the
    actor of the history entry; None = ``"operator"``."""
    params = {
        "community_id": v.uuid_value(community_id, "community_id"),
        "delivery_id": v.uuid_value(delivery_id, "delivery_id"),
        "actor": _actor(actor),
    }
    # Two statements, one transaction (stage 2): the record back to pending (the fence), then its
    # live queue row, inserted from it.
    with translated_errors(), transaction.atomic():
        rows = fetch_all(sql.REQUEUE_IF_TERMINAL_FAILURE, params)
        if rows and len(fetch_all(sql.INSERT_QUEUE_OF_REQUEUED, params)) != 1:
            raise RecordOutOfStep(f"requeued delivery {params['delivery_id']} got no queue row")
    return OperatorOutcome(True) if rows else OperatorOutcome(False, "not failed/expired, or community not active")


@retry_deadlocks
@fleet_scoped
def force_fail_delivery(
    community_id: uuid.UUID | str,
    delivery_id: uuid.UUID | str,
    *,
    failure_message: str | None = None,
    actor: str | None = None,
) -> OperatorOutcome:
    """End a ``claimed`` delivery as ``failed`` (``failure_code`` ``operator_force_failed``).

    Bumps the generation: the current holder's renew and finish get ``LeaseLost``. Skipped
    (``done=False``) when the row is not claimed, gone, or its community is not active.
    ``actor``: as for :func:`requeue_delivery`.

    Its lock order is the queue row's, then the workflow run's (the record's triggers count the
    failure in the run); an agent accepting the same delivery takes them in the other order (the
    run first, as the engine does): a deadlock's victim runs again (``retry_deadlocks``), fenced,
    and finds the delivery settled or force-failed."""
    params = {
        "community_id": v.uuid_value(community_id, "community_id"),
        "delivery_id": v.uuid_value(delivery_id, "delivery_id"),
        "failure_message": v.optional_text(failure_message, "failure_message", 10_000),
        "actor": _actor(actor),
    }
    # Two statements, one transaction (stage 2): the claimed queue row deleted (the fence), then
    # its final state written on the record.
    with translated_errors(), transaction.atomic():
        params["now"] = fetch_all(sql.READ_DB_NOW, {})[0][0]
        ended = fetch_all(sql.FORCE_FAIL_IF_CLAIMED, params)
        rows = end_on_record(sql.END_FORCE_FAILED, params["community_id"], params["now"], ended, actor=params["actor"])
    return OperatorOutcome(True) if rows else OperatorOutcome(False, "not claimed, or community not active")
