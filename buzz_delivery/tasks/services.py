"""The only place task results change (and the task's delivery is committed).

A task is one delivery of the community the backend serves (``OPTIONS["COMMUNITY"]``):

- workflow: one per community, named ``django.tasks`` (a fixed id derived from the community);
- run: one per (community, backend alias), the same way; ``step_id``: the result id, so each
  task has its own delivery identity (community, run, step_id, target);
- target: the queue's 32-byte key (:func:`queue_target`; ``OPTIONS["TARGETS"]`` may name it);
- message event: one per task (kind :data:`TASK_EVENT_KIND`, tag ``["task", path]``), cause:
  ``webhook`` with the result id as its invocation id;
- ``run_after``: the delivery's retry gate (``not_before`` -> ``next_attempt_at``);
- ``priority`` (Django's -100..100): the delivery's priority (-10..10, claims take higher
  first), :func:`delivery_priority` of it; the task's own stays in the result row;
- the task's path, arguments, priority and queue: the result row, committed in the same
  transaction as the delivery.

Every statement runs in the community's tenant scope and names ``community_id``.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal, cast

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models.functions import Now

from buzz_delivery.exceptions import CommunityNotFound
from buzz_delivery.models import PRIORITY_MAX, PRIORITY_MIN, Event, new_uuid7
from buzz_delivery.services import commit_deliveries
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import constraint_name, fetch_all
from buzz_delivery.services.tenancy import tenant_scoped
from buzz_delivery.services.types import Binding, Cause
from buzz_delivery.services.workers import EXISTING_COMMUNITY
from buzz_delivery.tasks.models import NAME_MAX_CHARS, TASK_PATH_MAX_CHARS, TaskResult

TASK_EVENT_KIND = 30_078  # an application's own data (NIP-78): the task's message event
WORKFLOW_NAME = "django.tasks"
MAX_ARGUMENT_BYTES = 1_000_000  # args and kwargs, as JSON, together
MAX_RETURN_VALUE_BYTES = 1_000_000  # a task's return value, as JSON
_NAMESPACE = uuid.UUID("6d1a8a4e-5f0c-4f59-9a39-5c1f2f7a3b10")
DEFINITION_EVENT_ID = hashlib.sha256(b"buzz_delivery.tasks definition").digest()
PRODUCER_PUBKEY = hashlib.sha256(b"buzz_delivery.tasks producer").digest()

RESULT = TaskResult._meta.db_table
DELIVERY = "buzz_delivery_delivery"  # the view: reads
RECORD = "buzz_delivery_delivery_record"  # the table: read inside a write
QUEUE = "buzz_delivery_delivery_queue"  # the live state (stage 2): the lease fence


def queue_target(queue_name: str) -> bytes:
    """The 32-byte target key of a queue when ``OPTIONS["TARGETS"]`` does not name one."""
    return hashlib.sha256(f"buzz_delivery.tasks queue {queue_name}".encode()).digest()


def tasks_workflow_id(community: uuid.UUID) -> uuid.UUID:
    return uuid.uuid5(_NAMESPACE, f"{community}/workflow")


def tasks_run_id(community: uuid.UUID, backend: str) -> uuid.UUID:
    return uuid.uuid5(_NAMESPACE, f"{community}/{backend}/run")


@dataclass(frozen=True, slots=True)
class Enqueued:
    """What :func:`enqueue_task` wrote: the result id, its delivery, and when."""

    result_id: uuid.UUID
    delivery_id: uuid.UUID
    enqueued_at: Any


@dataclass(frozen=True, slots=True)
class StoredTask:
    """A result row with its delivery's status, times and holders (see :func:`read_task`)."""

    id: uuid.UUID
    community_id: uuid.UUID
    delivery_id: uuid.UUID
    backend: str
    queue_name: str
    task_path: str
    priority: int
    takes_context: bool
    args: list[Any]
    kwargs: dict[str, Any]
    run_after: Any
    enqueued_at: Any
    return_value: Any
    errors: list[dict[str, str]]
    status: str  # the delivery's
    finished_at: Any
    claims: list[tuple[Any, str]]  # (at, holder) of each claim the delivery's history keeps


def _unstorable_text(value: Any) -> str | None:
    """Why PostgreSQL's ``jsonb`` cannot hold a string of the JSON value ``value`` (a NUL
    character, a lone surrogate), or None. Iterative: a deep value cannot exhaust the stack."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, str):
            if "\x00" in item:
                return "holds a NUL character (\\u0000), which PostgreSQL's jsonb cannot store"
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return "holds a lone surrogate, which is not UTF-8"
    return None


def json_text(value: Any, name: str, max_bytes: int) -> str:
    """``value`` as the JSON text a ``jsonb`` column stores, or ``ValidationError`` naming
    ``name``: not JSON (NaN and infinities included), a string jsonb refuses, or more than
    ``max_bytes`` bytes. What passes here is stored: the database never refuses it later."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise v.invalid(name, f"must be JSON: {exc}") from None
    why = _unstorable_text(value)
    if why is not None:
        raise v.invalid(name, f"must be JSON that PostgreSQL can store: a string {why}")
    if len(text) > max_bytes:  # ASCII: json.dumps escapes every other character
        raise v.invalid(name, f"must serialise to at most {max_bytes} bytes of JSON, not {len(text)}")
    return text


def _json_arguments(args: Any, kwargs: Any) -> str:
    if not isinstance(args, list | tuple):
        raise v.invalid("args", f"must be a list, not {type(args).__name__}")
    if not isinstance(kwargs, dict):
        raise v.invalid("kwargs", f"must be a dict, not {type(kwargs).__name__}")
    for name, value in (("args", args), ("kwargs", kwargs)):
        json_text(value, name, MAX_ARGUMENT_BYTES)
    text = json.dumps({"args": list(args), "kwargs": kwargs}, allow_nan=False)
    if len(text.encode()) > MAX_ARGUMENT_BYTES:
        raise v.invalid("args", f"args and kwargs must serialise to at most {MAX_ARGUMENT_BYTES} bytes")
    return text


def _name(value: Any, name: str, max_chars: int = NAME_MAX_CHARS) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > max_chars or "\x00" in value:
        raise v.invalid(name, f"must be 1..{max_chars} characters, not blank")
    return value


# The foreign key of the workflow's community (Django's name for it, deferred as Django's keys
# are): an enqueue for a community that does not exist breaks it first, at the commit.
WORKFLOW_COMMUNITY_FK = "buzz_delivery_workfl_community_id_9946e868_fk_buzz_deli"

# Communities a committed transaction of this process showed to exist (no service deletes a
# community row: its lifecycle ends at the tombstone). Inside a caller's transaction the deferred
# key would be judged at the caller's commit, past this service: a community not seen yet is read
# first there, once per process, so the caller gets CommunityNotFound from enqueue, not an
# IntegrityError at its commit (one deleted by hand after it was seen still fails that way).
# Outside a transaction the key's violation is translated after the fact: no read at all.
_SEEN_COMMUNITIES: set[uuid.UUID] = set()


def _in_callers_transaction() -> bool:
    """Whether a statement now runs in a transaction the caller commits: an atomic block's, or
    one it holds with autocommit turned off (``transaction.set_autocommit(False)``)."""
    connection = transaction.get_connection()
    return connection.in_atomic_block or not connection.get_autocommit()


def _require_community_in_callers_transaction(community: uuid.UUID) -> None:
    if community in _SEEN_COMMUNITIES or not _in_callers_transaction():
        return
    if not fetch_all(EXISTING_COMMUNITY, {"community_id": community}):
        raise CommunityNotFound(f"no community {community}")
    if transaction.get_connection().in_atomic_block:  # (no on_commit with autocommit off: read again)
        transaction.on_commit(lambda: _SEEN_COMMUNITIES.add(community))


_ENSURE_WORKFLOW = """
INSERT INTO buzz_delivery_workflow (id, community_id, name, created_at)
VALUES (%(workflow_id)s, %(community_id)s, %(name)s, now()) ON CONFLICT DO NOTHING
"""
_ENSURE_RUN = """
INSERT INTO buzz_delivery_workflow_run (id, community_id, workflow_id, created_at)
VALUES (%(run_id)s, %(community_id)s, %(workflow_id)s, now()) ON CONFLICT DO NOTHING
"""


def delivery_priority(task_priority: int) -> int:
    """The delivery priority (``PRIORITY_MIN..PRIORITY_MAX``, -10..10) of a task priority
    (Django's -100..100): a tenth of it, rounded to the nearest whole number, halves away from
    zero (-100 -> -10, -5 -> -1, 4 -> 0, 5 -> 1, 95 -> 10), clamped. It keeps the order: a
    higher task priority never maps lower; ten task priorities share one delivery priority."""
    magnitude = (abs(task_priority) + 5) // 10
    return max(PRIORITY_MIN, min(PRIORITY_MAX, magnitude if task_priority >= 0 else -magnitude))


@tenant_scoped
def enqueue_task(
    community_id: uuid.UUID | str,
    *,
    backend: str,
    queue_name: str,
    target_pubkey: bytes,
    task_path: str,
    priority: int = 0,
    takes_context: bool = False,
    args: Any = (),
    kwargs: Any = None,
    run_after: Any = None,
    trace_context: Any = None,
) -> Enqueued:
    """Commit one task: its delivery (to ``target_pubkey``) and its result row, together.

    Bad input raises ``ValidationError`` naming the argument before any SQL; nothing is written.
    A community that is not active raises :class:`~buzz_delivery.exceptions.CommunityNotWritable`;
    one that does not exist, :class:`~buzz_delivery.exceptions.CommunityNotFound` (nothing is
    written): outside a transaction the deferred key's violation at this commit is translated;
    inside the caller's, a community this process has not seen committed is read first (once)."""
    community = v.uuid_value(community_id, "community_id")
    backend = _name(backend, "backend")
    queue_name = _name(queue_name, "queue_name")
    target = v.bytes32(target_pubkey, "target_pubkey")
    task_path = _name(task_path, "task_path", TASK_PATH_MAX_CHARS)
    if isinstance(priority, bool) or not isinstance(priority, int) or not -100 <= priority <= 100:
        raise v.invalid("priority", "must be a whole number between -100 and 100")
    if not isinstance(takes_context, bool):
        raise v.invalid("takes_context", "must be a bool")
    kwargs = {} if kwargs is None else kwargs
    arguments = _json_arguments(args, kwargs)
    if run_after is not None:
        run_after = v.aware_datetime(run_after, "run_after")
    result_id = cast(uuid.UUID, new_uuid7())
    workflow_id = tasks_workflow_id(community)
    run_id = tasks_run_id(community, backend)
    params = {"community_id": community, "workflow_id": workflow_id, "run_id": run_id, "name": WORKFLOW_NAME}
    context: dict[str, Any] = {"django_task": {"result_id": str(result_id), "path": task_path, "queue": queue_name}}
    if trace_context:
        context["trace"] = trace_context
    _require_community_in_callers_transaction(community)
    try:  # the community's key judged after the fact (at this commit): no statement to look it up
        with transaction.atomic():
            fetch_all(_ENSURE_WORKFLOW, params)
            fetch_all(_ENSURE_RUN, params)
            event = Event.objects.create(
                community_id=community,
                event_id=hashlib.sha256(f"buzz_delivery.tasks {community} {result_id}".encode()).digest(),
                created_at=Now(),
                kind=TASK_EVENT_KIND,
                pubkey=PRODUCER_PUBKEY,
                content=arguments,
                tags=[["task", task_path], ["queue", queue_name]],
            )
            binding = Binding(
                community_id=community,
                workflow_id=workflow_id,
                run_id=run_id,
                step_id=str(result_id),
                target_pubkey=target,
                definition_event_id=DEFINITION_EVENT_ID,
                message_event_id=bytes(event.event_id),
                cause=Cause.webhook(result_id),
            )
            (delivery_id,) = commit_deliveries(
                community,
                event,
                [binding],
                trigger_context=context,
                not_before=run_after,
                priority=delivery_priority(priority),
            )
            decoded = json.loads(arguments)
            row = TaskResult.objects.create(
                community_id=community,
                id=result_id,
                delivery_id=delivery_id,
                backend=backend,
                queue_name=queue_name,
                task_path=task_path,
                priority=priority,
                takes_context=takes_context,
                args=decoded["args"],
                kwargs=decoded["kwargs"],
                run_after=run_after,
            )
            # Read back inside the community (Citus's router form): the row's refresh_from_db
            # would look it up by id alone, a statement on every shard.
            enqueued_at = (
                TaskResult.objects.filter(community_id=community, id=row.id).values_list("enqueued_at", flat=True).get()
            )
    except IntegrityError as exc:
        if constraint_name(exc) == WORKFLOW_COMMUNITY_FK:
            raise CommunityNotFound(f"no community {community}") from exc
        raise
    if not _in_callers_transaction():  # committed: it exists
        _SEEN_COMMUNITIES.add(community)
    return Enqueued(result_id=result_id, delivery_id=delivery_id, enqueued_at=enqueued_at)


_TASK_COLUMNS = """
       r.id, r.community_id, r.delivery_id, r.backend, r.queue_name, r.task_path, r.priority, r.takes_context,
       r.args::text, r.kwargs::text, r.run_after, r.enqueued_at, r.return_value::text, r.errors::text,
       d.status, d.finished_at,
       (SELECT coalesce(jsonb_agg(jsonb_build_array(h->>'at', h->>'actor')), '[]'::jsonb)
        FROM jsonb_array_elements(d.history) AS h WHERE h->>'event' = 'claim')::text"""
_READ_BY_ID = f"""
SELECT {_TASK_COLUMNS}
FROM {RESULT} r
JOIN {DELIVERY} d ON d.community_id = r.community_id AND d.id = r.delivery_id
WHERE r.community_id = %(community_id)s AND r.id = %(key)s
"""


def _stored(row: tuple[Any, ...]) -> StoredTask:
    from django.utils.dateparse import parse_datetime

    (
        key,
        community,
        delivery,
        backend,
        queue,
        path,
        priority,
        takes_context,
        args,
        kwargs,
        run_after,
        enqueued_at,
        return_value,
        errors,
        status,
        finished_at,
        claims,
    ) = row
    return StoredTask(
        key,
        community,
        delivery,
        backend,
        queue,
        path,
        priority,
        takes_context,
        json.loads(args),
        json.loads(kwargs),
        run_after,
        enqueued_at,
        None if return_value is None else json.loads(return_value),
        json.loads(errors),
        status,
        finished_at,
        claims=[(parse_datetime(at), actor) for at, actor in json.loads(claims)],
    )


@tenant_scoped
def read_task(community_id: uuid.UUID | str, result_id: uuid.UUID | str) -> StoredTask | None:
    """The result row ``result_id`` of this community with its delivery's state, or None."""
    community = v.uuid_value(community_id, "community_id")
    try:
        key = v.uuid_value(result_id, "result_id")
    except ValidationError:
        return None
    rows = fetch_all(_READ_BY_ID, {"community_id": community, "key": key})
    return _stored(rows[0]) if rows else None


# Fenced by the delivery's lease as every settle is: the holder's generation, the row still
# claimed and its lease not lapsed, by the database clock, judged on the live queue row (stage 2:
# the record of a live delivery holds no lease). An error is stored with the lease
# generation that recorded it and the delivery's requeue count then (``requeues``), read from the
# row here: read_task_of_delivery tells it from an error an operator's requeue has since
# superseded. The error object is extended with IMMUTABLE operations only (jsonb and text
# concatenation, casts): Citus refuses a STABLE function such as jsonb_build_object over a
# column in an UPDATE, and an object concatenated to the errors array is appended to it.
_RECORD_OUTCOME = f"""
UPDATE {RESULT} AS r
SET return_value = %(return_value)s::jsonb,
    errors = CASE WHEN %(error)s::jsonb IS NULL THEN r.errors
                  ELSE r.errors || (%(error)s::jsonb || ('{{"requeues": ' || d.requeues::text || '}}')::jsonb) END
FROM {RECORD} AS d, {QUEUE} AS q
WHERE r.community_id = %(community_id)s AND r.delivery_id = %(delivery_id)s
  AND d.community_id = %(community_id)s AND d.id = %(delivery_id)s
  AND q.community_id = %(community_id)s AND q.id = %(delivery_id)s
  AND q.lease_generation = %(generation)s AND q.status = 'claimed' AND q.lease_until >= buzz_delivery_now()
RETURNING r.id
"""


@tenant_scoped
def record_task_outcome(
    community_id: uuid.UUID | str,
    delivery_id: uuid.UUID,
    lease_generation: int,
    *,
    return_value: Any = None,
    error: dict[str, str] | None = None,
) -> bool:
    """Write the task's return value (or append its error, with ``lease_generation`` and the
    delivery's ``requeues``, read from its row: a caller's value for either is overwritten) if
    ``lease_generation`` still holds the delivery's current, unexpired lease; False (nothing
    written) otherwise. The holder then settles the delivery (the worker does), so a result is
    shown once its delivery is settled; a holder that dies first leaves the outcome to the next
    (:func:`read_task_of_delivery`), which settles it without running the task again."""
    community = v.uuid_value(community_id, "community_id")
    value = json_text(return_value, "return_value", MAX_RETURN_VALUE_BYTES)
    rows = fetch_all(
        _RECORD_OUTCOME,
        {
            "community_id": community,
            "delivery_id": delivery_id,
            "generation": lease_generation,
            "return_value": value if error is None else None,
            "error": json.dumps({**error, "lease_generation": lease_generation}) if error is not None else None,
        },
    )
    return bool(rows)


@dataclass(frozen=True, slots=True)
class RecordedOutcome:
    """What an earlier holder of the delivery recorded, as its current holder reads it
    (:func:`read_task_of_delivery`): ``state`` is ``"none"`` (run the task), ``"returned"`` or
    ``"raised"`` (an earlier holder of this delivery recorded it: settle as it says, do not run
    the task again; ``error`` is the last error for ``"raised"``) or ``"lease_lost"`` (this
    holder no longer holds the delivery: do nothing)."""

    state: Literal["none", "returned", "raised", "lease_lost"]
    error: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class HeldTask:
    """The task a delivery carries and the outcome recorded for it (:func:`read_task_of_delivery`)."""

    task: StoredTask
    recorded: RecordedOutcome


# The task's row as _READ_BY_ID reads it, and, judged in the same snapshot, whether the caller's
# lease still holds the delivery (generation, still claimed, not lapsed, by the database clock:
# the fence of _RECORD_OUTCOME and of every settle, on the live queue row) and what an earlier
# holder recorded. A return
# value is recorded when the column is not SQL NULL: a task that returned None stored the jsonb
# 'null', and recording an error sets the column to SQL NULL. An error is the outcome unless an
# operator requeued the delivery after it was recorded: its ``requeues`` (the delivery's count
# when it was recorded) is not the delivery's count now, however many leases lapsed since. An
# error without ``requeues`` (recorded before errors carried it, or after, by a worker of the
# previous release during a rolling deploy) is superseded by a 'requeue' history entry of a
# later generation than its lease_generation (-1 without one): exact while the history still
# holds an entry of that generation or earlier (entries are appended in generation order and the
# oldest dropped first). Once the history no longer reaches back that far, any requeue counted
# is taken as one since (a count above 0 alone would also supersede an error recorded after it).
# The lease generation the last error was recorded with (-1 without one).
_ERROR_GENERATION = (
    "CASE WHEN jsonb_typeof(r.errors -> -1 -> 'lease_generation') = 'number'"
    " THEN (r.errors -> -1 -> 'lease_generation')::numeric ELSE -1 END"
)
_READ_HELD = f"""
SELECT {_TASK_COLUMNS},
       (q.lease_generation = %(generation)s AND q.status = 'claimed'
        AND q.lease_until >= buzz_delivery_now()) IS TRUE,
       r.return_value IS NOT NULL,
       (r.errors -> -1)::text,
       CASE WHEN jsonb_typeof(r.errors -> -1 -> 'requeues') = 'number'
            THEN (r.errors -> -1 -> 'requeues')::numeric <> d.requeues
            ELSE EXISTS (
                SELECT 1 FROM jsonb_array_elements(d.history) AS h
                WHERE h->>'event' = 'requeue' AND (h->>'generation')::bigint > {_ERROR_GENERATION}
            ) OR (d.requeues > 0 AND NOT EXISTS (
                SELECT 1 FROM jsonb_array_elements(d.history) AS h
                WHERE (h->>'generation')::bigint <= {_ERROR_GENERATION}
            )) END
FROM {RESULT} r
JOIN {DELIVERY} d ON d.community_id = r.community_id AND d.id = r.delivery_id
LEFT JOIN {QUEUE} q ON q.community_id = r.community_id AND q.id = r.delivery_id
WHERE r.community_id = %(community_id)s AND r.delivery_id = %(delivery_id)s
  AND d.community_id = %(community_id)s AND d.id = %(delivery_id)s
"""


@tenant_scoped
def read_task_of_delivery(
    community_id: uuid.UUID | str, delivery_id: uuid.UUID, lease_generation: int
) -> HeldTask | None:
    """The result row carried by delivery ``delivery_id`` and the outcome an earlier holder
    recorded for it (:func:`record_task_outcome`), read by the holder of lease
    ``lease_generation`` before it runs the task, in one statement; None: not a task's delivery.

    A holder killed after recording and before its settle committed leaves the outcome to the
    next one, which settles the delivery as it says instead of running the task again
    (``recorded.state``; ``"lease_lost"`` when ``lease_generation`` no longer holds the delivery)."""
    community = v.uuid_value(community_id, "community_id")
    params = {
        "community_id": community,
        "delivery_id": v.uuid_value(delivery_id, "delivery_id"),
        "generation": lease_generation,
    }
    rows = fetch_all(_READ_HELD, params)
    if not rows:
        return None
    row = rows[0]
    holds, returned, last_error, requeued_since = row[-4:]
    task = _stored(row[:-4])
    if not holds:
        return HeldTask(task, RecordedOutcome("lease_lost"))
    if returned:
        return HeldTask(task, RecordedOutcome("returned"))
    if last_error is not None and last_error != "null" and not requeued_since:
        error = json.loads(last_error)
        return HeldTask(task, RecordedOutcome("raised", error if isinstance(error, dict) else {}))
    return HeldTask(task, RecordedOutcome("none"))
