"""The producer side (SPEC section 4.1-4.2): identity lock and the only insert path."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any, Literal, overload

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection, transaction

from buzz_delivery import jsonbounds, signals, tracing
from buzz_delivery.conf import get_settings
from buzz_delivery.exceptions import NotInTransaction
from buzz_delivery.models import PRIORITY_MAX, PRIORITY_MIN, Event, new_uuid7
from buzz_delivery.services import singleton, sql
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, translated_errors
from buzz_delivery.services.tenancy import tenant_scoped
from buzz_delivery.services.types import Binding
from buzz_delivery.triggers import IDENTITY_LOCK_NAMESPACE

MAX_BINDINGS_PER_COMMIT = 10_000
MAX_SNAPSHOT_BYTES = 1_000_000
# "\u0000" in JSON text that is not itself an escaped backslash followed by "u0000".
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
# A surrogate escape "\ud800".."\udfff" in JSON text that is not an escaped backslash followed by "ud...".
_JSON_SURROGATE = re.compile(r"(?<!\\)(?:\\\\)*\\u[dD][89abcdefABCDEF]")


@tenant_scoped
def lock_delivery_identity(community_id: uuid.UUID | str, run_id: uuid.UUID | str, step_id: str) -> bool:
    """Serialise producers of one (community, run, step) and say whether deliveries exist for it.

    Takes a transaction-scoped advisory lock (released when the caller's transaction ends),
    then reads, in a second statement so its snapshot sees every producer that committed
    before the lock was granted. Returns True when at least one delivery already exists,
    so a retrying producer can reuse its posted message instead of posting twice.

    Must run inside ``transaction.atomic()`` at READ COMMITTED (Django's default); raises
    :class:`NotInTransaction` otherwise.
    Raises ``ValidationError`` (keyed by argument) on bad input. SPEC section 4.1.
    """
    community = v.uuid_value(community_id, "community_id")
    run = v.uuid_value(run_id, "run_id")
    step = v.step_id(step_id)
    if not connection.in_atomic_block:
        raise NotInTransaction("lock_delivery_identity needs the caller's transaction (transaction.atomic())")
    isolation = fetch_all(sql.TRANSACTION_ISOLATION, {})[0][0]
    if isolation != "read committed":
        # Under REPEATABLE READ / SERIALIZABLE the snapshot predates the lock, so the read below
        # could miss a producer that committed while this one waited.
        raise NotInTransaction(f"lock_delivery_identity needs READ COMMITTED, not {isolation.upper()}")
    key = f"{community}/{run}/{step}"
    fetch_all(sql.LOCK_IDENTITY, {"namespace": IDENTITY_LOCK_NAMESPACE, "key": key})
    rows = fetch_all(sql.IDENTITY_EXISTS, {"community_id": community, "run_id": run, "step_id": step})
    return bool(rows[0][0])


def _snapshot(value: Any, name: str) -> str | None:
    if value is None:
        return None
    try:
        # Nesting every reader (the admin too) can load back, judged without recursion: Python
        # 3.11's json stopped near 1,000 levels on its recursion limit, 3.12+ encodes far deeper.
        jsonbounds.check(value, strict=False)
    except jsonbounds.JSONRefused as exc:
        raise v.invalid(name, str(exc)) from None
    try:
        text = json.dumps(value, cls=DjangoJSONEncoder, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise v.invalid(name, f"must be JSON-serialisable (no NaN/Infinity, not nested too deep): {exc}") from None
    if _JSON_NUL.search(text):
        raise v.invalid(name, "must not contain NUL characters (PostgreSQL jsonb cannot store \\u0000)")
    if _JSON_SURROGATE.search(text):
        # json.dumps writes a real astral character as a valid pair of surrogate escapes (stored
        # fine), a lone surrogate code point as an unpaired escape (jsonb refuses it) and a pair
        # split into two code points as the very same valid pair (jsonb would store another string
        # than the one given). Only the strings tell them apart: UTF-8 encodes every astral
        # character and no surrogate code point.
        try:
            json.dumps(value, cls=DjangoJSONEncoder, allow_nan=False, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise v.invalid(
                name,
                f"must be valid Unicode: a string holds U+{ord(exc.object[exc.start]):04X}, a surrogate code "
                "point, which UTF-8 text (and so PostgreSQL jsonb) cannot store",
            ) from None
    if len(text.encode()) > MAX_SNAPSHOT_BYTES:
        raise v.invalid(name, f"must serialise to at most {MAX_SNAPSHOT_BYTES} bytes")
    return text


@overload
def commit_deliveries(
    community_id: uuid.UUID | str,
    message_event: Event,
    bindings: Sequence[Binding],
    *,
    expires_at: Any = ...,
    execution_trace: Any = ...,
    trigger_context: Any = ...,
    not_before: Any = ...,
    priority: int = ...,
    singleton_key: None = ...,
    on_conflict: Literal["keep", "replace"] = ...,
) -> list[uuid.UUID]: ...


@overload
def commit_deliveries(
    community_id: uuid.UUID | str,
    message_event: Event,
    bindings: Sequence[Binding],
    *,
    expires_at: Any = ...,
    execution_trace: Any = ...,
    trigger_context: Any = ...,
    not_before: Any = ...,
    priority: int = ...,
    singleton_key: str,
    on_conflict: Literal["keep", "replace"] = ...,
) -> singleton.SingletonCommit: ...


@tracing.traced("buzz.commit")
@tenant_scoped
def commit_deliveries(
    community_id: uuid.UUID | str,
    message_event: Event,
    bindings: Sequence[Binding],
    *,
    expires_at: Any = None,
    execution_trace: Any = None,
    trigger_context: Any = None,
    not_before: Any = None,
    priority: int = 0,
    singleton_key: str | None = None,
    on_conflict: Literal["keep", "replace"] = "keep",
) -> list[uuid.UUID] | singleton.SingletonCommit:
    """Commit one delivery per binding, all or none, in one transaction (SPEC section 4.2): the
    records, then their rows in the live queue (issue 31, stage 2).

    ``message_event``: the saved :class:`~buzz_delivery.models.Event` the deliveries carry;
    it must belong to ``community_id`` and every binding's ``message_event_id`` must be its
    ``event_id``. ``bindings``: 1..10,000 :class:`Binding` of this community, no identity twice.
    ``expires_at``: optional aware datetime (TTL, SPEC section 6). ``execution_trace`` /
    ``trigger_context``: optional JSON values (<= 1,000,000 bytes each) stored immutably.
    ``not_before``: optional aware datetime before which no claim takes the deliveries (it is
    their retry gate, ``next_attempt_at``, from the start; django.tasks' ``run_after``).
    ``priority``: an int in ``PRIORITY_MIN..PRIORITY_MAX`` (-10..10, default 0); claims take
    higher priorities first, oldest first within one (issue 32, docs/flow-control.md).
    ``singleton_key``: optional, 1..64 characters of ``A-Z a-z 0-9 _ . : -``: at most one
    unclaimed pending delivery per (community, target, key) (debounce, issue 32,
    :mod:`buzz_delivery.services.singleton`); one binding per target. ``on_conflict`` says what
    a commit does for a target whose key a pending delivery holds: ``"keep"`` (default) writes
    nothing for it and reports the holder, ``"replace"`` supersedes the holder (``expired`` /
    ``superseded``) and commits the new one. With a key the call returns a
    :class:`~buzz_delivery.services.singleton.SingletonCommit` (one typed outcome per binding).

    A binding whose identity (community, run, step, target) already exists is skipped
    silently (a producer retry). Returns the ids actually created, in binding order (a retry
    returns ``[]``). One wake hint per created delivery is published at commit (PostgreSQL
    NOTIFY is transactional), and :data:`buzz_delivery.signals.deliveries_committed` is sent
    after commit.

    Raises ``ValidationError`` keyed by the argument (``bindings[3].step_id``, ``message_event``,
    ``expires_at``...) before any SQL, or when a referenced workflow, run or event does not
    exist in this community (nothing is written); :class:`CommunityNotWritable` when the
    community is not active.
    """
    community = v.uuid_value(community_id, "community_id")
    if not isinstance(message_event, Event) or message_event.pk is None:
        raise v.invalid("message_event", "must be a saved buzz_delivery.models.Event")
    if message_event.community_id != community:
        raise v.invalid("message_event", "belongs to another community")
    event_id = v.bytes32(message_event.event_id, "message_event.event_id")
    if isinstance(bindings, str | bytes) or not isinstance(bindings, Sequence):
        raise v.invalid("bindings", f"must be a list of Binding, not {type(bindings).__name__}")
    if not bindings:
        raise v.invalid("bindings", "must hold at least one Binding")
    if len(bindings) > MAX_BINDINGS_PER_COMMIT:
        raise v.invalid("bindings", f"must hold at most {MAX_BINDINGS_PER_COMMIT} bindings, got {len(bindings)}")
    seen: set[tuple[Any, ...]] = set()
    for i, binding in enumerate(bindings):
        name = f"bindings[{i}]"
        if not isinstance(binding, Binding):
            raise v.invalid(name, f"must be a Binding, not {type(binding).__name__}")
        if binding.community_id != community:
            raise v.invalid(f"{name}.community_id", "differs from the call's community_id")
        if binding.message_event_id != event_id:
            raise v.invalid(f"{name}.message_event_id", "differs from message_event.event_id")
        if binding.identity in seen:
            raise v.invalid(name, "repeats the identity (run, step_id, target_pubkey) of an earlier binding")
        seen.add(binding.identity)
    if expires_at is not None:
        expires_at = v.aware_datetime(expires_at, "expires_at")  # in UTC
    if not_before is not None:
        not_before = v.aware_datetime(not_before, "not_before")  # in UTC
    rank = v.int_in_range(priority, "priority", PRIORITY_MIN, PRIORITY_MAX)
    key = None if singleton_key is None else singleton.singleton_key(singleton_key)
    mode = singleton.on_conflict(on_conflict)
    if key is not None:
        singleton.check_one_binding_per_target(bindings)
    elif mode == "replace":
        raise v.invalid("on_conflict", "'replace' needs a singleton_key (what would it replace?)")
    trace = _snapshot(execution_trace, "execution_trace")
    context = _snapshot(tracing.with_trace(trigger_context), "trigger_context")

    params = {
        "community_id": community,
        "message_event_id": event_id,
        "max_attempts": get_settings().max_attempts,
        "expires_at": expires_at,
        "not_before": not_before,
        "priority": rank,
        "execution_trace": trace,
        "trigger_context": context,
        "channel": get_settings().notify_channel,
        **binding_columns(bindings),
    }
    if key is not None:
        # Its rounds commit or roll back together (a savepoint inside the caller's transaction).
        with translated_errors("bindings."), transaction.atomic():
            result = singleton.commit(params, key, mode)
        _announce(community, bindings, params["ids"], set(result.created))
        return result
    # The records, then their queue rows (two statements: one table each, as Citus plans them),
    # in one transaction; inside the caller's, a savepoint keeps a refused commit from breaking it.
    with translated_errors("bindings."), transaction.atomic():
        rows = fetch_all(sql.INSERT_DELIVERIES_SKIP_EXISTING, params)
        created_set = queue_created(community, [row[0] for row in rows])
    _announce(community, bindings, params["ids"], created_set)
    return [i for i in params["ids"] if i in created_set]


def queue_created(community: uuid.UUID, created: list[Any]) -> set[Any]:
    """The commit's second statement (issue 31, stage 2): the queue rows of the records it just
    created (:data:`sql.INSERT_QUEUE_ROWS_OF_CREATED`), in the caller's transaction; returns the
    ids that got one (all of them without a singleton key)."""
    if not created:
        return set()
    rows = fetch_all(sql.INSERT_QUEUE_ROWS_OF_CREATED, {"community_id": community, "created_ids": created})
    return {row[0] for row in rows}


def _announce(community: uuid.UUID, bindings: Sequence[Binding], ids: list[Any], created_set: set[Any]) -> None:
    """Send :data:`~buzz_delivery.signals.deliveries_committed` after commit for the created ones."""
    created = [i for i in ids if i in created_set]
    if created:
        transaction.on_commit(
            lambda: signals.deliveries_committed.send(
                sender=Binding,
                community_id=community,
                delivery_ids=created,
                target_pubkeys=[b.target_pubkey for b, i in zip(bindings, ids, strict=True) if i in created_set],
            )
        )


def binding_columns(bindings: Sequence[Binding]) -> dict[str, list[Any]]:
    """The bindings' columns as the insert statements' parallel arrays, each row a new id."""
    return {
        "ids": [new_uuid7() for _ in bindings],
        "workflow_ids": [b.workflow_id for b in bindings],
        "run_ids": [b.run_id for b in bindings],
        "step_ids": [b.step_id for b in bindings],
        "target_pubkeys": [b.target_pubkey for b in bindings],
        "definition_event_ids": [b.definition_event_id for b in bindings],
        "cause_kinds": [b.cause.kind for b in bindings],
        "cause_event_ids": [b.cause.event_id for b in bindings],
        "cause_scheduled_fors": [b.cause.scheduled_for for b in bindings],
        "cause_webhook_invocation_ids": [b.cause.webhook_invocation_id for b in bindings],
    }
