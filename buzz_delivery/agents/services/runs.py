"""Start, claim, heartbeat, complete, fail and cancel agent runs (SPEC section 12).

Each holder transition is one fenced statement (community, run id, generation, holder,
leased state, ``lease_until >= now`` on the database clock, community active), judged by the
rows it returns; when nothing matched, :func:`~buzz_delivery.agents.services.common.missed`
tells the true holder's retry (``AlreadyTerminal``) from a lost lease.
"""

from __future__ import annotations

import hashlib
import uuid
from contextlib import nullcontext
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, transaction

from buzz_delivery import tracing
from buzz_delivery.agents.conf import NOTIFY_CHANNEL, get_settings
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import sql
from buzz_delivery.agents.services.common import in_flight_or_missed, json_value, lease_params, missed, sha256_json
from buzz_delivery.agents.services.policy import ask, bounded, policy_of, settings_layer
from buzz_delivery.agents.services.types import (
    Accepted,
    AgentClaim,
    AgentLease,
    AlreadyTerminal,
    CallsInFlight,
    Cancelled,
    Created,
    Duplicate,
    Finished,
    IdempotencyConflict,
    LeaseLost,
    NotFound,
    Renewed,
    RunEnded,
    Unwinding,
)
from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.models import HOLDER_MAX_CHARS, new_uuid7
from buzz_delivery.services import Lease, Settled, finish_delivery, flow
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import atomic_within_bound, fetch_all, retry_deadlocks, translated_errors
from buzz_delivery.services.runs import RUN_CANCELED
from buzz_delivery.services.tenancy import tenant_scoped
from buzz_delivery.tracing import work as tracing_work
from buzz_delivery.workflows.services.common import canonical_json
from buzz_delivery.workflows.states import RUN_TERMINAL as WORKFLOW_RUN_TERMINAL

MAX_CLAIM = 100
MAX_INPUT_BYTES = 1_000_000
RUN_ENDED = "run_ended"  # a delivery refused because its workflow run ended other than canceled


@retry_deadlocks
@tenant_scoped
@tracing_work.accept_span
def accept_delivery(
    lease: Lease,
    *,
    input: dict[str, Any] | None = None,
    shadow: bool = False,
    max_tool_calls: int | None = None,
    max_cost: int | None = None,
    max_attempts: int | None = None,
    timeout_seconds: int | None = None,
) -> Accepted | RunEnded | AlreadyTerminal | LeaseLost:
    """Settle the delivery held by ``lease`` (the core's :class:`~buzz_delivery.services.Lease`)
    ``finished`` through :func:`~buzz_delivery.services.finish_delivery` and create its agent
    run, ``pending``, in one transaction: never a settled delivery without its run, never a run
    for a delivery the caller no longer holds. The run's input is the message (``content``,
    ids) merged with ``input``. Budgets ``max_tool_calls`` (0..100000 entries), ``max_cost``
    (cost units, up to 2**53 - 1), ``max_attempts`` (1..100), ``timeout_seconds`` (1..30 days,
    absolute deadline from now, database clock) and ``shadow`` (destructive calls blocked) are
    what the caller asks for: the run gets them within the operator's policy for the delivery's
    agent (:mod:`~buzz_delivery.agents.services.policy`), never more (None: the policy's value);
    the policy's lease cap goes with the run.

    Returns :class:`Accepted` (the run id), :class:`RunEnded` (the delivery's workflow run was
    canceled or ended while the delivery was held: no run is created, and the delivery is
    settled ``failed`` with ``run_canceled`` / ``run_ended`` in the same transaction; the
    workflow run's row is locked first, as a cancel locks it, so no agent run starts after its
    workflow run's cancel), ``AlreadyTerminal(status)`` (the delivery was settled before: the
    true holder's retry) or ``LeaseLost``. Raises ``ValidationError`` keyed ``lease``,
    ``input`` or a budget name before SQL; inside a caller's transaction, a community that is
    no longer active raises ``CommunityNotWritable`` (as ``finish_delivery`` does). SPEC 12 "Start".
    """
    if not isinstance(lease, Lease):
        raise v.invalid("lease", f"must be a delivery Lease, not {type(lease).__name__}")
    extra = {} if input is None else input
    if not isinstance(extra, dict):
        raise v.invalid("input", f"must be a dict, not {type(extra).__name__}")
    asked = ask(
        shadow=shadow,
        max_tool_calls=max_tool_calls,
        max_cost=max_cost,
        max_attempts=max_attempts,
        timeout_seconds=timeout_seconds,
    )
    params = {
        "input": json_value(extra, "input", MAX_INPUT_BYTES),
        "id": new_uuid7(),
        "community_id": lease.community_id,
        "delivery_id": lease.delivery_id,
        # The accept span's context (else the delivery's stored one, in the statement).
        "trace_context": tracing.json_or_none(tracing.inject()),
    }
    # A worker serving several communities bounds its lock waits (lock_waits_bounded): this
    # transaction of its own honours that bound.
    with atomic_within_bound(), translated_errors():
        ended = fetch_all(sql.LOCK_WORKFLOW_RUN_OF_DELIVERY, params)
        if ended and ended[0][0] in WORKFLOW_RUN_TERMINAL:
            state = ended[0][0]
            refused = finish_delivery(
                lease,
                "failed",
                failure_code=RUN_CANCELED if state == "canceled" else RUN_ENDED,
                failure_message=f"the workflow run ended ({state}) before its agent run could start",
            )
            return RunEnded(state) if isinstance(refused, Settled) else refused
        outcome = finish_delivery(lease, "finished")
        if not isinstance(outcome, Settled):
            return outcome
        params.update(bounded(policy_of(lease.community_id, lease.target_pubkey), asked))
        fetch_all(sql.INSERT_RUN_FROM_DELIVERY, {**params, "input_hash": b"\0" * 32})
        run = AgentRun.objects.select_for_update().get(community_id=lease.community_id, delivery_id=lease.delivery_id)
        run.input_hash = sha256_json(run.input)
        AgentRun.objects.filter(community_id=run.community_id, id=run.id).update(input_hash=run.input_hash)
        notify_claimable(lease.community_id)
    return Accepted(run.id)


@tenant_scoped
def intake_event(
    community_id: uuid.UUID | str,
    channel_type: str,
    provider_event_id: str,
    payload: Any,
    agent_pubkey: bytes,
    *,
    shadow: bool = False,
    max_tool_calls: int | None = None,
    max_cost: int | None = None,
    max_attempts: int | None = None,
    timeout_seconds: int | None = None,
) -> Created | Duplicate | IdempotencyConflict:
    """Start a run for ``agent_pubkey`` (32 bytes) from an inbound channel event, once per
    (community, ``channel_type`` 1..64 chars, ``provider_event_id`` 1..200 chars). ``payload``
    (JSON) becomes the run input; its SHA-256 tells a retry from a conflict. Safe under
    concurrent calls: the key is inserted first (``ON CONFLICT DO NOTHING``, judged by the rows
    it returns) and only its winner reads the policy, creates the run and sends the wake hint
    (delivered on commit), all in one statement (one round trip; agents migration 0021).

    Returns :class:`Created`, :class:`Duplicate` (same key and payload) or
    :class:`IdempotencyConflict` (same key, another payload; nothing written). Raises
    ``ValidationError`` keyed by the argument before SQL; ``CommunityNotWritable`` when the
    community is not active. SPEC 12 "Start".
    """
    community, agent = v.uuid_value(community_id, "community_id"), v.bytes32(agent_pubkey, "agent_pubkey")
    params: dict[str, Any] = {
        "community_id": community,
        "channel_type": _key_text(channel_type, "channel_type", 64),
        "provider_event_id": _key_text(provider_event_id, "provider_event_id", 200),
        "agent_pubkey": agent,
        "input": json_value(payload, "payload", MAX_INPUT_BYTES),
    }
    asked = ask(
        shadow=shadow,
        max_tool_calls=max_tool_calls,
        max_cost=max_cost,
        max_attempts=max_attempts,
        timeout_seconds=timeout_seconds,
    )
    # The same payload is judged as start_run judges the same input (canonical_json: 1 == 1.0).
    payload_hash = hashlib.sha256(canonical_json(payload).encode()).digest()
    params.update(
        id=new_uuid7(),
        key_id=new_uuid7(),
        payload_hash=payload_hash,
        input_hash=sha256_json(payload),
        shadow=asked.shadow,
        max_tool_calls=asked.max_tool_calls,
        max_cost=asked.max_cost,
        max_attempts=asked.max_attempts,
        timeout_seconds=asked.timeout_seconds,
        **settings_layer(),
    )
    # One statement (agents migration 0021), atomic on its own: the key, and for its winner only
    # the policy's rows, the run (bounded by the policy in SQL) and the wake hint, on commit.
    # Inside a caller's transaction, under a savepoint as before: a refused intake (the write
    # fence) leaves the caller's transaction usable.
    # In autocommit the function sends the wake hint itself; inside a caller's transaction this
    # session sends it (on Citus the function runs on the community's node, and a NOTIFY there
    # cannot be PREPAREd when the caller's transaction also wrote on another node).
    inside = connections[DEFAULT_DB_ALIAS].in_atomic_block
    params["notify"] = not inside
    with transaction.atomic() if inside else nullcontext(), translated_errors():
        existing, stored_hash, created = fetch_all(sql.INTAKE_EVENT, params)[0]
        if created and inside:
            notify_claimable(community)
    if created:
        return Created(existing)
    if bytes(stored_hash) == params["payload_hash"]:
        return Duplicate(existing)
    return IdempotencyConflict(existing)


def notify_claimable(community_id: uuid.UUID) -> None:
    """Announce, in the caller's transaction, that ``community_id`` has a claimable run (a
    wake hint on ``buzz_agents`` for ``run_agent_worker``; delivered only on commit)."""
    fetch_all(sql.NOTIFY_CLAIMABLE, {"channel": NOTIFY_CHANNEL, "community_id": community_id})


def _key_text(value: Any, name: str, max_chars: int) -> str:
    text = v.optional_text(value, name, max_chars)
    if text is None or not text.strip():
        raise v.invalid(name, "must be a non-blank string")
    return text


def _worker(value: Any) -> str:
    text = v.optional_text(value, "worker_id", 200)
    if text is None or not text.strip():
        raise v.invalid("worker_id", "must name the worker (1..200 characters)")
    return text


_CLAIMED_FIELDS: list[tuple[str, list[Any], Any]] | None = None


def _claimed_fields() -> list[tuple[str, list[Any], Any]]:
    """(attname, converters, column expression) of each of :data:`sql.CLAIMED_RUN_COLUMNS`: the
    converters the ORM applies to that column when it reads a run (a JSON column's decoding)."""
    global _CLAIMED_FIELDS
    if _CLAIMED_FIELDS is None:
        db = connections[DEFAULT_DB_ALIAS]
        by_column = {f.column: f for f in AgentRun._meta.concrete_fields}
        out = []
        for column in sql.CLAIMED_RUN_COLUMNS:
            field = by_column[column]
            col = field.get_col(AgentRun._meta.db_table)
            out.append((field.attname, [*db.ops.get_db_converters(col), *col.get_db_converters(db)], col))
        _CLAIMED_FIELDS = out
    return _CLAIMED_FIELDS


def _claimed_run(values: tuple[Any, ...]) -> AgentRun:
    """The run a claim returned (its columns but the history, which stays deferred), built as
    the ORM builds a run it reads: the same values, the same converters."""
    db = connections[DEFAULT_DB_ALIAS]
    fields = _claimed_fields()
    converted = []
    for (_, converters, col), value in zip(fields, values, strict=True):
        for converter in converters:
            value = converter(value, col, db)
        converted.append(value)
    return AgentRun.from_db(DEFAULT_DB_ALIAS, [f[0] for f in fields], converted)


@tenant_scoped
@tracing.traced("buzz.agent.claim")
def claim_agent_runs(
    community_id: uuid.UUID | str,
    agent_pubkeys: list[bytes],
    *,
    worker_id: str,
    limit: int = 1,
    lease_seconds: float | None = None,
) -> list[AgentClaim]:
    """Claim up to ``limit`` (1..100) pending runs of one community addressed to one of
    ``agent_pubkeys`` (32 bytes each), oldest first, past their backoff gate, with
    ``FOR UPDATE SKIP LOCKED``. Each winner: ``running``, generation + 1, lease
    ``lease_seconds`` (default ``BUZZ_AGENTS['LEASE_SECONDS']``, within the core's lease bounds)
    from the database clock, ``heartbeat_at`` now, ``worker_id`` recorded. A community that is
    not active has nothing claimable. Under the operator's ``AGENT_CONCURRENCY_LIMITS``
    (docs/flow-control.md) a claim takes at most as many as leave every declared key (an agent of
    the community, the community) within its maximum of leased runs; the rest stay pending.
    Raises ``ValidationError`` keyed by the argument before SQL, and ``ImproperlyConfigured``
    naming the field for a bad ``AGENT_CONCURRENCY_LIMITS`` (nothing written). SPEC 12 "States"."""
    if not isinstance(agent_pubkeys, (list, tuple)) or not agent_pubkeys:
        raise v.invalid("agent_pubkeys", "must be a non-empty list of 32-byte keys")
    community = v.uuid_value(community_id, "community_id")
    worker = _worker(worker_id)
    params = {
        "community_id": community,
        "agents": [v.bytes32(k, f"agent_pubkeys[{i}]") for i, k in enumerate(agent_pubkeys)],
        "worker_id": worker,
        "limit": v.int_in_range(limit, "limit", 1, MAX_CLAIM),
        "lease_seconds": v.lease_seconds(get_settings().lease_seconds if lease_seconds is None else lease_seconds),
    }
    limits = flow.declared_agent_limits()
    with translated_errors():
        if limits:  # the community's claim lock, then the claim: one transaction (flow's)
            caps = flow.all_caps(limits, flow.AGENT_KINDS)
            rows = flow.claim_holding_slots(
                sql.CLAIM_PENDING_RUNS_UNDER_LIMITS, {**params, **caps}, flow.AGENT_CLAIM_LOCK_NAMESPACE, "ag_run_slot_"
            )
        else:  # one statement, atomic by itself: no BEGIN and COMMIT round trips around it
            rows = fetch_all(sql.CLAIM_PENDING_RUNS, params)
    claims = [AgentClaim(AgentLease(community, row[0], row[1], row[2], worker), _claimed_run(row[3:])) for row in rows]
    return sorted(claims, key=lambda c: (-c.run.priority, c.run.created_at, c.run.id))  # the claim's order


@tenant_scoped
def heartbeat(lease: AgentLease, lease_seconds: float | None = None) -> Renewed | AlreadyTerminal | LeaseLost:
    """Renew the holder's lease by ``lease_seconds`` from now (database clock) and record
    ``heartbeat_at``; never bumps the generation. Returns :class:`Renewed`, ``AlreadyTerminal``
    or ``LeaseLost`` (``reason="cancelled"`` when a cancel fenced this holder). SPEC 12."""
    params = lease_params(
        lease,
        lease_seconds=v.lease_seconds(get_settings().lease_seconds if lease_seconds is None else lease_seconds),
    )
    with translated_errors():
        rows = fetch_all(sql.HEARTBEAT_IF_CURRENT, params)
        if rows:
            return Renewed(
                AgentLease(lease.community_id, lease.run_id, lease.lease_generation, rows[0][0], lease.worker_id)
            )
        return missed(params)


@retry_deadlocks
@tenant_scoped
def complete_run(lease: AgentLease, output: Any) -> Finished | CallsInFlight | AlreadyTerminal | LeaseLost:
    """End the run ``completed`` with ``output`` (JSON, at most ``MAX_OUTPUT_BYTES``; its
    SHA-256 recorded), releasing the lease. Refused (``LeaseLost``) while the run is unwinding.
    In the same transaction a workflow step awaiting this run counts it (migration 0002).

    A finished run keeps no pending call: while a tool call the holder journaled under its lease
    generation is still ``pending``, nothing is written and the answer is :class:`CallsInFlight`
    naming them (the lease holds: record them, then complete again). Pending calls of an earlier
    generation (a crashed holder's, which its handler did not replay) do not refuse it.

    Returns :class:`Finished`, :class:`CallsInFlight`, ``AlreadyTerminal`` (the true holder's
    retry) or ``LeaseLost``. Raises ``ValidationError`` keyed ``lease`` or ``output`` before SQL.
    SPEC 12."""
    params = lease_params(
        lease, output=json_value(output, "output", get_settings().max_output_bytes), output_hash=sha256_json(output)
    )
    with atomic_within_bound(), translated_errors():
        # No lock of the run's row first: a call its holder journals meanwhile on another thread
        # sets the run 'waiting_tool' in the same transaction as its entry, and a completion that
        # waited for that row re-checks its state = 'running' on the new version (a statement
        # saved on every completion); entries committed before it are in its NOT EXISTS's snapshot.
        rows = fetch_all(sql.COMPLETE_IF_CURRENT, params)
        if rows:
            return Finished("completed")
        return in_flight_or_missed(params)


@retry_deadlocks
@tenant_scoped
def fail_run(
    lease: AgentLease, failure_code: str, failure_message: str | None = None
) -> Finished | Unwinding | AlreadyTerminal | LeaseLost:
    """Fail the run. With succeeded (or uncertain) calls that carry a compensation not yet
    undone, and none whose compensation failed, the run is marked ``unwinding`` (lease kept) and
    :class:`Unwinding` lists the entries to compensate, highest ``seq`` first; call again once
    they are done (or one failed). A call still ``pending`` (the handler gave up mid-call, or
    its holder was fenced mid-call by a cancel, a timeout or a lapse) is first recorded
    ``failed`` and uncertain, so it is compensated like a succeeded one, before the calls under
    it. Otherwise the run ends (the first
    failure code recorded wins) and :class:`Finished` says how: ``failed``, or ``cancelled`` /
    ``timeout`` for a run that unwound because a cancel (``cancel_agent_run``, or the cancel of
    its workflow run: ``workflow_canceled``) or its ``timeout_at`` sent it to compensate.
    ``failure_code``: 1..64 characters. Raises ``ValidationError`` keyed ``lease``,
    ``failure_code`` or ``failure_message``. SPEC 12."""
    code = v.optional_text(failure_code, "failure_code", 64)
    if not code or not code.strip():
        raise v.invalid("failure_code", "must be 1..64 characters")
    params = lease_params(
        lease, failure_code=code, failure_message=v.optional_text(failure_message, "failure_message", 10_000)
    )
    with atomic_within_bound(), translated_errors():
        # The run's row first, in a statement of its own: a call its holder is journaling on
        # another thread holds it until the call's entry commits, and the statements below then
        # read a snapshot that holds that entry (one that waited inside them would judge "nothing
        # to undo" on the snapshot it took before waiting, and end the run with the call pending).
        fetch_all(sql.LOCK_RUN, params)
        fetch_all(sql.MARK_PENDING_UNCERTAIN, params)
        ended = fetch_all(sql.FAIL_IF_CURRENT_AND_NOTHING_TO_UNDO, params)
        if ended:
            return Finished(ended[0][0])
        if fetch_all(sql.MARK_UNWINDING_IF_CURRENT, params):
            return Unwinding(tuple(row[0] for row in fetch_all(sql.OUTSTANDING_SEQS, params)))
        return missed(params)


@retry_deadlocks
@tenant_scoped
def cancel_agent_run(
    community_id: uuid.UUID | str,
    run_id: uuid.UUID | str,
    *,
    reason: str | None = None,
    actor: str | None = None,
) -> Cancelled | AlreadyTerminal | NotFound:
    """Cancel a run in one transaction: its pending approval expired, the holder fenced
    (generation + 1: it learns it at its next heartbeat, journal or complete, all refused as
    ``LeaseLost("cancelled")``). Without compensations outstanding the run ends ``cancelled``
    at once; with some (succeeded or uncertain calls that carry one, none failed) it goes back to
    ``pending`` unwinding with ``failure_code = "cancelled"``: a worker claims it, runs the
    compensations in reverse order, each once, and ``fail_run`` ends it ``cancelled``. Cancelling
    a run that already unwinds for a cancel changes nothing and answers ``Cancelled``.
    ``actor``: who cancels (at most 200 characters, e.g. ``operator:alice``), the actor of the
    history entry; None = ``"operator"``. Returns :class:`Cancelled`, ``AlreadyTerminal(state)``
    or :class:`NotFound`. Raises ``ValidationError`` keyed by the argument before SQL;
    ``CommunityNotWritable`` when the community is not active. SPEC 12 "States"."""
    run = v.uuid_value(run_id, "run_id")
    community = v.uuid_value(community_id, "community_id")
    params = {
        "community_id": community,
        "run_id": run,
        "reason": v.optional_text(reason, "reason", 10_000),
        "actor": v.optional_text(actor, "actor", HOLDER_MAX_CHARS) or "operator",
    }
    for attempt in range(_CANCEL_ATTEMPTS):
        try:
            return _cancel(params, last=attempt == _CANCEL_ATTEMPTS - 1)
        except _ApprovalRequestedMeanwhile:
            continue  # rolled back: the next expiry sees the approval
    raise AssertionError("unreachable")


# How many times a cancel starts over because the run's holder requested an approval while the
# cancel was expiring (a holder requests one per claim, and the cancel fences it: twice is enough).
_CANCEL_ATTEMPTS = 3


class _ApprovalRequestedMeanwhile(Exception):
    """The run's approval was requested after the cancel's expiry read the run: start over."""


def _cancel(params: dict[str, Any], *, last: bool) -> Cancelled | AlreadyTerminal | NotFound:
    community, run = params["community_id"], params["run_id"]
    with transaction.atomic(), translated_errors():
        # Approval first, then the run: the order of decide_approval and the reaper (its trigger
        # moves the run), so a cancel racing them cannot deadlock.
        fetch_all(sql.EXPIRE_APPROVAL_OF_RUN, params)
        fetch_all(sql.LOCK_RUN, params)
        # A request_approval that held the run while the expiry read it (the run was running in
        # that snapshot) committed before the lock was ours: its approval is pending still.
        # Expiring it now would take approval after run, a deadlock with a decide; roll back
        # instead and start over: the next expiry sees it (the run waits for it, its lease released).
        if not last and fetch_all(sql.PENDING_APPROVAL_OF_RUN, params):
            raise _ApprovalRequestedMeanwhile
        if fetch_all(sql.CANCEL_IF_NOT_TERMINAL, params):
            fetch_all(sql.CLOSE_PENDING_CALLS_OF_ENDED_RUNS, {**params, "ended": [run]})
            return Cancelled(run)
        if fetch_all(sql.CANCEL_TO_UNWIND_IF_OUTSTANDING, params):
            notify_claimable(community)
            return Cancelled(run)
        if fetch_all(sql.RUN_UNWINDING_FOR_CANCEL, params):
            return Cancelled(run)
        rows = fetch_all(sql.RUN_AT, {**params})
    if not rows:
        return NotFound()
    state, *_, active = rows[0]
    if not active:
        raise CommunityNotWritable(f"community {params['community_id']} is not active; its runs cannot be cancelled")
    return AlreadyTerminal(state)


@tenant_scoped
def get_agent_run(community_id: uuid.UUID | str, run_id: uuid.UUID | str) -> AgentRun | None:
    """Scoped read of one run (None if absent)."""
    return AgentRun.objects.filter(
        community_id=v.uuid_value(community_id, "community_id"), id=v.uuid_value(run_id, "run_id")
    ).first()


@tenant_scoped
def get_journal(community_id: uuid.UUID | str, run_id: uuid.UUID | str) -> list[JournalEntry]:
    """Scoped read of one run's journal entries in ``seq`` order (empty if the run is absent)."""
    return list(
        JournalEntry.objects.filter(
            community_id=v.uuid_value(community_id, "community_id"), run_id=v.uuid_value(run_id, "run_id")
        ).order_by("seq")
    )


@tenant_scoped
def get_run_agent(community_id: uuid.UUID | str, run_id: uuid.UUID | str) -> bytes | None:
    """Scoped read of one run's agent key (None if absent): the narrow read a scope check needs
    (a run's ``agent_pubkey`` never changes)."""
    row = (
        AgentRun.objects.filter(
            community_id=v.uuid_value(community_id, "community_id"), id=v.uuid_value(run_id, "run_id")
        )
        .values_list("agent_pubkey", flat=True)
        .first()
    )
    return None if row is None else bytes(row)


@tenant_scoped
def runs_of_agent(community_id: uuid.UUID | str, run_ids: list[uuid.UUID], agent_pubkey: bytes) -> set[uuid.UUID]:
    """Which of ``run_ids`` (one community) are runs of ``agent_pubkey``: the scope check of a
    batch, one read (a run's ``agent_pubkey`` never changes)."""
    if not run_ids:
        return set()
    return set(
        AgentRun.objects.filter(
            community_id=v.uuid_value(community_id, "community_id"), id__in=list(run_ids), agent_pubkey=agent_pubkey
        ).values_list("id", flat=True)
    )
