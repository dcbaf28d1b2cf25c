"""Running one claimed step (the orchestrator's unit of work; SPEC section 11).

- ``function``: resolve the input, call the registered callable, record its output
  (``complete_step``) or the failure (``fail_step``: retried with backoff unless permanent). A
  missing function, an exception (``function_error``, retried while attempts are left), any
  other ``BaseException`` such as ``SystemExit`` or ``KeyboardInterrupt`` (``function_aborted``,
  not retried: the code asked to stop, which is this step's end, never the worker's), or output
  that is not JSON within the size bound fail the step with a failure code; so does code that
  leaves its database connection in a transaction (``transaction_left_open``, not retried: what
  it wrote there is rolled back; see :mod:`buzz_delivery.usercode`, which also cleans the
  session after any step that used the connection). An exception whose ``str()`` raises, or
  whose text PostgreSQL cannot store, is described instead. Nothing here raises to the worker.
- ``send_message``: in one transaction, under the step's lease: ``lock_delivery_identity``, the
  message event (reused when it exists), ``commit_deliveries`` for every target, and the step
  parked ``waiting`` for that many deliveries (the fan-in trigger counts them as they settle).
- ``sub_workflow``: in one transaction: the step parked ``waiting`` on a child run id, and the
  child run started with it (its end moves the step, in the Advance trigger). The child's
  input, built from references, is held to a run input's bound (1,000,000 bytes of JSON): a
  larger one fails the step (``input_too_large``, not retried).
- ``approval``: ``request_approval`` (the lease released, the approval created).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, cast

from django.db import models, transaction

from buzz_delivery import backoff
from buzz_delivery import services as core
from buzz_delivery.models import Event, new_uuid7
from buzz_delivery.services import Binding, Settled
from buzz_delivery.services.db import atomic_within_bound, fetch_all, retry_deadlocks
from buzz_delivery.services.tenancy import tenant_scoped
from buzz_delivery.tracing import work as tracing_work
from buzz_delivery.usercode import TRANSACTION_LEFT_OPEN, UserCode
from buzz_delivery.worker.handlers import describe, storable_text
from buzz_delivery.workflows import kinds, refs
from buzz_delivery.workflows.conf import get_settings
from buzz_delivery.workflows.models import DefinitionVersion, Run, Step
from buzz_delivery.workflows.registry import (
    PermanentStepFailure,
    StepContext,
    get_function,
    missing_message,
    note_missing,
)
from buzz_delivery.workflows.services import approvals, steps
from buzz_delivery.workflows.services import sql as wf_sql
from buzz_delivery.workflows.services.common import MAX_INPUT_BYTES, BadJSON, json_text
from buzz_delivery.workflows.services.runs import cause_of, create_run
from buzz_delivery.workflows.services.types import StepClaim, StepOutcome

logger = logging.getLogger("buzz_delivery.workflows")

FAILURE_CODE_MAX_CHARS = 64
FAILURE_MESSAGE_MAX_CHARS = 10_000
# The database clock of the lease statements (tests can freeze it), as an ORM expression.
DB_NOW = models.Func(function="buzz_delivery_now", output_field=models.DateTimeField())


class _Rollback(Exception):
    def __init__(self, outcome: StepOutcome) -> None:
        self.outcome = outcome


def resolve(value: Any, run: Run, outputs: dict[str, Any]) -> Any:
    """``value`` with every ``{"$ref": [...]}`` replaced by what it names (None when absent)."""
    return refs.resolve(value, run.input, outputs)


def step_input(claim: StepClaim) -> dict[str, Any]:
    """The claimed step's ``input`` with references resolved against the run input and the
    outputs of the run's steps."""
    spec = claim.spec.get("input")
    if not spec:
        return {}
    if claim.step.map_key is not None:
        return spec  # type: ignore[no-any-return]  # a map element's input was resolved when the map expanded
    run = claim.step.run
    return resolve(spec, run, kinds.run_outputs(run))  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class Output:
    """What a ``function`` step returned, not yet recorded: the caller completes it
    (:func:`~buzz_delivery.workflows.services.complete_steps`, many at once)."""

    value: Any


@tenant_scoped
def execute(claim: StepClaim, *, defer_output: bool = False) -> StepOutcome | Output:
    """Run one claimed step to its next state; returns the outcome of its last transition.
    With ``defer_output`` a ``function`` step that returned is not completed here: its
    :class:`Output` is returned instead (failures are still recorded here)."""
    with tracing_work.step_span(claim):  # child of the run's stored trace context
        return _execute(claim, defer_output)


def _execute(claim: StepClaim, defer_output: bool) -> StepOutcome | Output:
    kind = claim.step.kind
    try:
        if kind == "function":
            result = _run_function(claim)  # in this call's tenant scope already
            if isinstance(result, Output) and not defer_output:
                return steps.complete_step(claim.lease, result.value)
            return result
        if kind == "send_message":
            return _send_message(claim)
        if kind == "sub_workflow":
            return _sub_workflow(claim)
        if kind in kinds.RUNNERS:  # sleep, wait_event, map (buzz_delivery.workflows.kinds)
            return kinds.RUNNERS[kind](claim)
        outcome = approvals.request_approval(
            claim.lease, deadline_seconds=claim.spec["deadline_seconds"], prompt=claim.spec.get("prompt", "")
        )
        return Settled("waiting") if isinstance(outcome, approvals.ApprovalRequested) else outcome
    except _Rollback as rollback:
        return rollback.outcome


@tenant_scoped
def run_function(claim: StepClaim) -> StepOutcome | Output:
    """Call a ``function`` step's registered callable. Returns its :class:`Output`, or the
    outcome of the failure recorded (missing function, an exception: retried unless
    :class:`PermanentStepFailure`). An ``async def`` callable is awaited on this thread
    (``asyncio.run``); the orchestrator awaits those on its event loop instead
    (:func:`prepare_call`, :func:`await_call`)."""
    return _run_function(claim)


def _run_function(claim: StepClaim) -> StepOutcome | Output:
    """:func:`run_function` in the caller's tenant scope (:func:`execute`'s: a second scope of
    the same community adds nothing but its cost, once per step)."""
    name = claim.spec["function"]
    fn = get_function(name)
    if fn is None:
        note_missing(name)
        message = missing_message(name)
        logger.warning(
            "function_not_registered step=%s run=%s function=%r: %s", claim.step.key, claim.lease.run_id, name, message
        )
        return steps.fail_step(claim.lease, "function_not_registered", failure_message=message, retryable=False)
    context = StepContext(claim.lease.community_id, claim.lease.run_id, claim.step.key, claim.lease.attempts)
    arguments = step_input(claim)
    # The user's code: the login's role (SPEC 13); what it leaves on the connection is cleaned.
    call = UserCode(claim.lease.community_id)
    failure: Failure | None = None
    try:
        with call:
            output = fn(arguments, context)
            if inspect.isawaitable(output):  # an ``async def`` function: awaited on this step thread
                output = asyncio.run(_awaited(output))
    except BaseException as exc:  # SystemExit, KeyboardInterrupt...: this step's, never the worker's
        failure = failure_of(claim, exc)
    if call.left_open is not None:
        message = f"the step's code left its database connection with {call.left_open}; nothing it wrote there is kept"
        return steps.fail_step(claim.lease, TRANSACTION_LEFT_OPEN, failure_message=message, retryable=False)
    if failure is not None:
        return record_failure(claim, failure)
    return Output(output)


@dataclass(frozen=True, slots=True)
class Failure:
    """What a ``function`` step raised, as its failure: code, message, whether it is retried,
    and the ``retry_after`` its exception asked for (:mod:`buzz_delivery.backoff`)."""

    code: str
    message: str
    retryable: bool
    retry_after: float | None = None


def failure_of(claim: StepClaim, exc: BaseException) -> Failure:
    """The failure of a step whose code raised ``exc``: :class:`PermanentStepFailure` -> its
    code, not retried; an ``Exception`` -> ``function_error``, retried; any other
    ``BaseException`` (``SystemExit``, ``KeyboardInterrupt``, ``CancelledError``) ->
    ``function_aborted``, not retried."""
    if isinstance(exc, PermanentStepFailure):
        return Failure(_failure_code(exc.failure_code), _message(describe(exc)), False)
    code = "function_error" if isinstance(exc, Exception) else "function_aborted"
    logger.info("step %s of run %s raised %s", claim.step.key, claim.lease.run_id, type(exc).__name__)
    message = _message(f"{type(exc).__name__}: {describe(exc)}")
    return Failure(code, message, code == "function_error", backoff.of(exc))


def record_failure(claim: StepClaim, failure: Failure) -> StepOutcome:
    """Record ``failure`` under the claim's lease (``fail_step``: retried with backoff while
    attempts are left, unless not retryable)."""
    return steps.fail_step(
        claim.lease,
        failure.code,
        failure_message=failure.message,
        retryable=failure.retryable,
        retry_after=failure.retry_after,
    )


def is_async_function(fn: Any) -> bool:
    """Whether a registered callable is an ``async def`` function (or has an async ``__call__``)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


@dataclass(frozen=True, slots=True)
class AsyncCall:
    """An ``async def`` function step made ready for the event loop: everything it needs from
    the database (its resolved input, its span's parent) already read."""

    fn: Any
    arguments: dict[str, Any]
    context: StepContext
    trace_parent: Any


def prepare_call(claim: StepClaim) -> AsyncCall | None:
    """For a ``function`` step whose callable is ``async def``: its :class:`AsyncCall`, the
    input resolved here (ORM reads: call this off the event loop), in the step's tenant scope.
    None for any other step (a plain function, a missing one, another kind): those run on a
    step thread, and are told so without entering a scope (no statement runs for them here)."""
    if claim.step.kind != "function":
        return None
    fn = get_function(claim.spec["function"])
    if fn is None or not is_async_function(fn):
        return None
    return _prepare_call(claim, fn)


@tenant_scoped
def _prepare_call(claim: StepClaim, fn: Any) -> AsyncCall:
    context = StepContext(claim.lease.community_id, claim.lease.run_id, claim.step.key, claim.lease.attempts)
    return AsyncCall(fn, step_input(claim), context, tracing_work.step_trace_parent(claim))


async def await_call(claim: StepClaim, call: AsyncCall) -> Output | Failure:
    """Await a prepared ``async def`` step on the running event loop; returns its
    :class:`Output` or its :class:`Failure` (recorded by the caller, off the loop). Never
    raises for what the step's code raises (a ``CancelledError`` included)."""
    try:
        with tracing_work.loop_step_span(claim, call.trace_parent):
            return Output(await call.fn(call.arguments, call.context))
    except BaseException as exc:  # a CancelledError too: it ends this step only
        return failure_of(claim, exc)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _failure_code(value: object) -> str:
    """A step's own failure code made storable: 1..64 characters, else ``function_failed``."""
    text = storable_text(value, FAILURE_CODE_MAX_CHARS) if isinstance(value, str) else ""
    return text if text.strip() else "function_failed"


def _message(text: str) -> str:
    return storable_text(text, FAILURE_MESSAGE_MAX_CHARS)


def message_event_id(run_id: Any, step_key: str) -> bytes:
    """The 32-byte id of the message event a send_message step posts (stable per run and step)."""
    return hashlib.sha256(f"buzz-workflows/message/{run_id}/{step_key}".encode()).digest()


_DEFINITION_EVENT_IDS: dict[uuid.UUID, bytes] = {}


def definition_event_id(community: uuid.UUID, definition_id: uuid.UUID) -> bytes:
    """The event id of a definition version (versions are immutable: cached per process,
    emptied beyond 10,000 versions), instead of loading the version, its content included, for
    every message a send_message step sends."""
    found = _DEFINITION_EVENT_IDS.get(definition_id)
    if found is None:
        rows = DefinitionVersion.objects.filter(community_id=community, id=definition_id)
        found = bytes(rows.values_list("definition_event_id", flat=True).get())
        if len(_DEFINITION_EVENT_IDS) >= 10_000:
            _DEFINITION_EVENT_IDS.clear()
        _DEFINITION_EVENT_IDS[definition_id] = found
    return found


def definition_event_ids(community: uuid.UUID, definition_ids: set[uuid.UUID]) -> dict[uuid.UUID, bytes]:
    """:func:`definition_event_id` of many definition versions: those not cached read in one
    statement."""
    missing = [d for d in definition_ids if d not in _DEFINITION_EVENT_IDS]
    if missing:
        rows = DefinitionVersion.objects.filter(community_id=community, id__in=missing)
        found = {pk: bytes(event_id) for pk, event_id in rows.values_list("id", "definition_event_id")}
        if len(_DEFINITION_EVENT_IDS) + len(found) > 10_000:
            _DEFINITION_EVENT_IDS.clear()
        _DEFINITION_EVENT_IDS.update(found)
    return {d: _DEFINITION_EVENT_IDS[d] for d in definition_ids if d in _DEFINITION_EVENT_IDS}


def _message_event(community: uuid.UUID, event_id: bytes, content: str, key: str, exists: bool) -> Event:
    """The step's message event: the one an earlier attempt posted (read when ``exists``: the
    step has deliveries), else written now in one statement (a row of that id that is there
    already is read instead)."""
    if exists:
        found = Event.objects.filter(community_id=community, event_id=event_id).first()
        if found is not None:
            return found
    settings = get_settings()
    tags = [["step", key]]
    params = {
        "community_id": community,
        "event_id": event_id,
        "kind": settings.message_kind,
        "pubkey": settings.author_pubkey,
        "content": content,
        "tags": json.dumps(tags),
    }
    rows = fetch_all(wf_sql.INSERT_MESSAGE_EVENT, params)
    if not rows:
        return Event.objects.get(community_id=community, event_id=event_id)
    return Event(
        id=rows[0][0],
        community_id=community,
        event_id=event_id,
        created_at=rows[0][1],
        kind=settings.message_kind,
        pubkey=settings.author_pubkey,
        content=content,
        tags=tags,
    )


def _run_for_send(claim: StepClaim) -> Run:
    """The claimed step's run with the fields a send reads (the others deferred: read if
    touched), in one narrow statement instead of the ORM's read of every column."""
    params = {"community_id": claim.lease.community_id, "run_id": claim.lease.run_id}
    row = list(fetch_all(wf_sql.RUN_FOR_SEND, params)[0])
    context = wf_sql.RUN_FOR_SEND_FIELDS.index("trace_context") + 2
    if isinstance(row[context], str):  # jsonb as text from the cursor
        row[context] = json.loads(row[context])
    return Run.from_db("default", ["community_id", "run_id", *wf_sql.RUN_FOR_SEND_FIELDS], row)


def send_bindings(community: uuid.UUID, claim: StepClaim, run: Run, definition: bytes) -> list[Binding]:
    """The deliveries a ``send_message`` step commits: one per target, bound to the step's
    message event (the single send and the batched one build them here)."""
    event_id = message_event_id(run.pk, claim.step.key)
    cause = cause_of(run)
    return [
        Binding(
            community_id=community,
            workflow_id=run.workflow_id,
            run_id=run.pk,
            step_id=claim.step.key,
            target_pubkey=bytes.fromhex(target),
            definition_event_id=definition,
            message_event_id=event_id,
            cause=cause,
        )
        for target in claim.spec["targets"]
    ]


@retry_deadlocks
def _send_message(claim: StepClaim) -> StepOutcome:
    run = _run_for_send(claim)
    spec = claim.spec
    community = claim.lease.community_id
    with atomic_within_bound():
        exists = core.lock_delivery_identity(community, run.pk, claim.step.key)
        event_id = message_event_id(run.pk, claim.step.key)
        event = _message_event(community, event_id, spec.get("content", ""), claim.step.key, exists)
        bindings = send_bindings(community, claim, run, definition_event_id(community, run.definition_id))
        # Inside the step's span the commit stores its own trace context with each delivery;
        # without tracing here, the run's stored one is carried on. The deliveries take the run's
        # priority (issue 32).
        core.commit_deliveries(
            community,
            event,
            bindings,
            trigger_context=tracing_work.carried(run.trace_context),
            priority=run.priority,
        )
        outcome = steps.park_step(claim.lease, expected=len(bindings), wait_seconds=spec.get("wait_timeout_seconds"))
        if not isinstance(outcome, Settled):
            raise _Rollback(outcome)
    return outcome


@retry_deadlocks
def _sub_workflow(claim: StepClaim) -> StepOutcome:
    run = claim.step.run
    spec = claim.spec
    community = claim.lease.community_id
    if run.depth + 1 > get_settings().max_depth:
        return steps.fail_step(
            claim.lease,
            "depth_exceeded",
            retryable=False,
            failure_message=f"nesting deeper than {get_settings().max_depth}",
        )
    version = (
        DefinitionVersion.objects.filter(community_id=community, workflow_id=spec["workflow"])
        .order_by("-version")
        .first()
    )
    if version is None:
        return steps.fail_step(
            claim.lease,
            "no_definition",
            retryable=False,
            failure_message=f"workflow {spec['workflow']} has no published definition",
        )
    child_input = step_input(claim)
    try:
        json_text(child_input, MAX_INPUT_BYTES)
    except BadJSON as exc:
        code = "input_too_large" if exc.code == "output_too_large" else "input_not_json"
        return steps.fail_step(claim.lease, code, retryable=False, failure_message=f"the child run's input {exc}")
    child_id = cast(uuid.UUID, new_uuid7())
    with transaction.atomic():
        outcome = steps.park_step(claim.lease, child_run_id=child_id, wait_seconds=spec.get("wait_timeout_seconds"))
        if not isinstance(outcome, Settled):
            raise _Rollback(outcome)
        parked_on = Step.objects.filter(community_id=community, id=claim.lease.step_id).values_list(
            "child_run_id", flat=True
        )
        if parked_on.first() != child_id:
            return outcome  # the holder's repeat: its child run exists already
        create_run(
            community,
            version,
            child_input,
            cause_of(run),
            run_id=child_id,  # type: ignore[arg-type]
            parent=(run, claim.step.key),
        )
    return outcome
