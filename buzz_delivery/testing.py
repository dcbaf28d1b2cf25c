"""Test helpers for projects that install buzz_delivery (SPEC section 9).

factory-boy factories for every model, a :class:`BindingFactory` for the binding
dataclass, a :class:`DeliveryFactory` that inserts through
:func:`buzz_delivery.services.commit_deliveries` (the only insert path), and
:func:`advance_to` to move a community through its lifecycle, and :func:`frozen_db_clock` to
make the services' database clock stand still inside a test's transaction.

Needs ``factory-boy``: ``pip install 'buzz-delivery[testing]'`` (importing this module
without it raises an ``ImportError`` that says so).
"""

from __future__ import annotations

import datetime as dt
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

try:
    import factory
except ImportError as exc:  # a plain install: say which extra brings it
    raise ImportError(
        "buzz_delivery.testing needs factory-boy: pip install 'buzz-delivery[testing]'", name=exc.name
    ) from exc
from django.db import connection, transaction
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
