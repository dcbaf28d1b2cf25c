"""The agent side (SPEC sections 4.3-4.5 and 4.7): claim, renew, finish, scoped read."""

from __future__ import annotations

import datetime as dt
import inspect
import operator
import uuid
from typing import Any

from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init

from buzz_delivery import backoff, tracing
from buzz_delivery.conf import get_settings
from buzz_delivery.models import HOLDER_MAX_CHARS, TERMINAL_STATUSES, WorkflowAgentDelivery
from buzz_delivery.services import cached, flow, sql
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import bound_lock_waits, fetch_all, lock_wait_bound, translated_errors
from buzz_delivery.services.tenancy import tenant_scoped
from buzz_delivery.services.types import (
    AlreadyTerminal,
    Binding,
    Claim,
    FinishOutcome,
    Lease,
    LeaseLost,
    Renewed,
    RenewOutcome,
    Settled,
)
from buzz_delivery.triggers import FENCE_SQLSTATE

MAX_CLAIM_BATCH = 1000
OUTCOMES = ("finished", "failed", "retry")
_CLAIM_SQL = {(i, b): sql.claim_oldest_pending(by_id=i, by_binding=b) for i in (False, True) for b in (False, True)}
_ID_INDEX = sql.CLAIM_ATTNAMES.index("id")
_GEN_INDEX = sql.CLAIM_ATTNAMES.index("lease_generation")
_UNTIL_INDEX = sql.CLAIM_ATTNAMES.index("lease_until")
_CREATED_INDEX = sql.CLAIM_ATTNAMES.index("created_at")
_PRIORITY_INDEX = sql.CLAIM_ATTNAMES.index("priority")
# The fast path below copies what ``Model.from_db`` does on Django 5.2, 6.0 and 6.1: fields
# into ``__dict__`` as ``Model.__init__`` puts them, a fresh ``ModelState`` with ``adding``
# off and ``db`` set. Django 6.1 added a keyword ``fetch_mode`` (the state's default,
# ``FETCH_ONE``, is what ``from_db`` leaves without it, and a bare ``ModelState`` has it too).
# A Django whose ``from_db`` takes anything else may build instances otherwise: then every
# claimed row goes through ``from_db`` itself (tests/test_claim_rows.py compares the two).
_FROM_DB_KNOWN = {"db", "field_names", "values", "fetch_mode"}
FAST_ROWS = set(inspect.signature(WorkflowAgentDelivery.from_db).parameters) <= _FROM_DB_KNOWN


def _fast_rows() -> bool:
    """Whether claimed rows may skip ``Model.from_db`` (:func:`_delivery_from_row`): a Django
    this path knows, and no ``pre_init``/``post_init`` receivers for the model (asked once per
    claim, not per row)."""
    model = WorkflowAgentDelivery
    return FAST_ROWS and not (pre_init.has_listeners(model) or post_init.has_listeners(model))


def _delivery_from_row(row: tuple[Any, ...], alias: str, fast: bool | None = None) -> WorkflowAgentDelivery:
    """The model instance of a claimed row (columns :data:`sql.CLAIM_ATTNAMES`; the JSON
    snapshots and history deferred), as ``Model.from_db`` builds it but without running
    ``Model.__init__`` per field (a tenth of its cost): every claimed attribute goes straight
    into the instance's ``__dict__``, where ``__init__`` would put it. With ``pre_init`` or
    ``post_init`` receivers for the model, or on a Django whose ``from_db`` this path does not
    know (:data:`FAST_ROWS`), ``from_db`` runs as usual."""
    if not (_fast_rows() if fast is None else fast):
        return WorkflowAgentDelivery.from_db(alias, sql.CLAIM_ATTNAMES, row)
    delivery: WorkflowAgentDelivery = WorkflowAgentDelivery.__new__(WorkflowAgentDelivery)
    delivery.__dict__.update(zip(sql.CLAIM_ATTNAMES, row, strict=True))
    state = ModelState()
    state.adding = False
    state.db = alias
    delivery._state = state
    return delivery


_BY_AGE = operator.itemgetter(_CREATED_INDEX, _ID_INDEX)
_BY_PRIORITY = operator.itemgetter(_PRIORITY_INDEX)
_new = object.__new__
_set = object.__setattr__


def _claims(rows: list[tuple[Any, ...]], community: uuid.UUID, target: bytes) -> list[Claim]:
    """The claims of a claim statement's rows, highest priority first, oldest first within it
    (then by id). Built per row without a Python call per object: the lease's and the claim's
    slots are set as :meth:`Lease.from_database` and ``Claim(...)`` set them, the delivery as
    :func:`_delivery_from_row` builds it (tests/test_claim_rows.py compares the two)."""
    # Two stable sorts (C key functions) give the order of one by (-priority, created_at, id).
    rows.sort(key=_BY_AGE)
    rows.sort(key=_BY_PRIORITY, reverse=True)
    alias = connection.alias
    fast = _fast_rows()
    names = sql.CLAIM_ATTNAMES
    model = WorkflowAgentDelivery
    utc = dt.UTC
    id_at, gen_at, until_at = _ID_INDEX, _GEN_INDEX, _UNTIL_INDEX
    claims: list[Claim] = []
    append = claims.append
    for row in rows:
        until = row[until_at]
        if until.tzinfo is not utc:
            lease = Lease.from_database(community, row[id_at], target, row[gen_at], until)
        else:
            lease = _new(Lease)
            _set(lease, "community_id", community)
            _set(lease, "delivery_id", row[id_at])
            _set(lease, "target_pubkey", target)
            _set(lease, "lease_generation", row[gen_at])
            _set(lease, "lease_until", until)
        if fast:
            delivery = _new(model)
            delivery.__dict__.update(zip(names, row, strict=True))
            state = ModelState()
            state.adding = False
            state.db = alias
            delivery._state = state
        else:
            delivery = model.from_db(alias, names, row)
        claim = _new(Claim)
        _set(claim, "lease", lease)
        _set(claim, "delivery", delivery)
        append(claim)
    return claims


def _run_claim(
    community: uuid.UUID,
    target: bytes,
    limit: int,
    seconds: float,
    delivery_id: uuid.UUID | None = None,
    expected: Binding | None = None,
    holder: str | None = None,
) -> list[Claim]:
    params: dict[str, Any] = {
        "community_id": community,
        "target_pubkey": target,
        "limit": limit,
        "lease_seconds": seconds,
        "delivery_id": delivery_id,
        "holder": holder,
    }
    if expected is not None:
        params.update(
            workflow_id=expected.workflow_id,
            run_id=expected.run_id,
            step_id=expected.step_id,
            definition_event_id=expected.definition_event_id,
            message_event_id=expected.message_event_id,
            cause_kind=expected.cause.kind,
            cause_event_id=expected.cause.event_id,
            cause_scheduled_for=expected.cause.scheduled_for,
            cause_webhook_invocation_id=expected.cause.webhook_invocation_id,
        )
    limits = flow.declared_limits()
    if limits and delivery_id is None and expected is None:
        # The hot form under limits: one call (the claim lock, then the claim), planned once.
        params.update({f"cap_{kind}": limits.get(kind) for kind in flow.KINDS})
        rows = _claim_under_limits(cached.CLAIM_LIMITED.call, params, locked=True)
    elif limits:
        statement = flow.LIMITED_CLAIMS[(tuple(limits), delivery_id is not None, expected is not None)]
        params.update(flow.limit_params(limits))
        rows = _claim_under_limits(statement, params)
    elif delivery_id is None and expected is None:
        statement = cached.CLAIM.call  # the hot form: planned once per backend
        rows = _fenced_as_nothing(statement, params)
    elif expected is None:
        statement = cached.CLAIM_HINTED.call  # a wake hint's claim: planned once per backend too
        rows = _fenced_as_nothing(statement, params)
    else:
        statement = _CLAIM_SQL[(delivery_id is not None, expected is not None)]
        rows = _fenced_as_nothing(statement, params)
    return _claims(rows, community, target)


# Tries of a claim under limits that lost a slot to a concurrent claim (the unique index refused
# it, nothing was written); the community's claim lock makes that rare.
SLOT_TRIES = 3


def _claim_under_limits(statement: str, params: dict[str, Any], *, locked: bool = False) -> list[tuple[Any, ...]]:
    """A claim under the operator's concurrency limits (:mod:`~buzz_delivery.services.flow`):
    the community's claim lock, then the claim that picks free slots, in one transaction (a
    savepoint inside the caller's); ``locked``: the statement takes the lock itself (the
    plan-cached function), one call in autocommit. A claim the slot indexes refused is tried again.
    In autocommit, a transaction of its own honours a lock-wait bound the caller set
    (:func:`~buzz_delivery.services.db.lock_waits_bounded`: a worker serving several communities)."""
    lock = {"namespace": flow.LIMITED_CLAIM_LOCK_NAMESPACE, "community_id": params["community_id"]}
    for _ in range(SLOT_TRIES):
        try:
            if locked and not connection.in_atomic_block:
                return _fenced_as_nothing(statement, params)
            bound = None if connection.in_atomic_block else lock_wait_bound()
            with transaction.atomic():
                if bound is not None:
                    bound_lock_waits(bound)
                if not locked:
                    fetch_all(flow.LOCK_COMMUNITY_CLAIMS, lock)
                return _fenced_as_nothing(statement, params)
        except IntegrityError as exc:
            if not flow.lost_a_slot(exc):
                raise
    return []


def _fenced_as_nothing(statement: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Run a statement that filters out non-active communities itself. A lifecycle move that
    commits while it runs makes the write fence refuse it instead: in autocommit mode (how
    agents call us) that is the same miss. Inside a caller's transaction the refusal has
    already aborted it, so :class:`CommunityNotWritable` is raised there."""
    with translated_errors():
        if connection.in_atomic_block:
            return fetch_all(statement, params)
        try:
            return fetch_all(statement, params)
        except DatabaseError as exc:
            if getattr(exc.__cause__, "sqlstate", None) == FENCE_SQLSTATE:
                return []
            raise


@tracing.traced("buzz.claim")
@tenant_scoped
def claim_delivery(
    community_id: uuid.UUID | str,
    target_pubkey: bytes,
    *,
    delivery_id: uuid.UUID | str | None = None,
    expected: Binding | None = None,
    lease_seconds: float | None = None,
    holder: str | None = None,
) -> Claim | None:
    """Claim the first claimable delivery of one community and target (SPEC section 4.3):
    the highest ``priority``, the oldest within it (issue 32).

    One statement: picks the row with ``FOR UPDATE SKIP LOCKED`` (concurrent claimers never
    block on or share a row), then sets ``claimed``, generation + 1, attempt + 1,
    ``claimed_at = now()``, ``lease_until = now() + lease_seconds`` (never past ``expires_at``).

    ``delivery_id`` narrows the claim to that delivery (a wake hint). ``expected`` (a
    :class:`Binding`) must match every field of the row; an ``expected`` whose community or
    target differs from the call's is a miss before any SQL. ``lease_seconds``: seconds within
    the configured bounds (default 15..300); None = ``LEASE_SECONDS``. ``holder``: who claims
    (at most 200 characters, e.g. ``host:pid:worker``), recorded as ``claimed_by`` and as the
    actor of the claim's history entry (and of the settle's); None = unnamed.

    Returns a :class:`Claim`, or None on a miss (nothing claimable, a forged or stale hint, a
    community that is not active). Raises ``ValidationError`` keyed by argument on bad input.
    """
    community = v.uuid_value(community_id, "community_id")
    target = v.bytes32(target_pubkey, "target_pubkey")
    wanted = v.uuid_value(delivery_id, "delivery_id") if delivery_id is not None else None
    if expected is not None and not isinstance(expected, Binding):
        raise v.invalid("expected", f"must be a Binding or None, not {type(expected).__name__}")
    seconds = v.lease_seconds(lease_seconds)
    who = v.optional_text(holder, "holder", HOLDER_MAX_CHARS)
    if expected is not None and (expected.community_id != community or expected.target_pubkey != target):
        return None
    claims = _run_claim(community, target, 1, seconds, wanted, expected, who)
    return claims[0] if claims else None


@tracing.traced("buzz.claim")
@tenant_scoped
def claim_deliveries(
    community_id: uuid.UUID | str,
    target_pubkey: bytes,
    *,
    limit: int,
    lease_seconds: float | None = None,
    holder: str | None = None,
) -> list[Claim]:
    """Claim up to ``limit`` (1..1000) of the claimable deliveries in one round trip, highest
    ``priority`` first, oldest first within it.

    Each claim has its own lease (generation). Never more than ``limit``: the candidates are
    picked in a MATERIALIZED CTE, so the LIMIT is applied once. SPEC section 9.
    ``holder``: as for :func:`claim_delivery`.
    """
    community = v.uuid_value(community_id, "community_id")
    target = v.bytes32(target_pubkey, "target_pubkey")
    count = v.int_in_range(limit, "limit", 1, MAX_CLAIM_BATCH)
    seconds = v.lease_seconds(lease_seconds)
    who = v.optional_text(holder, "holder", HOLDER_MAX_CHARS)
    return _run_claim(community, target, count, seconds, holder=who)


def _lease_params(lease: Any) -> dict[str, Any]:
    if not isinstance(lease, Lease):
        raise v.invalid("lease", f"must be a Lease, not {type(lease).__name__}")
    return {
        "community_id": lease.community_id,
        "delivery_id": lease.delivery_id,
        "target_pubkey": lease.target_pubkey,
        "lease_generation": lease.lease_generation,
    }


@tenant_scoped
def renew_delivery(lease: Lease, lease_seconds: float | None = None) -> RenewOutcome:
    """Extend a current lease to ``now() + lease_seconds`` (SPEC section 4.4).

    Only where community, id, target and generation match, the status is ``claimed`` and
    ``lease_until >= now()`` (database clock). Never bumps the generation; counts the renewal
    (``renewals``, reported by the lease's closing history entry). Returns
    :class:`Renewed` with the new lease, or :class:`LeaseLost`.
    """
    params = _lease_params(lease)
    params["lease_seconds"] = v.lease_seconds(lease_seconds)
    rows = _fenced_as_nothing(sql.RENEW_IF_CURRENT_GENERATION, params)
    if not rows:
        return LeaseLost()
    return Renewed(
        lease=Lease.from_database(
            lease.community_id, lease.delivery_id, lease.target_pubkey, lease.lease_generation, rows[0][0]
        )
    )


def checked_settle(
    outcome: Any, failure_code: Any, failure_message: Any, retry_after: Any, prefix: str = ""
) -> tuple[str | None, str | None, float | None]:
    """A settle's arguments as :func:`finish_delivery` takes them: ``(failure_code,
    failure_message, retry_after)`` checked against ``outcome``; a ``ValidationError`` keyed
    ``prefix`` + the argument's name otherwise (the batch's ``settles[2].failure_code``)."""
    if outcome not in OUTCOMES:
        raise v.invalid(f"{prefix}outcome", f"must be one of {', '.join(OUTCOMES)}, got {outcome!r}")
    code = v.optional_text(failure_code, f"{prefix}failure_code", 64)
    message = v.optional_text(failure_message, f"{prefix}failure_message", 10_000)
    if code is not None and outcome != "failed":
        raise v.invalid(f"{prefix}failure_code", f"is recorded only with outcome 'failed', not {outcome!r}")
    if message is not None and outcome == "finished":
        raise v.invalid(f"{prefix}failure_message", "is not recorded with outcome 'finished'")
    after = backoff.argument(retry_after, f"{prefix}retry_after")
    if after is not None and outcome != "retry":
        raise v.invalid(f"{prefix}retry_after", f"is honoured only with outcome 'retry', not {outcome!r}")
    return code, message, after


@tracing.traced("buzz.settle")
@tenant_scoped
def finish_delivery(
    lease: Lease,
    outcome: str,
    *,
    failure_code: str | None = None,
    failure_message: str | None = None,
    retry_after: float | None = None,
) -> FinishOutcome:
    """Settle a delivery once (SPEC sections 4.5 and 6).

    ``outcome``: ``"finished"``, ``"failed"`` (``failure_code`` <= 64 chars and
    ``failure_message`` allowed) or ``"retry"`` (back to ``pending`` after an exponential
    backoff with jitter, within [1/2, 1] of base * 2**(attempt - 1) capped, see
    :mod:`buzz_delivery.backoff`; not before ``retry_after`` seconds when given, e.g. a
    provider's Retry-After; on the last allowed attempt it ends ``failed``/``attempts_exhausted``
    instead; ``failure_message`` allowed).

    Applies only where community, id, target and generation match, the status is ``claimed``
    and ``lease_until >= now()``: returns :class:`Settled` with the recorded status. If nothing
    matched, reads the row fenced by the same community, id, target and generation: if that row
    is terminal, the caller settled it before and gets :class:`AlreadyTerminal` (the recorded
    status never flips); a repeated ``retry`` by the same holder gets ``Settled("pending")``
    again; otherwise :class:`LeaseLost` — so a stale holder never hears about a newer
    holder's settlement.
    """
    params = _lease_params(lease)
    code, message, after = checked_settle(outcome, failure_code, failure_message, retry_after)
    if outcome == "retry":
        conf = get_settings()
        statement = cached.RETRY.call  # two tables when exhausted: a function (one task on Citus)
        params.update(
            failure_message=message,
            backoff_base=float(conf.retry_backoff_base_seconds),
            backoff_cap=float(conf.retry_backoff_cap_seconds),
            jitter=backoff.jitter(),
            retry_after=after or 0.0,
        )
    else:
        statement = cached.FINISH.call
        params.update(status=outcome, failure_code=code, failure_message=message)
    rows = _fenced_as_nothing(statement, params)
    if rows:
        return Settled(status=rows[0][0])
    fenced = fetch_all(sql.STATUS_AT_GENERATION, params)
    recorded = fenced[0][0] if fenced else None
    if recorded in TERMINAL_STATUSES:
        return AlreadyTerminal(status=recorded)
    if recorded == "pending" and outcome == "retry":
        # Only this holder's own retry leaves the row pending at its generation (claims, reaps
        # and operator moves all bump it): a repeated retry is idempotent, not a lost lease.
        return Settled(status="pending")
    return LeaseLost()


@tenant_scoped
def get_delivery(community_id: uuid.UUID | str, delivery_id: uuid.UUID | str) -> WorkflowAgentDelivery | None:
    """The delivery with that id in that community, or None (SPEC section 4.7).

    The JSON snapshots are deferred (loaded on first access)."""
    community = v.uuid_value(community_id, "community_id")
    wanted = v.uuid_value(delivery_id, "delivery_id")
    return WorkflowAgentDelivery.objects.defer(*sql.DEFERRED_FIELDS).filter(community_id=community, id=wanted).first()


@tenant_scoped
def load_snapshots(community_id: uuid.UUID | str, deliveries: list[WorkflowAgentDelivery]) -> None:
    """Load the JSON snapshots (``execution_trace``, ``trigger_context``) of claimed
    ``deliveries`` of one community, in one statement, onto the instances: for a handler that
    cannot load them on first access (an ``async def`` handler on the worker's event loop, where
    Django refuses the ORM). A delivery no longer there keeps them deferred."""
    community = v.uuid_value(community_id, "community_id")
    by_id = {d.id: d for d in deliveries}
    if not by_id:
        return
    # PostgreSQL reads a uuid's 32 hex digits without hyphens too: ``UUID.hex`` is the cheapest text.
    ids = "{" + ",".join(delivery_id.hex for delivery_id in by_id) + "}"
    fields = _snapshot_fields()
    for delivery_id, *values in fetch_all(sql.SNAPSHOTS, {"community_id": community, "ids": ids}):
        delivery = by_id[delivery_id]
        for field, value in zip(fields, values, strict=True):
            # As the ORM reads a JSON field (Django loads jsonb as text, the field decodes it).
            setattr(delivery, field.attname, field.from_db_value(value, None, connection))


def _snapshot_fields() -> tuple[Any, ...]:
    """The model fields of :data:`sql.SNAPSHOT_FIELDS`, in that order."""
    return tuple(WorkflowAgentDelivery._meta.get_field(name) for name in sql.SNAPSHOT_FIELDS)
