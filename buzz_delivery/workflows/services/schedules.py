"""Cron schedules (SPEC section 11 via issue 12): one run per slot, exactly once.

A schedule's slots come from its cron expression (``croniter``, UTC, minute resolution). The
maintenance walks the communities with due schedules (one read), then per community one short
transaction: the community's fence lock tried (never waited on), its due schedules locked with
``FOR UPDATE SKIP LOCKED`` (a second, overlapping maintenance run skips them), one run started
per slot to start with ``Cause.schedule(slot)`` and the idempotency key
``schedule:<id>:<slot>`` (so even a second start of the same slot returns the first run), and
``next_slot_at`` moved past the database clock with a compare-and-set on its old value.

Missed slots (the maintenance did not run for a while): ``latest`` starts only the most recent
due slot and counts the others as missed; ``all`` starts every due slot, oldest first, at most
:data:`MAX_SLOTS_PER_PASS` per schedule and pass.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from dataclasses import dataclass
from typing import Any

from croniter import croniter
from django.core.exceptions import ValidationError
from django.db import OperationalError, transaction

from buzz_delivery.models import Workflow
from buzz_delivery.services import Cause
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import bound_lock_waits, fetch_all, lock_wait_timed_out, translated_errors
from buzz_delivery.services.sql import DB_NOW, TRY_WRITE_FENCE
from buzz_delivery.services.tenancy import fleet_scoped, tenant_scoped
from buzz_delivery.workflows.models import MissedSlots, Schedule
from buzz_delivery.workflows.services.common import json_argument
from buzz_delivery.workflows.services.runs import start_run
from buzz_delivery.workflows.services.sql import ACTIVE, COMMUNITY

MAX_SLOTS_PER_PASS = 100
SCHEDULE = "buzz_workflows_schedule"

DB_CLOCK = f"SELECT {DB_NOW}"
DUE_COMMUNITIES = f"""
SELECT c.id FROM {COMMUNITY} AS c
WHERE c.deletion_state = 'active' AND EXISTS (
    SELECT 1 FROM {SCHEDULE} AS s WHERE s.community_id = c.id AND s.enabled AND s.next_slot_at <= {DB_NOW}
)
ORDER BY c.id LIMIT %(limit)s
"""
LOCK_DUE_SCHEDULES = f"""
SELECT s.id, s.workflow_id, s.cron, s.input, s.missed, s.next_slot_at FROM {SCHEDULE} AS s
WHERE s.community_id = %(community_id)s AND s.enabled AND s.next_slot_at <= {DB_NOW}
ORDER BY s.next_slot_at, s.id
LIMIT %(limit)s
FOR UPDATE OF s SKIP LOCKED
"""
MOVE_NEXT_SLOT = f"""
UPDATE {SCHEDULE} AS s SET next_slot_at = %(next_slot_at)s
WHERE s.community_id = %(community_id)s AND s.id = %(id)s AND s.next_slot_at = %(old_slot_at)s AND {ACTIVE}
RETURNING s.id
"""


@dataclass
class ScheduleResult:
    """One pass: runs started, slots missed (``latest`` policy), schedules whose start failed
    (e.g. no published definition; their slot is skipped), communities skipped as busy."""

    started: int = 0
    missed: int = 0
    failed: int = 0
    skipped_busy: int = 0


def _slots_after(cron: str, after: dt.datetime, until: dt.datetime, limit: int) -> list[dt.datetime]:
    it = croniter(cron, after)
    out: list[dt.datetime] = []
    while len(out) < limit:
        slot = it.get_next(dt.datetime)
        if slot > until:
            break
        out.append(slot)
    return out


def _next_slot(cron: str, after: dt.datetime) -> dt.datetime:
    return croniter(cron, after).get_next(dt.datetime)  # type: ignore[no-any-return]


@tenant_scoped
def create_schedule(
    community_id: uuid.UUID | str,
    workflow_id: uuid.UUID | str,
    cron: str,
    *,
    input: dict[str, Any] | None = None,
    missed: str = MissedSlots.LATEST,
) -> Schedule:
    """Create a cron schedule (5-field expression, UTC) for a workflow of the community; its
    first slot is the first one after now (database clock). ``input``: the runs' input (a JSON
    object); ``missed``: ``latest`` or ``all`` (see the module docstring).

    Raises ``ValidationError`` keyed ``community_id``, ``workflow_id``, ``cron``, ``input`` or
    ``missed`` before anything is written; ``CommunityNotWritable`` for a community not active."""
    community = v.uuid_value(community_id, "community_id")
    workflow = v.uuid_value(workflow_id, "workflow_id")
    if not isinstance(cron, str) or len(cron.split()) != 5 or not croniter.is_valid(cron):
        raise v.invalid("cron", f"must be a 5-field cron expression, got {cron!r}")
    value = {} if input is None else input
    if not isinstance(value, dict):
        raise v.invalid("input", "must be a JSON object")
    value = json.loads(json_argument(value, "input"))
    if missed not in MissedSlots.values:
        raise v.invalid("missed", f"must be one of {', '.join(MissedSlots.values)}, got {missed!r}")
    if not Workflow.objects.filter(community_id=community, id=workflow).exists():
        raise v.invalid("workflow_id", "no such workflow in this community")
    with transaction.atomic(), translated_errors():
        now = fetch_all(DB_CLOCK, {})[0][0]
        return Schedule.objects.create(
            community_id=community,
            workflow_id=workflow,
            cron=cron,
            input=value,
            missed=missed,
            next_slot_at=_next_slot(cron, now),
        )


def slot_key(schedule_id: Any, slot: dt.datetime) -> str:
    """The idempotency key of a schedule's slot: ``schedule:<id>:<UTC ISO second>``."""
    return f"schedule:{schedule_id}:{slot.astimezone(dt.UTC):%Y-%m-%dT%H:%M:%SZ}"


def _one_community(community: Any, limit: int, result: ScheduleResult) -> None:
    batch = ScheduleResult()
    try:
        _one_community_batch(community, limit, batch)
    except OperationalError as exc:  # a row held past the lock_timeout: this community waits a pass
        if not lock_wait_timed_out(exc):
            raise
        result.skipped_busy += 1
        return
    result.started += batch.started
    result.missed += batch.missed
    result.failed += batch.failed
    result.skipped_busy += batch.skipped_busy


def _one_community_batch(community: Any, limit: int, result: ScheduleResult) -> None:
    with transaction.atomic(), translated_errors():
        bound_lock_waits()
        if not fetch_all(TRY_WRITE_FENCE, {"community_id": community})[0][0]:
            result.skipped_busy += 1
            return
        now = fetch_all(DB_CLOCK, {})[0][0]
        for sid, workflow, cron, input_value, missed, next_slot in fetch_all(
            LOCK_DUE_SCHEDULES, {"community_id": community, "limit": limit}
        ):
            later = _slots_after(cron, next_slot, now, MAX_SLOTS_PER_PASS)
            slots = [next_slot, *later][:MAX_SLOTS_PER_PASS]
            if missed == MissedSlots.LATEST:
                result.missed += len(slots) - 1
                slots = slots[-1:]
            for slot in slots:
                try:
                    start_run(
                        community,
                        workflow,
                        json.loads(input_value) if isinstance(input_value, str) else input_value,
                        cause=Cause.schedule(slot),
                        idempotency_key=slot_key(sid, slot),
                    )
                    result.started += 1
                except ValidationError:
                    result.failed += 1
            fetch_all(
                MOVE_NEXT_SLOT,
                {
                    "community_id": community,
                    "id": sid,
                    "old_slot_at": next_slot,
                    "next_slot_at": _next_slot(cron, max(now, slots[-1])),
                },
            )


@fleet_scoped
def start_due_schedules(*, batch_size: int = 100, max_communities: int = 100) -> ScheduleResult:
    """Start the runs of every due slot of every active community's enabled schedules, exactly
    once per slot (see the module docstring). ``batch_size``: schedules per community
    transaction (1..10,000). Returns a :class:`ScheduleResult`. Raises ``ValidationError``
    keyed ``batch_size``/``max_communities``."""
    size = v.int_in_range(batch_size, "batch_size", 1, 10_000)
    limit = v.int_in_range(max_communities, "max_communities", 1, 10_000)
    result = ScheduleResult()
    for (community,) in fetch_all(DUE_COMMUNITIES, {"limit": limit}):
        _one_community(community, size, result)
    return result
