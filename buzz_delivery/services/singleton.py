"""Debounce / singleton deliveries (issue 32, docs/flow-control.md): a producer may say "one
pending delivery per key" for each target of a commit, ``commit_deliveries(...,
singleton_key="digest", on_conflict="keep" | "replace")``.

**The invariant is in PostgreSQL.** The live queue's partial UNIQUE index
``delivery_queue_singleton_key`` on ``(community_id, target_pubkey, singleton_key) WHERE
singleton_key IS NOT NULL`` lets one community's target hold at most one *unclaimed* pending
delivery per key (issue 31, stage 2). Only the commit sets the queue row's key (the record keeps
the immutable key); the claim sets it NULL, and a requeue inserts its queue row without one, so
no retry, reap or requeue that brings a delivery back to ``pending`` can ever be refused by it.
The key is therefore a debounce key: a delivery that was claimed once (in flight, or pending
again after a retry, a lapsed lease or a requeue) no longer holds it, and a new commit with the
key makes a new pending delivery beside it.

**A round of statements per commit** (:func:`commit`, Citus's router form: each names the
community and writes one table): with ``on_conflict="replace"`` first the *supersede*: the
holders of the targets that get a new delivery leave the queue and their records end
``expired`` with ``failure_code = 'superseded'``, a failure message naming the delivery that
replaced them and a ``supersede`` history entry (the binding, payload and history stay as they
were committed: the audit shows what was replaced, by what, and when). The supersede locks its
holders in delivery id order, the order of every batch writer of the queue, so it cannot hold a
worker's row while waiting for another one the worker holds. Then the holders and the
identities already committed (a producer's retry) are read, the records of the other targets
inserted, and their queue rows: the queue insert's ``ON CONFLICT DO NOTHING`` is the arbiter.
A replace round runs under a savepoint: when a target whose holder it superseded gets no new
delivery (a plain commit of the same identity, which takes no key lock, committed first), the
round is rolled back whole and run again, and the next one sees that identity and supersedes
nothing (no holder ends "superseded by" a delivery that does not exist).

Before its first round a commit locks the key of each of its targets (:data:`LOCK_KEYS`, one
advisory lock per community, target and key, in one order), so concurrent commits of the key
queue per target instead of deadlocking on the keys they write twice (supersede, insert). A
record whose queue row still met a key taken by a concurrent commit that this round's reads could
not see is deleted again and its target run in another round, in the same transaction, with
fresh snapshots (READ COMMITTED): a "keep" then reports that delivery, a "replace" supersedes it.
Each round is decided by the unique index, so N concurrent commits of one key leave exactly one
pending delivery.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from django.db import transaction

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

# A replace commit's first statement: the holders (the queue rows that carry the key: pending and
# never claimed, since the claim clears it) of the targets that get a new delivery in this
# commit, unless that delivery's identity was committed before (a producer's retry supersedes
# nothing), leave the queue; their state comes back for their record (:data:`EXPIRE_SUPERSEDED`).
# Its holders are locked first, in delivery id order (a MATERIALIZED CTE, ``ORDER BY`` under
# ``FOR UPDATE``), the order in which every batch writer of the queue takes its rows
# (``batch._fence_params``). Taken in target order, it could deadlock with a worker: READ
# COMMITTED re-checks a row changed since the statement began under the row's lock and keeps that
# lock when the row no longer qualifies, so a holder claimed meanwhile stayed locked by the
# supersede while it waited for the next one, which a worker renewing or settling both leases in
# another order held. In one order, whoever holds the first waits for no one the other holds. It
# waits rather than skipping a locked holder: a run's cancel expires its deliveries skipping
# locked rows, and two skippers holding rows the other needs could each give up on them.
SUPERSEDE = f"""
WITH holders AS MATERIALIZED (
    SELECT q.id, s.id AS by
    FROM {sql.QUEUE} AS q
    JOIN unnest(%(ids)s::uuid[], %(run_ids)s::uuid[], %(step_ids)s::text[], %(target_pubkeys)s::bytea[])
        AS s(id, run_id, step_id, target_pubkey) ON q.target_pubkey = s.target_pubkey
    WHERE q.community_id = %(community_id)s
      AND q.singleton_key = %(singleton_key)s AND q.status = 'pending'
      AND {sql.ACTIVE_COMMUNITY.replace("d.community_id", "q.community_id")}
      AND NOT EXISTS (
          SELECT 1 FROM {sql.RECORD} AS e
          WHERE e.community_id = %(community_id)s AND e.run_id = s.run_id AND e.step_id = s.step_id
            AND e.target_pubkey = s.target_pubkey
      )
    ORDER BY q.id
    FOR UPDATE OF q
)
-- Through the primary key only: the CTE locked each holder as it still qualified.
DELETE FROM {sql.QUEUE} AS q
USING holders AS h
WHERE q.community_id = %(community_id)s AND q.id = h.id
RETURNING q.id, q.target_pubkey, h.by, q.lease_generation, q.attempt, q.claimed_by, q.renewals, q.history::text
"""

_SUPERSEDE_ENTRY = sql.history_entry(
    "'supersede'", "g.lease_generation + 1", "'producer'", status="'expired'", superseded_by="g.by::text", alias="g"
)

# Its second: each superseded delivery's record ends ``expired`` / ``superseded``, with a failure
# message naming the delivery that replaced it and a ``supersede`` entry after the queue row's
# history; its generation, attempt, holder and renewals are the queue row's. The binding,
# payload and history stay as they were committed (the binding is immutable,
# ``delivery_binding_immutable``), so the audit shows what was replaced, by what, and when.
EXPIRE_SUPERSEDED = f"""
UPDATE {sql.RECORD} AS d
SET status = 'expired',
    finished_at = {sql.DB_NOW},
    failure_code = '{SUPERSEDED}',
    failure_message = 'superseded by delivery ' || g.by::text || ' (singleton key ' || %(singleton_key)s || ')',
    lease_generation = g.lease_generation + 1,
    attempt = g.attempt,
    claimed_by = g.claimed_by,
    renewals = g.renewals,
    lease_until = NULL,
    claimed_at = NULL,
    next_attempt_at = NULL,
    slot_community = NULL,
    slot_target = NULL,
    slot_workflow = NULL,
    {_SUPERSEDE_ENTRY}
FROM unnest(
    %(superseded_ids)s::uuid[], %(superseded_bys)s::uuid[], %(lease_generations)s::bigint[],
    %(attempts)s::integer[], %(claimed_bys)s::text[], %(renewals)s::integer[], %(histories)s::jsonb[]
) AS g(id, by, lease_generation, attempt, claimed_by, renewals, history)
WHERE d.community_id = %(community_id)s AND d.id = g.id AND d.status = 'pending'
RETURNING d.id
"""

# What the round meets: the key's holder per target (in the queue, the index's rows) and the
# deliveries that already carry the binding's identity (a producer's retry, in the record).
HELD_OR_ALREADY = f"""
SELECT 'held', q.id, q.target_pubkey FROM {sql.QUEUE} AS q
WHERE q.community_id = %(community_id)s AND q.singleton_key = %(singleton_key)s
  AND q.target_pubkey = ANY (%(target_pubkeys)s::bytea[])
UNION ALL
SELECT 'already', d.id, d.target_pubkey FROM {sql.RECORD} AS d
WHERE d.community_id = %(community_id)s
  AND (d.run_id, d.step_id, d.target_pubkey) IN (
      SELECT i.run_id, i.step_id, i.target_pubkey
      FROM unnest(%(run_ids)s::uuid[], %(step_ids)s::text[], %(target_pubkeys)s::bytea[])
          AS i(run_id, step_id, target_pubkey)
  )
"""

# The records of the targets the round commits (none held, none already), with the key; their
# queue rows follow (``sql.INSERT_QUEUE_ROWS_OF_CREATED``, whose ``ON CONFLICT`` is the key's
# arbiter). A wake hint per record created (sent at commit; a record whose queue row lost the key
# to a concurrent commit is deleted again, and its hint finds nothing to claim).
INSERT_RECORDS = f"""
WITH created AS (
    INSERT INTO {sql.RECORD} AS d (
        id, community_id, workflow_id, run_id, step_id, target_pubkey, definition_event_id,
        message_event_id, cause_kind, cause_event_id, cause_scheduled_for, cause_webhook_invocation_id,
        max_attempts, expires_at, execution_trace, trigger_context, next_attempt_at, priority, singleton_key
    )
    SELECT v.id, %(community_id)s, v.workflow_id, v.run_id, v.step_id, v.target_pubkey, v.definition_event_id,
           %(message_event_id)s, v.cause_kind, v.cause_event_id, v.cause_scheduled_for, v.cause_webhook_invocation_id,
           %(max_attempts)s, %(expires_at)s, %(execution_trace)s::jsonb, %(trigger_context)s::jsonb,
           %(not_before)s::timestamptz, %(priority)s::smallint, %(singleton_key)s
    FROM {_UNNEST}
    -- Identity order, as the plain commit: concurrent producers never deadlock on the keys.
    ORDER BY v.run_id, v.step_id, v.target_pubkey
    ON CONFLICT ON CONSTRAINT delivery_identity_key DO NOTHING
    RETURNING d.id, d.target_pubkey
)
{sql._NOTIFY_CREATED}"""

# A record this round created whose queue row the key's index turned away (a concurrent commit's
# holder, committed after this round read the holders): it goes again, and the target is decided
# in the next round.
DELETE_UNQUEUED = f"""
DELETE FROM {sql.RECORD} AS d
WHERE d.community_id = %(community_id)s AND d.id = ANY (%(ids)s::uuid[]) AND d.status = 'pending'
RETURNING d.id
"""

# A commit's first statement: the key of each of its targets, one transaction-scoped advisory lock
# per (community, target, key), taken in one statement in key order. A round writes a target's key
# twice (the supersede deletes its holder, the insert adds the new one), and a commit's targets
# span several statements and rounds, so without these two replacers (or a replacer and a keeper)
# of the same targets could each hold a key the other one waits for ("deadlock detected", an
# error, not an outcome). With them concurrent commits of one key queue per target in one order;
# each runs its rounds alone on its targets and sees the commits before it (READ COMMITTED).
# Names no table (the coordinator's lock on Citus, as the identity locks of services/fanout.py).
LOCK_KEYS = """
SELECT count(pg_advisory_xact_lock(%(namespace)s, hashtext(k.key))) FROM unnest(%(keys)s::text[]) AS k(key)
"""
SINGLETON_LOCK_NAMESPACE = 0x42440003

# Every statement of a commit with a key, for the router-form checks (tests/test_citus.py).
KEEP_STATEMENTS = (HELD_OR_ALREADY, INSERT_RECORDS, sql.INSERT_QUEUE_ROWS_OF_CREATED, DELETE_UNQUEUED)
REPLACE_STATEMENTS = (SUPERSEDE, EXPIRE_SUPERSEDED, *KEEP_STATEMENTS)

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
    commit or roll back together). A round: (replace) supersede the holders, read the holders
    and the identities already committed, insert the records of the targets left, then their
    queue rows; a record whose queue row the key's index turned away is deleted and its target
    tried again. A replace round that superseded the holder of a target it then did not create
    is rolled back to its savepoint and run again."""
    from buzz_delivery.services.producer import queue_created  # (the producer imports this module)

    community = params["community_id"]
    count = len(params["ids"])
    outcomes: dict[int, TargetOutcome] = {}
    superseded: dict[bytes, uuid.UUID] = {}
    # Target order, whatever the caller's; the keys of all the targets locked first, in one order
    # (LOCK_KEYS): concurrent commits of the key over the same targets never deadlock.
    todo = sorted(range(count), key=lambda i: bytes(params["target_pubkeys"][i]))
    keys = sorted(f"{community}/{bytes(params['target_pubkeys'][i]).hex()}/{key}" for i in todo)
    fetch_all(LOCK_KEYS, {"namespace": SINGLETON_LOCK_NAMESPACE, "keys": keys})
    for round_ in range(1, MAX_ROUNDS + 1):
        round_params = {**params, "singleton_key": key}
        for name in _PER_BINDING:
            round_params[name] = [params[name][i] for i in todo]
        # A replace's round is undone whole when a target it superseded gets no new delivery (a
        # plain commit of the same identity, which takes no key lock, won it): else the holder
        # would end "superseded by delivery N" with no N, its work lost with nothing in its place.
        undo = transaction.savepoint() if mode == "replace" else None
        superseded_now: dict[bytes, uuid.UUID] = {}
        if mode == "replace":
            _supersede(round_params, superseded_now)
        found: dict[str, dict[bytes, uuid.UUID]] = {"held": {}, "already": {}}
        for what, delivery_id, target in fetch_all(HELD_OR_ALREADY, round_params):
            found[what][bytes(target)] = delivery_id
        create = [
            i
            for i in todo
            if bytes(params["target_pubkeys"][i]) not in found["already"]
            and bytes(params["target_pubkeys"][i]) not in found["held"]
        ]
        created: dict[bytes, uuid.UUID] = {}
        if create:
            insert_params = {**round_params}
            for name in _PER_BINDING:
                insert_params[name] = [params[name][i] for i in create]
            rows = fetch_all(INSERT_RECORDS, insert_params)
            target_of = {params["ids"][i]: bytes(params["target_pubkeys"][i]) for i in create}
            targets = {row[0]: target_of[row[0]] for row in rows}
            queued = queue_created(community, list(targets))
            lost = [i for i in targets if i not in queued]
            if lost:
                fetch_all(DELETE_UNQUEUED, {"community_id": community, "ids": lost})
            created = {targets[i]: i for i in queued}
        if undo is not None and any(target not in created for target in superseded_now):
            transaction.savepoint_rollback(undo)  # the next round sees the identity: supersedes nothing
            continue
        superseded.update(superseded_now)
        left = []
        for i in todo:
            target = bytes(params["target_pubkeys"][i])
            if target in created:
                new_id = created[target]
                old = superseded.get(target)
                outcomes[i] = Committed(new_id, target) if old is None else Replaced(new_id, target, old)
            elif target in found["already"]:
                outcomes[i] = AlreadyCommitted(found["already"][target], target)
            elif mode == "keep" and target in found["held"]:
                outcomes[i] = Kept(found["held"][target], target)
            else:  # a concurrent commit took the key (or the identity) after this round's reads: again
                left.append(i)
        todo = left
        if not todo:
            return SingletonCommit(key, mode, tuple(outcomes[i] for i in range(count)), round_)
    raise SingletonContended(f"singleton key {key!r}: lost to concurrent commits {MAX_ROUNDS} times")


def _supersede(params: dict[str, Any], superseded: dict[bytes, uuid.UUID]) -> None:
    """The replace round's supersede: the holders leave the queue (:data:`SUPERSEDE`), then their
    records end expired / superseded (:data:`EXPIRE_SUPERSEDED`); ``superseded`` learns them."""
    rows = fetch_all(SUPERSEDE, params)
    if not rows:
        return
    fetch_all(
        EXPIRE_SUPERSEDED,
        {
            "community_id": params["community_id"],
            "singleton_key": params["singleton_key"],
            "superseded_ids": [r[0] for r in rows],
            "superseded_bys": [r[2] for r in rows],
            "lease_generations": [r[3] for r in rows],
            "attempts": [r[4] for r in rows],
            "claimed_bys": [r[5] for r in rows],
            "renewals": [r[6] for r in rows],
            "histories": [r[7] for r in rows],
        },
    )
    superseded.update({bytes(r[1]): r[0] for r in rows})
