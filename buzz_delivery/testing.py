"""Test helpers for projects that install buzz_delivery (SPEC section 9).

factory-boy factories for every model, a :class:`BindingFactory` for the binding
dataclass, a :class:`DeliveryFactory` that inserts through
:func:`buzz_delivery.services.commit_deliveries` (the only insert path), and
:func:`advance_to` to move a community through its lifecycle, :func:`frozen_db_clock` to
make the services' database clock stand still inside a test's transaction, and the one path by
which a test writes a delivery's row directly (:func:`set_delivery_state`, :func:`backdate`,
:func:`insert_delivery_rows`, :func:`delete_delivery_rows`): the delivery table is to split into a
record, a queue and an outcome (issue 31), and then only these change.

Needs ``factory-boy``: ``pip install 'buzz-delivery[testing]'`` (importing this module
without it raises an ``ImportError`` that says so).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeAlias

try:
    import factory
except ImportError as exc:  # a plain install: say which extra brings it
    raise ImportError(
        "buzz_delivery.testing needs factory-boy: pip install 'buzz-delivery[testing]'", name=exc.name
    ) from exc
from django.db import connection, transaction
from django.db.models import Model
from django.utils import timezone

from buzz_delivery import models, services
from buzz_delivery.models import LIFECYCLE_ORDER


def random32() -> bytes:
    """32 random bytes: an event id or public key."""
    return os.urandom(32)


class CommunityFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = models.Community

    name = factory.Sequence(lambda n: f"community-{n}")


class WorkflowFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = models.Workflow

    community = factory.SubFactory(CommunityFactory)
    name = factory.Sequence(lambda n: f"workflow-{n}")


class WorkflowRunFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = models.WorkflowRun

    community = factory.SubFactory(CommunityFactory)
    workflow = factory.SubFactory(WorkflowFactory, community=factory.SelfAttribute("..community"))


class EventFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = models.Event

    community = factory.SubFactory(CommunityFactory)
    event_id = factory.LazyFunction(random32)
    created_at = factory.LazyFunction(timezone.now)
    kind = 1
    pubkey = factory.LazyFunction(random32)
    content = factory.Sequence(lambda n: f"message {n}")
    tags = factory.LazyFunction(list)


class BindingFactory(factory.Factory):
    """A valid :class:`~buzz_delivery.services.Binding`. Pass ``run`` (a saved WorkflowRun) and
    ``message_event`` (a saved Event) to bind to existing rows; otherwise they are created."""

    class Meta:
        model = services.Binding
        exclude = ("run", "message_event")

    run = factory.SubFactory(WorkflowRunFactory)
    message_event = factory.SubFactory(EventFactory, community=factory.SelfAttribute("..run.community"))
    community_id = factory.SelfAttribute("run.community_id")
    workflow_id = factory.SelfAttribute("run.workflow_id")
    run_id = factory.SelfAttribute("run.id")
    step_id = factory.Sequence(lambda n: f"send_message_{n}")
    target_pubkey = factory.LazyFunction(random32)
    definition_event_id = factory.LazyFunction(random32)
    message_event_id = factory.LazyAttribute(lambda o: bytes(o.message_event.event_id))
    cause = factory.LazyFunction(lambda: services.Cause.webhook(uuid.uuid4()))


class DeliveryFactory(factory.Factory):
    """A committed :class:`~buzz_delivery.models.WorkflowAgentDelivery`, inserted through
    ``services.commit_deliveries``. Accepts the :class:`BindingFactory` fields."""

    class Meta:
        model = models.WorkflowAgentDelivery

    binding = factory.SubFactory(BindingFactory)

    @classmethod
    def _create(cls, model_class: type, *args: Any, binding: services.Binding, **kwargs: Any) -> Any:
        event = models.Event.objects.get(community_id=binding.community_id, event_id=binding.message_event_id)
        (created,) = services.commit_deliveries(binding.community_id, event, [binding], **kwargs)
        return models.WorkflowAgentDelivery.objects.get(id=created)

    @classmethod
    def _build(cls, model_class: type, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("DeliveryFactory only creates (through services.commit_deliveries)")


def advance_to(community: models.Community | uuid.UUID | str, state: str) -> models.Community:
    """Move a community forward through each lifecycle state up to ``state``.

    ``tombstone`` is reached through :func:`services.purge_community`."""
    community_id = community.pk if isinstance(community, models.Community) else community
    current = models.Community.objects.get(pk=community_id)
    target = LIFECYCLE_ORDER.index(state)
    while LIFECYCLE_ORDER.index(current.deletion_state) < target:
        following = LIFECYCLE_ORDER[LIFECYCLE_ORDER.index(current.deletion_state) + 1]
        if following == "tombstone":
            services.purge_community(community_id)
            current.refresh_from_db()
        else:
            current = services.advance_community(community_id, following)
    return current


_CLOCK_FUNCTION = (
    "CREATE OR REPLACE FUNCTION buzz_delivery_now() RETURNS timestamptz LANGUAGE sql STABLE PARALLEL SAFE AS $$ {} $$"
)
_STATEMENT_CLOCK = "SELECT statement_timestamp()"


@contextmanager
def frozen_db_clock(at: dt.datetime | None = None) -> Iterator[None]:
    """Make the services' database clock (``buzz_delivery_now()``, migration 0006) stand still
    at ``at`` (an aware datetime; default: ``now()``, the start of the current transaction)
    for the rest of the block, so exact lease deadlines can be asserted. Only inside the
    caller's transaction (``transaction.atomic()``, or a pytest-django test's): the change is
    transactional DDL, invisible to other connections, undone at the end of the block or by a
    rollback. Raises ``RuntimeError`` in autocommit, where it would change the clock of every
    connection, and ``ValueError`` for a naive ``at``. On Citus the function is distributed and
    Citus re-creates it on the workers in the same transaction, which it allows only when the
    transaction runs its multi-shard statements over one connection per node from its start
    (``citus.multi_shard_modify_mode = 'sequential'``, the default of the suite's Citus test
    database)."""
    if not connection.in_atomic_block:
        raise RuntimeError("frozen_db_clock needs the caller's transaction (transaction.atomic())")
    if at is None:  # read here, not in the function: on Citus each node's now() is its own
        with connection.cursor() as cursor:
            cursor.execute("SELECT now()")
            at = cursor.fetchone()[0]
    if at.tzinfo is None or at.utcoffset() is None:
        raise ValueError("frozen_db_clock: at must be timezone-aware")
    body = f"SELECT '{at.astimezone(dt.UTC).isoformat()}'::timestamptz"
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(_CLOCK_FUNCTION.format(body))
    try:
        yield
    finally:
        if not connection.needs_rollback:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(_CLOCK_FUNCTION.format(_STATEMENT_CLOCK))


# --- direct writes of a delivery's row (tests only) ----------------------------------------

DELIVERY_TABLE = models.DeliveryRecord._meta.db_table  # writes name the record (issue 31, stage 1)
# The live state of a pending or claimed delivery (issue 31, stage 2): the helpers write a live
# row's live columns there, and the record for everything else.
QUEUE_TABLE = models.DeliveryQueue._meta.db_table
DELIVERY_VIEW = models.WorkflowAgentDelivery._meta.db_table
_LIVE = frozenset({models.DeliveryStatus.PENDING.value, models.DeliveryStatus.CLAIMED.value})
# The record's columns a queue row copies at commit (written to both tables), and the queue row's
# live state (written to the queue alone while the delivery is live). ``expires_at`` is written
# to both: the services never change it on a live delivery (commit copies it, requeue writes the
# record and copies it again), and a terminal leaves the record's; a helper that moved only the
# queue's (a test's clock shift) made a delivery expire with a TTL the services never had.
_COPIED = ("target_pubkey", "workflow_id", "priority", "created_at", "max_attempts", "expires_at")
_QUEUE_COLUMNS: tuple[str, ...] = tuple(
    str(f.column) for f in models.DeliveryQueue._meta.concrete_fields if f.column not in ("id", "community_id")
)
_LIVE_COLUMNS = tuple(c for c in _QUEUE_COLUMNS if c not in _COPIED)
# A terminal: what the record's lease and slot columns become (the services' terminals clear them).
_CLEARED_AT_TERMINAL = (
    "lease_until",
    "claimed_at",
    "next_attempt_at",
    "slot_community",
    "slot_target",
    "slot_workflow",
)


@dataclass(frozen=True)
class Expr:
    """A piece of SQL with its ``%s`` parameters: a column's new value computed by the database
    (``Expr("now() - interval '1 second'")``, ``Expr("buzz_delivery_plus_seconds(created_at, %s)",
    [-60])``), or, as the target of the helpers below, a WHERE condition on the delivery table."""

    sql: str
    params: Sequence[Any] = ()


DeliveryKey: TypeAlias = (
    models.WorkflowAgentDelivery | tuple[models.Community | uuid.UUID | str, uuid.UUID | str] | uuid.UUID | str
)
Deliveries: TypeAlias = DeliveryKey | list[DeliveryKey] | models.Community | Expr


def _columns() -> frozenset[str]:
    return frozenset(f.column for f in models.WorkflowAgentDelivery._meta.concrete_fields if f.column)


def _checked(helper: str, names: Iterable[str]) -> list[str]:
    """``names`` if each is a column of the delivery table; otherwise ``ValueError`` naming it."""
    names = list(names)
    known = _columns()
    for name in names:
        if name not in known:
            raise ValueError(f"{helper}: {DELIVERY_TABLE} has no column {name!r}")
    if not names:
        raise ValueError(f"{helper}: no column given")
    return names


def _id(value: Any) -> Any:
    return value.pk if isinstance(value, Model) else value


def _where(deliveries: Deliveries) -> tuple[str, list[Any]]:
    """The WHERE condition selecting ``deliveries``: the community named when it is known
    (router form, SPEC 15); a bare id is looked up for its community as ``backdate_lease`` did."""
    if isinstance(deliveries, Expr):
        return deliveries.sql, list(deliveries.params)
    if isinstance(deliveries, models.Community):
        return "community_id = %s", [deliveries.pk]
    if isinstance(deliveries, models.WorkflowAgentDelivery):
        return "community_id = %s AND id = %s", [deliveries.community_id, deliveries.pk]
    if isinstance(deliveries, tuple):
        community, delivery_id = deliveries
        return "community_id = %s AND id = %s", [_id(community), delivery_id]
    if isinstance(deliveries, list):
        return "id = ANY(%s)", [[d.pk if isinstance(d, Model) else d for d in deliveries]]
    return (
        f"community_id = (SELECT community_id FROM {DELIVERY_TABLE} WHERE id = %s) AND id = %s",
        [deliveries, deliveries],
    )


def _value(value: Any) -> tuple[str, list[Any]]:
    if isinstance(value, Expr):
        return value.sql, list(value.params)
    if isinstance(value, dict | list):
        return "%s::jsonb", [json.dumps(value)]
    return "%s", [value]


def _selected(deliveries: Deliveries) -> list[tuple[Any, Any, bool]]:
    """``(community_id, id, live)`` of the rows ``deliveries`` selects, read through the view (a
    condition on a live column reads the live value); ``live``: the row has a queue row."""
    where, params = _where(deliveries)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT community_id, id, EXISTS (SELECT 1 FROM {QUEUE_TABLE} AS q"
            f" WHERE q.community_id = {DELIVERY_VIEW}.community_id AND q.id = {DELIVERY_VIEW}.id)"
            f" FROM {DELIVERY_VIEW} WHERE {where}",
            params,
        )
        return list(cursor.fetchall())


def _keys(rows: Sequence[tuple[Any, ...]], alias: str = "") -> tuple[str, list[Any]]:
    """A WHERE condition naming exactly ``rows`` (their ``(community_id, id)``): with the
    community as ``community_id = %s`` when they share one (Citus's router form)."""
    prefix = f"{alias}." if alias else ""
    communities = {row[0] for row in rows}
    ids = [row[1] for row in rows]
    if len(communities) == 1:
        return f"{prefix}community_id = %s AND {prefix}id = ANY(%s::uuid[])", [next(iter(communities)), ids]
    return (
        f"({prefix}community_id, {prefix}id) IN (SELECT * FROM unnest(%s::uuid[], %s::uuid[]))",
        [[row[0] for row in rows], ids],
    )


def _update(table: str, values: Mapping[str, tuple[str, list[Any]]], rows: Sequence[tuple[Any, ...]]) -> int:
    if not values or not rows:
        return 0
    where, where_params = _keys(rows)
    params: list[Any] = []
    assignments = []
    for name, (text, text_params) in values.items():
        assignments.append(f"{name} = {text}")
        params += text_params
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET {', '.join(assignments)} WHERE {where}", params + where_params)
        return cursor.rowcount


def _status_given(columns: Mapping[str, Any]) -> str | None:
    status = columns.get("status")
    if status is None:
        return None
    if isinstance(status, Expr):
        raise ValueError("set_delivery_state: status must be a plain value (it decides which table holds the row)")
    return str(status)


def set_delivery_state(deliveries: Deliveries, /, **columns: Any) -> int:
    """Write ``columns`` (column name -> value, or an :class:`Expr` computed by the database; a
    dict or list is stored as jsonb) of the delivery rows ``deliveries`` selects, on the caller's
    connection (its transaction, its tenant context), as a test's raw UPDATE did; the database's
    triggers and CHECKs judge it as they would any write. Returns the number of rows written.

    ``deliveries``: a delivery, a ``(community, id)`` pair, an id (its community is looked up),
    a list of deliveries or ids (``id = ANY``), a community (all its rows), or an :class:`Expr`
    WHERE condition (on the columns as the view shows them). A name that is not a column of the
    table raises ``ValueError`` naming it.

    Where each column goes (issue 31, stage 2): a live row's (pending or claimed) live columns to
    its queue row, its other columns to its record (``created_at``, ``priority``... to both); a
    terminal status on a live row deletes its queue row and writes the record (its live state
    carried over from the queue row, the lease and slots cleared, then ``columns``); a live status
    on a terminal row writes the record (``status`` 'pending') and inserts its queue row (its
    state from the record, then ``columns``). One statement per table and case, each naming the
    rows' community when they share one."""
    names = _checked("set_delivery_state", columns)
    values = {name: _value(columns[name]) for name in names}
    new_status = _status_given(columns)
    rows = _selected(deliveries)
    live = [row for row in rows if row[2]]
    terminal = [row for row in rows if not row[2]]
    # Live rows that stay live: the queue's columns to the queue, the rest to the record.
    if live and (new_status is None or new_status in _LIVE):
        _update(QUEUE_TABLE, {n: v for n, v in values.items() if n in _QUEUE_COLUMNS}, live)
        _update(DELIVERY_TABLE, {n: v for n, v in values.items() if n not in _LIVE_COLUMNS}, live)
    # Live rows made terminal: the record takes the queue row's state, then the queue row goes.
    if live and new_status is not None and new_status not in _LIVE:
        carried: dict[str, tuple[str, list[Any]]] = {c: (f"q.{c}", []) for c in _LIVE_COLUMNS if c != "singleton_key"}
        carried.update({c: ("NULL", []) for c in _CLEARED_AT_TERMINAL})
        carried.update(values)
        where, where_params = _keys(live, "r")
        params = [p for _, (_, ps) in carried.items() for p in ps]
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {DELIVERY_TABLE} AS r SET {', '.join(f'{n} = {t}' for n, (t, _) in carried.items())}"
                f" FROM {QUEUE_TABLE} AS q WHERE q.community_id = r.community_id AND q.id = r.id AND {where}",
                params + where_params,
            )
            where, where_params = _keys(live)
            cursor.execute(f"DELETE FROM {QUEUE_TABLE} WHERE {where}", where_params)
    # Terminal rows: the record; made live, the record pending and a queue row from it.
    if terminal:
        if new_status is not None and new_status in _LIVE:
            record = {n: v for n, v in values.items() if n not in _LIVE_COLUMNS}
            record["status"] = ("'pending'", [])
            _update(DELIVERY_TABLE, record, terminal)
            state: dict[str, tuple[str, list[Any]]] = {c: (c, []) for c in _QUEUE_COLUMNS}
            state["singleton_key"] = ("NULL", [])
            state.update({n: v for n, v in values.items() if n in _QUEUE_COLUMNS})
            where, where_params = _keys(terminal)
            params = [p for _, (_, ps) in state.items() for p in ps]
            with connection.cursor() as cursor:
                cursor.execute(
                    f"INSERT INTO {QUEUE_TABLE} (id, community_id, {', '.join(state)})"
                    f" SELECT id, community_id, {', '.join(t for t, _ in state.values())}"
                    f" FROM {DELIVERY_TABLE} WHERE {where}",
                    params + where_params,
                )
        else:
            _update(DELIVERY_TABLE, values, terminal)
    return len(rows)


def backdate(deliveries: Deliveries, /, **seconds_ago: float) -> int:
    """Stand-in for time passing: set each named timestamp column (``created_at``,
    ``finished_at``, ``lease_until``, ``claimed_at``, ``next_attempt_at``, ``expires_at``, ...)
    to ``now()`` minus its number of seconds, through :func:`set_delivery_state` (one
    statement). Returns the number of rows written."""
    _checked("backdate", seconds_ago)
    return set_delivery_state(
        deliveries, **{name: Expr("now() - make_interval(secs => %s)", [s]) for name, s in seconds_ago.items()}
    )


def insert_delivery_rows(columns: Sequence[str], query: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> int:
    """Insert raw delivery rows, bypassing ``commit_deliveries`` (for tests that need rows the
    producer would not write, or a table at scale): ``INSERT INTO buzz_delivery_delivery_record
    (columns) <query>``, ``query`` a SELECT (or VALUES) giving those columns in that order, then
    a queue row for each pending or claimed one, with its state (issue 31, stage 2: a claimed row's
    record then becomes pending, its lease and slots cleared). A name that is not a column of the
    table raises ``ValueError`` naming it. Returns the row count."""
    names = _checked("insert_delivery_rows", columns)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {DELIVERY_TABLE} ({', '.join(names)}) {query} RETURNING community_id, id, status", params
        )
        rows = [row for row in cursor.fetchall()]
        live = [row for row in rows if row[2] in _LIVE]
        if live:
            where, where_params = _keys(live)
            state = [c for c in _QUEUE_COLUMNS if not c.startswith("slot_") and c != "singleton_key"]
            cursor.execute(
                f"INSERT INTO {QUEUE_TABLE} (id, community_id, {', '.join(state)},"
                " slot_community, slot_target, slot_workflow, singleton_key)"
                f" SELECT id, community_id, {', '.join(state)},"
                " CASE WHEN status = 'claimed' THEN slot_community END,"
                " CASE WHEN status = 'claimed' THEN slot_target END,"
                " CASE WHEN status = 'claimed' THEN slot_workflow END,"
                " CASE WHEN status = 'pending' AND lease_generation = 0 THEN singleton_key END"
                f" FROM {DELIVERY_TABLE} WHERE {where}",
                where_params,
            )
            claimed = [row for row in live if row[2] == models.DeliveryStatus.CLAIMED]
            if claimed:
                where, where_params = _keys(claimed)
                cursor.execute(
                    f"UPDATE {DELIVERY_TABLE} SET status = 'pending', lease_until = NULL, claimed_at = NULL,"
                    f" slot_community = NULL, slot_target = NULL, slot_workflow = NULL WHERE {where}",
                    where_params,
                )
        return len(rows)


def delete_delivery_rows(deliveries: Deliveries, /) -> int:
    """Delete the delivery rows ``deliveries`` selects (as :func:`set_delivery_state` reads it),
    in one statement on the record (a live row's queue row goes with it: ON DELETE CASCADE),
    bypassing the pruner and the purge. Returns the number of rows deleted."""
    rows = _selected(deliveries)
    if not rows:
        return 0
    where, params = _keys(rows)
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {DELIVERY_TABLE} WHERE {where}", params)
        return cursor.rowcount
