"""The producer side for many messages at once (SPEC sections 4.1-4.2; issue 31): the identity
locks of many (run, step) in one statement, and the deliveries of many messages of one
community in one statement. Used by a batch of workflow ``send_message`` steps; each keeps
what :func:`~buzz_delivery.services.lock_delivery_identity` and
:func:`~buzz_delivery.services.commit_deliveries` guarantee for one message.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connection, transaction

from buzz_delivery import tracing
from buzz_delivery.conf import get_settings
from buzz_delivery.exceptions import NotInTransaction
from buzz_delivery.models import PRIORITY_MAX, PRIORITY_MIN
from buzz_delivery.services import sql
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, translated_errors
from buzz_delivery.services.producer import (
    MAX_BINDINGS_PER_COMMIT,
    _announce,
    _snapshot,
    binding_columns,
    queue_created,
)
from buzz_delivery.services.tenancy import tenant_scoped
from buzz_delivery.services.types import Binding
from buzz_delivery.triggers import IDENTITY_LOCK_NAMESPACE


@dataclass(frozen=True, slots=True)
class Message:
    """The deliveries of one message: its ``bindings`` (one message event, 1.. targets), the
    ``trigger_context`` (a JSON value, the trace context added when tracing) and ``priority``
    (``PRIORITY_MIN..PRIORITY_MAX``) they carry."""

    bindings: Sequence[Binding]
    trigger_context: Any = None
    priority: int = 0


@tenant_scoped
def lock_delivery_identities(community_id: uuid.UUID | str, identities: Sequence[tuple[Any, str]]) -> None:
    """:func:`~buzz_delivery.services.lock_delivery_identity`'s lock for many (run, step) of one
    community, in one statement, in a stable order (sorted by key: two batches never wait for
    each other's keys in opposite orders). Reads nothing: the caller's statements after it see
    every producer that committed before the locks were granted. Must run inside
    ``transaction.atomic()`` (the locks end with it); raises :class:`NotInTransaction`
    otherwise (and at any isolation level but READ COMMITTED), ``ValidationError`` keyed
    ``identities[i]...`` on bad input."""
    community = v.uuid_value(community_id, "community_id")
    if isinstance(identities, str | bytes) or not isinstance(identities, Sequence):
        raise v.invalid("identities", "must be a list of (run_id, step_id)")
    found: set[str] = set()
    for i, identity in enumerate(identities):
        if isinstance(identity, str | bytes) or not isinstance(identity, Sequence) or len(identity) != 2:
            raise v.invalid(f"identities[{i}]", "must be a (run_id, step_id) pair")
        run = v.uuid_value(identity[0], f"identities[{i}].run_id")
        found.add(f"{community}/{run}/{v.step_id(identity[1])}")
    if not connection.in_atomic_block:
        raise NotInTransaction("lock_delivery_identities needs the caller's transaction (transaction.atomic())")
    keys = sorted(found)
    if keys:
        isolation = fetch_all(sql.LOCK_IDENTITIES, {"namespace": IDENTITY_LOCK_NAMESPACE, "keys": keys})[0][1]
        if isolation != "read committed":
            # As lock_delivery_identity: under REPEATABLE READ / SERIALIZABLE the snapshot predates
            # the locks, so the statements after them could miss a producer that committed meanwhile
            # (the locks taken end with the caller's transaction).
            raise NotInTransaction(f"lock_delivery_identities needs READ COMMITTED, not {isolation.upper()}")


@tenant_scoped
def commit_messages(community_id: uuid.UUID | str, messages: Sequence[Message]) -> list[uuid.UUID]:
    """Commit the deliveries of many messages of one community in one statement (then their
        queue rows in a second one, issue 31), all or none:
        :func:`~buzz_delivery.services.commit_deliveries` (no TTL, no execution trace, no
        ``not_before``, no singleton key) for each message, with its own trigger context and
        priority. Each message's bindings must name one message event (its ``message_event_id``;
        the caller has saved that event in this community); no identity twice in the batch; at most
        10,000 bindings in all. A binding whose identity exists already is skipped (a producer's
        retry). Inside the caller's transaction a refused statement aborts that transaction (no
    savepoint). Returns the ids created; one wake hint per created delivery at commit, and
        :data:`~buzz_delivery.signals.deliveries_committed` after commit, per message. Raises
        ``ValidationError`` keyed ``messages[i]...`` before any SQL."""
    community = v.uuid_value(community_id, "community_id")
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise v.invalid("messages", "must be a non-empty list of Message")
    rows: list[tuple[Binding, str | None, int]] = []
    seen: set[tuple[Any, ...]] = set()
    for i, message in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(message, Message):
            raise v.invalid(name, f"must be a Message, not {type(message).__name__}")
        if not message.bindings:
            raise v.invalid(f"{name}.bindings", "must hold at least one Binding")
        event_id = None
        for j, binding in enumerate(message.bindings):
            where = f"{name}.bindings[{j}]"
            if not isinstance(binding, Binding):
                raise v.invalid(where, f"must be a Binding, not {type(binding).__name__}")
            if binding.community_id != community:
                raise v.invalid(f"{where}.community_id", "differs from the call's community_id")
            if event_id is not None and binding.message_event_id != event_id:
                raise v.invalid(f"{where}.message_event_id", "differs from the message's first binding")
            event_id = binding.message_event_id
            if binding.identity in seen:
                raise v.invalid(where, "repeats the identity (run, step_id, target_pubkey) of an earlier binding")
            seen.add(binding.identity)
        rank = v.int_in_range(message.priority, f"{name}.priority", PRIORITY_MIN, PRIORITY_MAX)
        context = _snapshot(tracing.with_trace(message.trigger_context), f"{name}.trigger_context")
        rows.extend((binding, context, rank) for binding in message.bindings)
    if len(rows) > MAX_BINDINGS_PER_COMMIT:
        raise v.invalid("messages", f"must hold at most {MAX_BINDINGS_PER_COMMIT} bindings, got {len(rows)}")
    bindings = [b for b, _, _ in rows]
    params: dict[str, Any] = {
        "community_id": community,
        "max_attempts": get_settings().max_attempts,
        "channel": get_settings().notify_channel,
        **binding_columns(bindings),
        "message_event_ids": [b.message_event_id for b in bindings],
        "trigger_contexts": [context for _, context, _ in rows],
        "priorities": [rank for _, _, rank in rows],
    }
    # No savepoint: a refused statement aborts the caller's transaction (a batch of sends is
    # then sent again one message at a time). The records, then their queue rows (issue 31,
    # stage 2: one table a statement, as Citus plans them), in one transaction.
    with translated_errors("messages."), transaction.atomic(savepoint=False):
        created = fetch_all(sql.INSERT_DELIVERIES_MANY_SKIP_EXISTING, params)
        created_set = queue_created(community, [row[0] for row in created])
    ids = params["ids"]
    _announce(community, bindings, ids, created_set)
    return [i for i in ids if i in created_set]
