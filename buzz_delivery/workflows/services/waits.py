"""Engine waits (SPEC 16 "Engine waits"): ``sleep`` and ``wait_event`` steps, and ``send_event``.

A waiting step holds no lease: its holder parks it ``waiting`` (one fenced statement, as
``send_message`` does) with ``wait_deadline`` (a sleep's wake time, a wait's timeout) and
``on_timeout``; what ends the wait is one fenced UPDATE of the waiting step, and the Advance
trigger counts it in the same transaction, as for every other path:

- ``send_event(community_id, name, key, payload)`` records the event under (name, key) and ends,
  with the payload as output, every step then waiting for it (:data:`RESUME_WAITING_FOR_EVENT`);
- a ``wait_event`` step that starts while an event of its (name, key) is kept
  (``BUZZ_WORKFLOWS['EVENT_RETENTION_SECONDS']`` after the send's last statement, judged as
  of the wait's start) takes it at once;
- the maintenance, and the orchestrator's poll (:func:`end_due_waits`), end the waits whose
  deadline passed (database clock): a sleep wakes (``succeeded``, output null), a wait that
  timed out does what its ``on_timeout`` says (``fail``: ``wait_timeout``; ``continue``:
  ``succeeded`` with a null output; ``skip_dependents``: ``skipped``).

A send and a starting wait meet on the (name, key) row of ``buzz_workflows_sent_event``, taken
first (``INSERT ... ON CONFLICT DO UPDATE``: a row lock, not an advisory one, SPEC 15): the wait
sees the event, or the send sees the waiting step, never neither. Then, as on every path that
ends steps, the runs are locked (in id order) before the steps. A step is resumed once: the
UPDATE re-checks ``waiting`` and the event it waits for under the run's lock, so a cancel or a
second send that came first leaves it alone.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from dataclasses import dataclass
from typing import Any

from django.db import OperationalError, transaction

from buzz_delivery.models import new_uuid7
from buzz_delivery.services import Settled
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, translated_errors
from buzz_delivery.services.sql import DB_NOW
from buzz_delivery.services.tenancy import fleet_scoped, tenant_scoped
from buzz_delivery.workflows.conf import get_settings
from buzz_delivery.workflows.definition import EVENT_NAME, MAX_EVENT_KEY_CHARS, MAX_WAIT_SECONDS
from buzz_delivery.workflows.services import sql
from buzz_delivery.workflows.services.common import json_argument
from buzz_delivery.workflows.services.sql import (
    ACTIVE,
    COMMUNITY,
    CURRENT_STEP_LEASE,
    LOCK_FREE_RUNS,
    LOCK_RUNS,
    LOCK_RUNS_AND_CORE,
    SENT_EVENT,
    STEP,
    step_entry,
)
from buzz_delivery.workflows.services.steps import _lease, _missed, _params
from buzz_delivery.workflows.services.types import StepLease, StepOutcome

_PARK = f"""state = 'waiting', lease_until = NULL, claimed_at = NULL, waiting_since = {DB_NOW}"""

PARK_SLEEP_FOR = f"""
UPDATE {STEP} AS s
SET {_PARK}, wait_deadline = {DB_NOW} + make_interval(secs => %(seconds)s), on_timeout = 'continue',
    {step_entry("'sleep'", "s.lease_generation", "s.claimed_by", status="'waiting'", renewals="s.renewals")}
WHERE {CURRENT_STEP_LEASE}
RETURNING s.state
"""

PARK_SLEEP_UNTIL = f"""
UPDATE {STEP} AS s
SET {_PARK}, wait_deadline = %(until)s::timestamptz, on_timeout = 'continue',
    {step_entry("'sleep'", "s.lease_generation", "s.claimed_by", status="'waiting'", renewals="s.renewals")}
WHERE {CURRENT_STEP_LEASE}
RETURNING s.state
"""

IS_PAST = f"SELECT %(until)s::timestamptz <= {DB_NOW}"

# The (name, key) row, created empty if no event was sent under it, and locked either way.
LOCK_EVENT_KEY = f"""
INSERT INTO {SENT_EVENT} AS e (id, community_id, name, key, sends, resumed)
VALUES (%(id)s, %(community_id)s, %(name)s, %(key)s, 0, 0)
ON CONFLICT (community_id, name, key) DO UPDATE SET name = EXCLUDED.name
RETURNING e.payload, e.expires_at
"""
# Whether the kept event is live is judged against the wait's start (WAIT_STARTS, the database
# clock before the wait met the row lock), not when the wait takes it: a send that held the row
# while the wait waited committed an event the wait must take (the send did not see the step
# waiting), whatever the retention and however long the wait then waits for its run. (Read by a
# statement of its own: Citus refuses a now()-like call in a write's RETURNING.)
WAIT_STARTS = f"SELECT {DB_NOW}"

PARK_FOR_EVENT = f"""
UPDATE {STEP} AS s
SET {_PARK}, wait_deadline = {DB_NOW} + make_interval(secs => %(wait_seconds)s),
    event_name = %(name)s, event_key = %(key)s, on_timeout = %(on_timeout)s,
    {step_entry("'wait_event'", "s.lease_generation", "s.claimed_by", status="'waiting'", renewals="s.renewals")}
WHERE {CURRENT_STEP_LEASE}
RETURNING s.state
"""

TAKE_KEPT_EVENT = f"""
UPDATE {STEP} AS s
SET state = 'succeeded', output = %(payload)s::jsonb, lease_until = NULL, claimed_at = NULL, finished_at = {DB_NOW},
    event_name = %(name)s, event_key = %(key)s, failure_code = NULL, failure_message = NULL,
    {step_entry("'event'", "s.lease_generation", "s.claimed_by", status="'succeeded'", renewals="s.renewals")}
WHERE {CURRENT_STEP_LEASE}
RETURNING s.state
"""

COUNT_RESUMED = f"""
UPDATE {SENT_EVENT} AS e SET resumed = e.resumed + %(n)s
WHERE e.community_id = %(community_id)s AND e.name = %(name)s AND e.key = %(key)s
"""

# A send's last statement: the event is kept for the retention from now, the end of the send's
# transaction, not from its first statement. A wait that started while the send held the row
# (after its first statement, before its commit) then finds it live however long the send took
# (its lock waits for runs, its batches): what is left uncovered is the commit itself, which
# MIN_EVENT_RETENTION_SECONDS (workflows/checks.py) covers many times over.
KEEP_SENT_EVENT = f"""
UPDATE {SENT_EVENT} AS e SET resumed = e.resumed + %(n)s, expires_at = {DB_NOW} + make_interval(secs => %(retention)s)
WHERE e.community_id = %(community_id)s AND e.name = %(name)s AND e.key = %(key)s
RETURNING e.expires_at
"""

# The event: kept under its (name, key) (a later one replaces it) until expires_at.
SEND_EVENT = f"""
INSERT INTO {SENT_EVENT} AS e (id, community_id, name, key, payload, sent_at, expires_at, sends, resumed)
VALUES (%(id)s, %(community_id)s, %(name)s, %(key)s, %(payload)s::jsonb, {DB_NOW},
        {DB_NOW} + make_interval(secs => %(retention)s), 1, 0)
ON CONFLICT (community_id, name, key) DO UPDATE
SET payload = EXCLUDED.payload, sent_at = EXCLUDED.sent_at, expires_at = EXCLUDED.expires_at, sends = e.sends + 1
RETURNING e.expires_at
"""

WAITING_FOR_EVENT = f"""
SELECT s.id, s.run_id FROM {STEP} AS s
WHERE s.community_id = %(community_id)s AND s.state = 'waiting'
  AND s.event_name = %(name)s AND s.event_key = %(key)s
ORDER BY s.run_id, s.id
LIMIT %(limit)s
"""

RESUME_WAITING_FOR_EVENT = f"""
UPDATE {STEP} AS s
SET state = 'succeeded', output = %(payload)s::jsonb, wait_deadline = NULL, finished_at = {DB_NOW},
    {step_entry("'event'", "s.lease_generation", "%(actor)s::text", status="'succeeded'")}
WHERE s.community_id = %(community_id)s AND s.id = ANY(%(ids)s) AND s.state = 'waiting'
  AND s.event_name = %(name)s AND s.event_key = %(key)s AND {ACTIVE}
RETURNING s.id
"""

# --- the waits whose deadline passed (the maintenance and the orchestrator's poll) ---------

WAIT_OVER = f"s.state = 'waiting' AND s.wait_deadline < {DB_NOW}"

DUE_WAITS = f"""
SELECT s.id, s.run_id FROM {STEP} AS s
WHERE s.community_id = %(community_id)s AND {WAIT_OVER} AND s.on_timeout IS NOT NULL
ORDER BY s.id LIMIT %(limit)s
"""

# Active communities only: the waits of another cannot end (each UPDATE below requires it active),
# so they stay due, and as many such communities as the limit would hide every active one.
COMMUNITIES_WITH_DUE_WAITS = f"""
SELECT DISTINCT s.community_id FROM {STEP} AS s
JOIN {COMMUNITY} AS c ON c.id = s.community_id AND c.deletion_state = 'active'
WHERE {WAIT_OVER} AND s.on_timeout IS NOT NULL
LIMIT %(limit)s
"""

# A sleep that is due, and a wait_event under on_timeout "continue": succeeded, output null.
CONTINUE_DUE_WAITS = f"""
UPDATE {STEP} AS s SET state = 'succeeded', wait_deadline = NULL, finished_at = {DB_NOW},
    {step_entry("'wake'", "s.lease_generation", "%(actor)s::text", status="'succeeded'")}
WHERE s.community_id = %(community_id)s AND s.id = ANY(%(ids)s) AND {WAIT_OVER}
  AND s.on_timeout = 'continue' AND {ACTIVE}
RETURNING s.kind
"""

SKIP_DUE_WAITS = f"""
UPDATE {STEP} AS s SET state = 'skipped', skip_reason = 'wait_timeout', wait_deadline = NULL,
    finished_at = {DB_NOW},
    {step_entry("'timeout'", "s.lease_generation", "%(actor)s::text", status="'skipped'")}
WHERE s.community_id = %(community_id)s AND s.id = ANY(%(ids)s) AND {WAIT_OVER}
  AND s.on_timeout = 'skip_dependents' AND {ACTIVE}
RETURNING s.id
"""

FAIL_DUE_WAITS = f"""
UPDATE {STEP} AS s SET state = 'failed', failure_code = 'wait_timeout',
    failure_message = 'no event before its wait_timeout_seconds', wait_deadline = NULL, finished_at = {DB_NOW},
    {step_entry("'timeout'", "s.lease_generation", "%(actor)s::text", status="'failed'")}
WHERE s.community_id = %(community_id)s AND s.id = ANY(%(ids)s) AND {WAIT_OVER}
  AND s.on_timeout = 'fail' AND {ACTIVE}
RETURNING s.id
"""

PRUNE_SENT_EVENTS = f"""
DELETE FROM {SENT_EVENT} AS e
WHERE e.community_id = %(community_id)s AND e.id = ANY(
    SELECT x.id FROM {SENT_EVENT} AS x
    WHERE x.community_id = %(community_id)s AND (x.expires_at IS NULL OR x.expires_at < {DB_NOW})
    LIMIT %(limit)s
) AND (e.expires_at IS NULL OR e.expires_at < {DB_NOW})
RETURNING e.id
"""


# The waiting steps ``send_event`` resumes a statement (its pages, all in its one transaction).
EVENT_PAGE = 1000


@dataclass(frozen=True, slots=True)
class EventSent:
    """``send_event`` kept the event until ``kept_until`` (database clock) and resumed
    ``resumed`` waiting steps with it (each exactly once)."""

    resumed: int
    kept_until: dt.datetime


@dataclass
class DueWaits:
    """What :func:`end_due_waits` ended: sleeps woken, waits timed out (any policy)."""

    woken: int = 0
    timed_out: int = 0


def _text(value: Any, name: str, pattern: Any = None, max_chars: int = MAX_EVENT_KEY_CHARS) -> str:
    if not isinstance(value, str) or not value:
        raise v.invalid(name, f"must be a non-empty string, not {type(value).__name__}")
    if pattern is not None and not pattern.match(value):
        raise v.invalid(name, "must be 1..200 of A-Z a-z 0-9 _ . : / @ -")
    if len(value) > max_chars:
        raise v.invalid(name, f"must be at most {max_chars} characters")
    return v.storable_text(value, name)


@tenant_scoped
def sleep_step(lease: StepLease, *, seconds: float | None = None, until: dt.datetime | None = None) -> StepOutcome:
    """Release the holder's lease and park its step ``waiting`` until ``until`` or for
    ``seconds`` (database clock); a time already past ends the step at once (``succeeded``,
    output null). Returns ``Settled("waiting")`` or ``Settled("succeeded")``, ``AlreadyTerminal``
    or ``LeaseLost``. Internal to the executor (the values come from a validated definition)."""
    lease = _lease(lease)
    params = _params(lease)
    with transaction.atomic(), translated_errors():
        if until is not None:
            params["until"] = v.aware_datetime(until, "until")
            due = fetch_all(IS_PAST, params)[0][0]
        else:
            params["seconds"] = v.seconds_in_range(seconds, "seconds", 0, MAX_WAIT_SECONDS)
            due = params["seconds"] == 0
        if due:
            fetch_all(sql.LOCK_RUN, params)
            rows = fetch_all(sql.COMPLETE_IF_CURRENT_GENERATION, {**params, "output": None})
        else:
            rows = fetch_all(PARK_SLEEP_UNTIL if until is not None else PARK_SLEEP_FOR, params)
        if rows:
            return Settled(rows[0][0])
        return _missed(params, still_fine="waiting")


@tenant_scoped
def wait_for_event(lease: StepLease, *, name: str, key: str, wait_seconds: int | None, on_timeout: str) -> StepOutcome:
    """Under the holder's lease, in one transaction: take the event kept under (``name``,
    ``key``) if there is one (the step ``succeeded``, the payload its output), else park the
    step ``waiting`` for it until ``wait_seconds`` (None: no timeout) with ``on_timeout``.
    Returns ``Settled("succeeded")``, ``Settled("waiting")``, ``AlreadyTerminal`` or
    ``LeaseLost``. Internal to the executor."""
    lease = _lease(lease)
    params = _params(
        lease,
        id=new_uuid7(),
        name=_text(name, "event", EVENT_NAME, 200),
        key=_text(key, "event_key"),
        wait_seconds=None
        if wait_seconds is None
        else v.int_in_range(wait_seconds, "wait_seconds", 1, MAX_WAIT_SECONDS),
        on_timeout=on_timeout,
    )
    with transaction.atomic(), translated_errors():
        started = fetch_all(WAIT_STARTS, params)[0][0]
        payload, expires_at = fetch_all(LOCK_EVENT_KEY, params)[0]  # first lock: the one a send meets
        fetch_all(sql.LOCK_RUN, params)  # then the run, then the step (the engine's lock order)
        rows = []
        if expires_at is not None and expires_at >= started:  # kept, and live when this wait began
            rows = fetch_all(TAKE_KEPT_EVENT, {**params, "payload": payload})  # jsonb as text
            if rows:
                fetch_all(COUNT_RESUMED, {**params, "n": 1})
        if not rows:
            rows = fetch_all(PARK_FOR_EVENT, params)
        if rows:
            return Settled(rows[0][0])
        return _missed(params, still_fine="waiting")


@tenant_scoped
def send_event(community_id: uuid.UUID | str, name: str, key: str, payload: Any = None) -> EventSent:
    """Send an event: every step of the community waiting for (``name``, ``key``) resumes with
    ``payload`` as its output, exactly once, in this transaction (Advance runs for each); the
    event is kept until ``BUZZ_WORKFLOWS['EVENT_RETENTION_SECONDS']`` from the end of the send, so a
    ``wait_event`` step that starts meanwhile takes it at once. A later event under the same
    (name, key) replaces the kept one. A step that a cancel or another send ended first is left
    alone.

    ``name``: 1..200 of ``A-Z a-z 0-9 _ . : / @ -``; ``key``: 1..500 characters; ``payload``:
    JSON (at most ``MAX_OUTPUT_BYTES``). Returns :class:`EventSent`. Raises ``ValidationError``
    keyed ``community_id``, ``name``, ``key`` or ``payload`` before SQL;
    :class:`~buzz_delivery.exceptions.CommunityNotWritable` when the community is not active.
    SPEC 16 "Engine waits".
    """
    settings = get_settings()
    params = {
        "community_id": v.uuid_value(community_id, "community_id"),
        "id": new_uuid7(),
        "name": _text(name, "name", EVENT_NAME, 200),
        "key": _text(key, "key"),
        "payload": json_argument(payload, "payload", settings.max_output_bytes),
        "retention": settings.event_retention_seconds,
        "actor": "send_event",
        "limit": EVENT_PAGE,
    }
    for attempt in range(5):
        try:
            return _send(params)
        except OperationalError as exc:  # a deadlock with a cancel of a parent run: go again
            if getattr(exc.__cause__, "sqlstate", None) != "40P01" or attempt == 4:
                raise
            time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")


def _send(params: dict[str, Any]) -> EventSent:
    resumed = 0
    # The pages come in run id order (each page's steps leave the waiting set, and no wait can
    # join it while the send holds the (name, key) row), one LOCK_RUNS each. A send of more than
    # one page takes the core row of each run before its engine row, even on a page of one run:
    # its core rows follow one ascending run id order across the pages, a multi-run settle's
    # (``sql.core_runs_of``). Not covered: a run the send completes ends itself and locks its
    # parent's engine row (``buzz_workflows_end_run``) with no core row of the parent, so a
    # multi-run settle over deliveries of two such parents can still deadlock with it (both retry).
    lock_runs = LOCK_RUNS
    with transaction.atomic(), translated_errors():
        fetch_all(SEND_EVENT, params)  # the (name, key) row: the lock a wait meets
        while True:
            waiting = fetch_all(WAITING_FOR_EVENT, params)
            if not waiting:
                break
            if len(waiting) == params["limit"]:  # more pages may follow: core rows, even of one run
                lock_runs = LOCK_RUNS_AND_CORE
            fetch_all(lock_runs, {**params, "run_ids": sorted({row[1] for row in waiting})})
            done = fetch_all(RESUME_WAITING_FOR_EVENT, {**params, "ids": [row[0] for row in waiting]})
            resumed += len(done)
            if len(waiting) < params["limit"]:
                break
        kept_until = fetch_all(KEEP_SENT_EVENT, {**params, "n": resumed})[0][0]
    return EventSent(resumed=resumed, kept_until=kept_until)


def end_due_waits_in(params: dict[str, Any], ids: list[Any], result: DueWaits) -> None:
    """The three statements that end due waits among ``ids`` (their runs locked by the caller)."""
    params = {**params, "ids": ids}
    for kind_ in fetch_all(CONTINUE_DUE_WAITS, params):
        if kind_[0] == "sleep":
            result.woken += 1
        else:
            result.timed_out += 1
    result.timed_out += len(fetch_all(SKIP_DUE_WAITS, params))
    result.timed_out += len(fetch_all(FAIL_DUE_WAITS, params))


@tenant_scoped
def end_due_waits(community_id: uuid.UUID | str, *, limit: int = 1000) -> DueWaits:
    """Wake the due sleeps and time out the due waits of ``wait_event`` steps of one community
    (database clock), at most ``limit`` in one transaction: the orchestrator's poll calls it so
    that a sleep ends within a poll, not at the next maintenance pass. A wait whose run row
    another transaction holds is left to the next poll (never waited for). Returns :class:`DueWaits`."""
    params: dict[str, Any] = {
        "community_id": v.uuid_value(community_id, "community_id"),
        "limit": v.int_in_range(limit, "limit", 1, 100_000),
        "actor": "orchestrator",
    }
    result = DueWaits()
    with transaction.atomic(), translated_errors():
        due = fetch_all(DUE_WAITS, params)
        if due:
            # The runs free now, never waiting for one: a run row held by a transaction that
            # does not end would stop the dispatcher of every orchestrator polling here (the
            # maintenance bounds that wait; its next poll, or the maintenance, ends the rest).
            free = {row[0] for row in fetch_all(LOCK_FREE_RUNS, {**params, "run_ids": sorted({row[1] for row in due})})}
            ids = [row[0] for row in due if row[1] in free]
            if ids:
                end_due_waits_in(params, ids, result)
    return result


@fleet_scoped
def communities_with_due_waits(limit: int = 100) -> list[uuid.UUID]:
    """Communities with a sleep or an event wait whose time came (a plain read)."""
    return [row[0] for row in fetch_all(COMMUNITIES_WITH_DUE_WAITS, {"limit": limit})]
