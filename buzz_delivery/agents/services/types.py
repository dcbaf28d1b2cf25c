"""Typed outcomes of the agent-run services (SPEC section 12). Expected races are outcomes;
the core's :class:`~buzz_delivery.services.AlreadyTerminal` and
:class:`~buzz_delivery.services.LeaseLost` are reused with their meaning (the true holder's
retry; a stale or cancelled holder, ``reason`` saying ``cancelled`` when a cancel fenced it)."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass, field
from typing import Any

from buzz_delivery.services.types import AlreadyTerminal, LeaseLost


@dataclass(frozen=True, slots=True)
class AgentLease:
    """The capability a run holder presents: community, run id, ``lease_generation`` (bumped by
    every claim, reclaim and cancel), ``lease_until`` (database clock), ``worker_id``."""

    community_id: uuid.UUID
    run_id: uuid.UUID
    lease_generation: int
    lease_until: dt.datetime
    worker_id: str


@dataclass(frozen=True, slots=True)
class AgentClaim:
    """A claimed run: its lease and the row as claimed (``unwinding`` runs only compensate)."""

    lease: AgentLease
    run: Any = field(compare=False)


@dataclass(frozen=True, slots=True)
class Accepted:
    """``accept_delivery``: the delivery settled ``finished`` and its run ``run_id`` exists."""

    run_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class RunEnded:
    """``accept_delivery``: the delivery's workflow run has ended (``state``: ``canceled``,
    ``failed`` or ``succeeded``) while the delivery was held: no agent run was created and the
    delivery was settled ``failed`` (``run_canceled``, or ``run_ended`` for another end)."""

    state: str


@dataclass(frozen=True, slots=True)
class Created:
    """``intake_event``: a new run ``run_id`` was created for this key."""

    run_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class Duplicate:
    """``intake_event``: the same key and payload started run ``run_id`` before."""

    run_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class IdempotencyConflict:
    """``intake_event``: the key started run ``run_id`` with another payload; nothing written."""

    run_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class Renewed:
    """``heartbeat``: the lease now ends at ``lease.lease_until``."""

    lease: AgentLease


@dataclass(frozen=True, slots=True)
class Journaled:
    """``journal_call``: entry ``seq`` written ``pending`` before the call; hand
    ``idempotency_key`` to the tool."""

    seq: int
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class Blocked:
    """``journal_call`` in shadow mode: a destructive call journaled ``failed`` and not to be
    made; ``reason`` is recorded on the entry."""

    seq: int
    reason: str


@dataclass(frozen=True, slots=True)
class BudgetExceeded:
    """A call past a cap (``budget``: ``tool_calls`` or ``cost``): refused, nothing journaled."""

    budget: str
    used: int
    cap: int


@dataclass(frozen=True, slots=True)
class Emitted:
    """``emit_output``: the chunk is the run's output chunk ``seq`` (gapless from 1)."""

    seq: int


@dataclass(frozen=True, slots=True)
class TooLarge:
    """``emit_output``: the chunk would take the run's output (``field``: ``output``) past its
    bound of ``cap`` bytes (``used`` so far, ``size`` of the chunk): refused, nothing written."""

    field: str
    used: int
    size: int
    cap: int


@dataclass(frozen=True, slots=True)
class OutputChunk:
    """One chunk of a run's streamed output."""

    seq: int
    chunk: str


@dataclass(frozen=True, slots=True)
class OutputPage:
    """``read_output``: chunks after a seq, in order, and whether the run was terminal before
    they were read (``terminal``; then a page shorter than asked is the end of the stream) or
    absent (``found`` False, no chunks)."""

    chunks: tuple[OutputChunk, ...]
    terminal: bool
    found: bool = True


@dataclass(frozen=True, slots=True)
class Recorded:
    """``record_call_result`` / compensation steps: the entry now holds ``status``."""

    status: str


@dataclass(frozen=True, slots=True)
class AlreadyRecorded:
    """The entry was answered before with ``status`` (a retry; the answer never changes)."""

    status: str


@dataclass(frozen=True, slots=True)
class Unwinding:
    """``fail_run`` with compensations outstanding: the run is marked ``unwinding`` and the
    holder must compensate ``seqs`` (highest first), then call ``fail_run`` again."""

    seqs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Finished:
    """A run ended ``state`` by this call: ``completed``, ``failed``, or ``cancelled`` / ``timeout``
    when it unwound for a cancel or a timeout."""

    state: str


@dataclass(frozen=True, slots=True)
class Cancelled:
    """``cancel_agent_run``: the run is ``cancelled`` (generation + 1)."""

    run_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class NotFound:
    """No such run in this community."""


@dataclass(frozen=True, slots=True)
class ApprovalRequested:
    """``request_approval``: the run waits on engine approval ``approval_id`` (journal ``seq``),
    holding no lease."""

    approval_id: uuid.UUID
    seq: int


@dataclass(frozen=True, slots=True)
class CallsInFlight:
    """``request_approval``, ``complete_run`` or ``complete_runs`` refused while the holder's own
    tool calls ``seqs`` (journaled under its lease generation, not yet recorded) are in flight:
    nothing written, the lease still holds. Record them, then ask again (the runtimes wait for
    them first). Pending calls of an earlier generation (a crashed holder's) never refuse. A
    completion answered with no ``seqs`` met a call journaled and recorded while it ran: complete
    again."""

    seqs: tuple[int, ...]


__all__ = [
    "Accepted",
    "AgentClaim",
    "AgentLease",
    "AlreadyRecorded",
    "AlreadyTerminal",
    "ApprovalRequested",
    "Blocked",
    "BudgetExceeded",
    "CallsInFlight",
    "Cancelled",
    "Created",
    "Duplicate",
    "Emitted",
    "Finished",
    "IdempotencyConflict",
    "Journaled",
    "LeaseLost",
    "NotFound",
    "OutputChunk",
    "OutputPage",
    "Recorded",
    "Renewed",
    "RunEnded",
    "TooLarge",
    "Unwinding",
]
