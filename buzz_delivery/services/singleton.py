"""Debounce / singleton deliveries (issue 32, docs/flow-control.md): a producer may say "one
pending delivery per key" for each target of a commit, ``commit_deliveries(...,
singleton_key="digest", on_conflict="keep" | "replace")``.

**The invariant is in PostgreSQL.** The partial UNIQUE index ``delivery_singleton_pending_key``
on ``(community_id, target_pubkey, singleton_key) WHERE status = 'pending' AND lease_generation
= 0 AND singleton_key IS NOT NULL`` lets one community's target hold at most one *unclaimed*
pending delivery per key. ``lease_generation = 0`` means no claim, reaper or operator ever moved
the row (each of them bumps the generation, which never goes back): only the commit's INSERT
enters the index, and its ``ON CONFLICT DO NOTHING`` is the arbiter, so no retry, reap or
requeue that brings a delivery back to ``pending`` can ever be refused by it. The key is
therefore a debounce key: a delivery that was claimed once (in flight, or pending again after a
retry, a lapsed lease or a requeue) no longer holds it, and a new commit with the key makes a
new pending delivery beside it.

**One statement per commit** (:func:`commit_statement`, Citus's router form: every read and
write names the community): the INSERT of the new deliveries with ``ON CONFLICT DO NOTHING``
(the identity key and the singleton key alike), and, in the same statement, the pending holder
of the key per target and the deliveries that already carry the binding's identity (a
producer's retry). With ``on_conflict="replace"`` the statement first *supersedes* the holder:
it moves it to ``expired`` with ``failure_code = 'superseded'``, a failure message naming the
delivery that replaced it and a ``supersede`` history entry, then inserts the new one (the index
no longer holds the old row for this transaction). The superseded row is never rewritten: its
binding, payload and history stay as they were committed (the binding columns are immutable,
``delivery_binding_immutable``), so the audit shows what was replaced, by what, and when.

A commit whose INSERT met a key taken by a concurrent commit that its snapshot could not see
(both ran at once) is run again for those targets only, in the same transaction, with a fresh
snapshot (READ COMMITTED): a "keep" then reports that delivery, a "replace" supersedes it. Each
round is decided by the unique index, so N concurrent commits of one key leave exactly one
pending delivery.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from buzz_delivery.exceptions import BuzzDeliveryError
from buzz_delivery.models import SINGLETON_KEY_PATTERN
from buzz_delivery.services import sql
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all

OnConflict = Literal["keep", "replace"]
ON_CONFLICT = ("keep", "replace")
SUPERSEDED = "superseded"
# Rounds of one commit before it gives up (each round lost means another commit of the same key
# won one: many concurrent replacers of one key, or a claimer taking each holder at once).
MAX_ROUNDS = 50


class SingletonContended(BuzzDeliveryError):
    """A commit with a singleton key lost the key to concurrent commits in every round it tried
    (:data:`MAX_ROUNDS`); it was rolled back, nothing written."""


def singleton_key(value: Any) -> str:
    """A singleton key: 1..64 characters of ``A-Z a-z 0-9 _ . : -`` (the table's CHECK,
    ``delivery_singleton_key_format``); anything else is a ``ValidationError`` keyed
    ``singleton_key``."""
    if not isinstance(value, str):
        raise v.invalid("singleton_key", f"must be a str, not {type(value).__name__}")
    if not re.fullmatch(SINGLETON_KEY_PATTERN, value):
        raise v.invalid("singleton_key", "must be 1..64 characters of A-Z a-z 0-9 _ . : -")
    return value


def on_conflict(value: Any) -> OnConflict:
    if value not in ON_CONFLICT:
        raise v.invalid("on_conflict", f"must be 'keep' or 'replace', not {value!r}")
    return value  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class Committed:
    """A new pending delivery was committed for this target (no pending one held the key)."""

    delivery_id: uuid.UUID
    target_pubkey: bytes


@dataclass(frozen=True, slots=True)
class Replaced:
    """A new pending delivery was committed for this target and the pending one that held the
    key (``superseded_id``) is now ``expired`` / ``superseded`` (``on_conflict="replace"``)."""

    delivery_id: uuid.UUID
    target_pubkey: bytes
    superseded_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class Kept:
    """A pending delivery of this target already held the key and was kept
    (``on_conflict="keep"``): ``delivery_id`` is that delivery; nothing was written."""

    delivery_id: uuid.UUID
    target_pubkey: bytes


@dataclass(frozen=True, slots=True)
class AlreadyCommitted:
    """A delivery with this binding's identity (community, run, step, target) exists: a
    producer's retry, skipped as every commit skips it; ``delivery_id`` is that delivery."""

    delivery_id: uuid.UUID
    target_pubkey: bytes


TargetOutcome = Committed | Replaced | Kept | AlreadyCommitted


@dataclass(frozen=True, slots=True)
class SingletonCommit:
    """What a commit with a singleton key did: one outcome per binding, in binding order."""

    singleton_key: str
    on_conflict: OnConflict
    outcomes: tuple[TargetOutcome, ...]
    # Statements it took: 1, or more when concurrent commits of the key raced it.
    rounds: int = 1

    @property
    def created(self) -> list[uuid.UUID]:
        """The ids of the deliveries this commit created, in binding order."""
        return [o.delivery_id for o in self.outcomes if isinstance(o, Committed | Replaced)]


_UNNEST = """unnest(
        %(ids)s::uuid[], %(workflow_ids)s::uuid[], %(run_ids)s::uuid[], %(step_ids)s::text[],
        %(target_pubkeys)s::bytea[], %(definition_event_ids)s::bytea[], %(cause_kinds)s::text[],
        %(cause_event_ids)s::bytea[], %(cause_scheduled_fors)s::timestamptz[],
        %(cause_webhook_invocation_ids)s::uuid[]
    ) AS v(
        id, workflow_id, run_id, step_id, target_pubkey, definition_event_id, cause_kind,
        cause_event_id, cause_scheduled_for, cause_webhook_invocation_id
    )"""

# The key's holder: pending and never claimed (the index's predicate).
_HOLDS_KEY = """d.community_id = %(community_id)s AND d.singleton_key = %(singleton_key)s
      AND d.status = 'pending' AND d.lease_generation = 0"""

_SUPERSEDE_ENTRY = sql.history_entry(
    "'supersede'", "d.lease_generation + 1", "'producer'", status="'expired'", superseded_by="s.id::text"
)

# A holder whose target gets a new delivery in this commit, unless that delivery's identity was
# committed before (a producer's retry supersedes nothing).
_SUPERSEDE = f"""
superseded AS (
    UPDATE {sql.RECORD} AS d
    SET status = 'expired',
        finished_at = {sql.DB_NOW},
        failure_code = '{SUPERSEDED}',
        failure_message = 'superseded by delivery ' || s.id::text || ' (singleton key ' || %(singleton_key)s || ')',
        lease_generation = d.lease_generation + 1,
        next_attempt_at = NULL,
        {_SUPERSEDE_ENTRY}
    FROM unnest(%(ids)s::uuid[], %(run_ids)s::uuid[], %(step_ids)s::text[], %(target_pubkeys)s::bytea[])
        AS s(id, run_id, step_id, target_pubkey)
    WHERE d.community_id = %(community_id)s AND d.target_pubkey = s.target_pubkey
      AND d.singleton_key = %(singleton_key)s AND d.status = 'pending' AND d.lease_generation = 0
      AND {sql.ACTIVE_COMMUNITY}
      AND NOT EXISTS (
          SELECT 1 FROM {sql.RECORD} AS e
          WHERE e.community_id = %(community_id)s AND e.run_id = s.run_id AND e.step_id = s.step_id
            AND e.target_pubkey = s.target_pubkey
      )
    RETURNING d.id, d.target_pubkey
),"""


# The INSERT reads the superseding UPDATE's one-row count before its first row: the holders are
# superseded (out of the index for this transaction) before any new delivery meets their key.
# Without it the main SELECT's first arm runs the INSERT first, which then conflicts.
GATE = ", (SELECT count(*) FROM superseded) AS gate"


def commit_statement(*, replace: bool) -> str:
    """The one statement of a commit with a singleton key: rows of ``(what, id, target)`` where
    ``what`` is ``created`` (and a wake hint is sent), ``superseded`` (replace only), ``held``
    (the key's pending holder in the statement's snapshot) or ``already`` (the identity exists)."""
    return f"""
WITH {_SUPERSEDE if replace else ""}
held AS MATERIALIZED (
    SELECT d.id, d.target_pubkey FROM {sql.RECORD} AS d
    WHERE {_HOLDS_KEY} AND d.target_pubkey = ANY (%(target_pubkeys)s::bytea[])
),
already AS MATERIALIZED (
    SELECT d.id, d.target_pubkey FROM {sql.RECORD} AS d
    WHERE d.community_id = %(community_id)s
      AND (d.run_id, d.step_id, d.target_pubkey) IN (
          SELECT i.run_id, i.step_id, i.target_pubkey
          FROM unnest(%(run_ids)s::uuid[], %(step_ids)s::text[], %(target_pubkeys)s::bytea[])
              AS i(run_id, step_id, target_pubkey)
      )
),
created AS (
    INSERT INTO {sql.RECORD} AS d (
        id, community_id, workflow_id, run_id, step_id, target_pubkey, definition_event_id,
        message_event_id, cause_kind, cause_event_id, cause_scheduled_for, cause_webhook_invocation_id,
        max_attempts, expires_at, execution_trace, trigger_context, next_attempt_at, priority, singleton_key
    )
    SELECT v.id, %(community_id)s, v.workflow_id, v.run_id, v.step_id, v.target_pubkey, v.definition_event_id,
           %(message_event_id)s, v.cause_kind, v.cause_event_id, v.cause_scheduled_for, v.cause_webhook_invocation_id,
           %(max_attempts)s, %(expires_at)s, %(execution_trace)s::jsonb, %(trigger_context)s::jsonb,
           %(not_before)s::timestamptz, %(priority)s::smallint, %(singleton_key)s
    FROM {_UNNEST}{GATE if replace else ""}
    -- Identity order, as the plain commit: concurrent producers never deadlock on the keys.
    ORDER BY v.run_id, v.step_id, v.target_pubkey
    ON CONFLICT DO NOTHING
    RETURNING d.id, d.target_pubkey
)
SELECT 'created', created.id, created.target_pubkey,
       pg_notify(%(channel)s, json_build_object(
           'community', %(community_id)s::text,
           'delivery', created.id::text,
           'target', encode(created.target_pubkey, 'hex'))::text)::text
FROM created
{"UNION ALL SELECT 'superseded', superseded.id, superseded.target_pubkey, NULL FROM superseded" if replace else ""}
UNION ALL SELECT 'held', held.id, held.target_pubkey, NULL FROM held
UNION ALL SELECT 'already', already.id, already.target_pubkey, NULL FROM already
"""


KEEP_STATEMENT = commit_statement(replace=False)
REPLACE_STATEMENT = commit_statement(replace=True)

_PER_BINDING = (
    "ids",
    "workflow_ids",
    "run_ids",
    "step_ids",
    "target_pubkeys",
    "definition_event_ids",
    "cause_kinds",
    "cause_event_ids",
    "cause_scheduled_fors",
    "cause_webhook_invocation_ids",
)


def check_one_binding_per_target(bindings: Sequence[Any]) -> None:
    """With a singleton key a commit holds one binding per target (the key is per target)."""
    first: dict[bytes, int] = {}
    for i, binding in enumerate(bindings):
        j = first.setdefault(binding.target_pubkey, i)
        if j != i:
            raise v.invalid(
                f"bindings[{i}].target_pubkey",
                f"repeats the target of bindings[{j}]: with a singleton_key a commit holds one binding per target",
            )


def commit(params: dict[str, Any], key: str, mode: OnConflict) -> SingletonCommit:
    """Run the commit of ``params`` (the producer's, one binding per target) with ``key`` in
    rounds until every binding has its outcome; the caller holds the transaction (all rounds
    commit or roll back together)."""
    statement = REPLACE_STATEMENT if mode == "replace" else KEEP_STATEMENT
    count = len(params["ids"])
    outcomes: dict[int, TargetOutcome] = {}
    superseded: dict[bytes, uuid.UUID] = {}
    # Target order, whatever the caller's: two replace commits of the same targets lock their
    # holders in one order (the supersede walks the arrays), so they never deadlock.
    todo = sorted(range(count), key=lambda i: bytes(params["target_pubkeys"][i]))
    for round_ in range(1, MAX_ROUNDS + 1):
        round_params = {**params, "singleton_key": key}
        for name in _PER_BINDING:
            round_params[name] = [params[name][i] for i in todo]
        found: dict[str, dict[bytes, uuid.UUID]] = {"created": {}, "superseded": {}, "held": {}, "already": {}}
        for what, delivery_id, target, _ in fetch_all(statement, round_params):
            found[what][bytes(target)] = delivery_id
        superseded.update(found["superseded"])
        left = []
        for i in todo:
            target = bytes(params["target_pubkeys"][i])
            if target in found["created"]:
                new_id = found["created"][target]
                old = superseded.get(target)
                outcomes[i] = Committed(new_id, target) if old is None else Replaced(new_id, target, old)
            elif target in found["already"]:
                outcomes[i] = AlreadyCommitted(found["already"][target], target)
            elif mode == "keep" and target in found["held"]:
                outcomes[i] = Kept(found["held"][target], target)
            else:  # a concurrent commit took the key after this statement's snapshot: again
                left.append(i)
        todo = left
        if not todo:
            return SingletonCommit(key, mode, tuple(outcomes[i] for i in range(count)), round_)
    raise SingletonContended(f"singleton key {key!r}: lost to concurrent commits {MAX_ROUNDS} times")
