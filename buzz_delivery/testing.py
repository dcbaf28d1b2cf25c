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


def set_delivery_state(deliveries: Deliveries, /, **columns: Any) -> int:
    """Write ``columns`` (column name -> value, or an :class:`Expr` computed by the database; a
    dict or list is stored as jsonb) of the delivery rows ``deliveries`` selects, in one
    statement on the caller's connection (its transaction, its tenant context), as a test's
    raw UPDATE did; the database's triggers and CHECKs judge it as they would any write.
    Returns the number of rows written.

    ``deliveries``: a delivery, a ``(community, id)`` pair, an id (its community is looked up),
    a list of deliveries or ids (``id = ANY``), a community (all its rows), or an :class:`Expr`
    WHERE condition. A name that is not a column of the table raises ``ValueError`` naming it.
    Today: one UPDATE of the record, ``buzz_delivery_delivery_record`` (issue 31, stage 1); later the
    columns of the row's queue or outcome."""
    names = _checked("set_delivery_state", columns)
    assignments, params = [], []
    for name in names:
        text, values = _value(columns[name])
        assignments.append(f"{name} = {text}")
        params += values
    where, where_params = _where(deliveries)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {DELIVERY_TABLE} SET {', '.join(assignments)} WHERE {where}", params + where_params)
        return cursor.rowcount


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
    (columns) <query>``, ``query`` a SELECT (or VALUES) giving those columns in that order. A name
    that is not a column of the table raises ``ValueError`` naming it. Returns the row count."""
    names = _checked("insert_delivery_rows", columns)
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {DELIVERY_TABLE} ({', '.join(names)}) {query}", params)
        return cursor.rowcount


def delete_delivery_rows(deliveries: Deliveries, /) -> int:
    """Delete the delivery rows ``deliveries`` selects (as :func:`set_delivery_state` reads it),
    in one statement, bypassing the pruner and the purge. Returns the number of rows deleted."""
    where, params = _where(deliveries)
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {DELIVERY_TABLE} WHERE {where}", params)
        return cursor.rowcount
