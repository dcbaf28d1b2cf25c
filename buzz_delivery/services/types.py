"""Value types of the public API (SPEC section 9): causes, bindings, leases, outcomes.

All are frozen dataclasses. Constructors validate and normalise their input and
raise :class:`django.core.exceptions.ValidationError` keyed by the field name,
before any SQL runs.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from buzz_delivery.services import validation as v

if TYPE_CHECKING:
    from buzz_delivery.models import WorkflowAgentDelivery

CauseKindName = Literal["event", "schedule", "webhook"]
Outcome = Literal["finished", "failed", "retry"]


@dataclass(frozen=True, slots=True)
class Cause:
    """What triggered the workflow run: exactly one of an event id (32 bytes), a schedule
    instant (aware datetime, whole seconds) or a webhook invocation UUID (SPEC section 2).

    Build one with :meth:`event`, :meth:`schedule` or :meth:`webhook`.
    """

    kind: CauseKindName
    event_id: bytes | None = None
    scheduled_for: dt.datetime | None = None
    webhook_invocation_id: uuid.UUID | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("event", "schedule", "webhook"):
            raise v.invalid("cause", f"kind must be 'event', 'schedule' or 'webhook', not {self.kind!r}")
        given = {
            "event": self.event_id is not None,
            "schedule": self.scheduled_for is not None,
            "webhook": self.webhook_invocation_id is not None,
        }
        if [k for k, present in given.items() if present] != [self.kind]:
            raise v.invalid("cause", f"a {self.kind!r} cause carries exactly its own identity value")
        if self.event_id is not None:
            object.__setattr__(self, "event_id", v.bytes32(self.event_id, "cause.event_id"))
        if self.scheduled_for is not None:
            object.__setattr__(self, "scheduled_for", v.whole_second_instant(self.scheduled_for, "cause.scheduled_for"))
        if self.webhook_invocation_id is not None:
            object.__setattr__(
                self, "webhook_invocation_id", v.uuid_value(self.webhook_invocation_id, "cause.webhook_invocation_id")
            )

    @classmethod
    def event(cls, event_id: bytes) -> Cause:
        """A run triggered by an event; ``event_id`` is exactly 32 bytes."""
        return cls(kind="event", event_id=event_id)

    @classmethod
    def schedule(cls, scheduled_for: dt.datetime) -> Cause:
        """A scheduled run; ``scheduled_for`` is an aware datetime with no sub-second part."""
        return cls(kind="schedule", scheduled_for=scheduled_for)

    @classmethod
    def webhook(cls, invocation_id: uuid.UUID) -> Cause:
        """A run triggered by one webhook invocation."""
        return cls(kind="webhook", webhook_invocation_id=invocation_id)


@dataclass(frozen=True, slots=True)
class Binding:
    """The identity of one delivery: its 8 fields (SPEC section 2). All take part in equality.

    ``community_id``, ``workflow_id``, ``run_id``: UUIDs (strings are parsed).
    ``step_id``: 1..64 characters, not blank. ``target_pubkey``, ``definition_event_id``,
    ``message_event_id``: exactly 32 bytes. ``cause``: a :class:`Cause`.
    """

    community_id: uuid.UUID
    workflow_id: uuid.UUID
    run_id: uuid.UUID
    step_id: str
    target_pubkey: bytes
    definition_event_id: bytes
    message_event_id: bytes
    cause: Cause

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "community_id", v.uuid_value(self.community_id, "community_id"))
        set_(self, "workflow_id", v.uuid_value(self.workflow_id, "workflow_id"))
        set_(self, "run_id", v.uuid_value(self.run_id, "run_id"))
        set_(self, "step_id", v.step_id(self.step_id))
        set_(self, "target_pubkey", v.bytes32(self.target_pubkey, "target_pubkey"))
        set_(self, "definition_event_id", v.bytes32(self.definition_event_id, "definition_event_id"))
        set_(self, "message_event_id", v.bytes32(self.message_event_id, "message_event_id"))
        if not isinstance(self.cause, Cause):
            raise v.invalid("cause", f"must be a Cause, not {type(self.cause).__name__}")

    @property
    def identity(self) -> tuple[uuid.UUID, uuid.UUID, str, bytes]:
        """The unique identity key: (community, run, step, target)."""
        return (self.community_id, self.run_id, self.step_id, self.target_pubkey)

    @classmethod
    def of(cls, delivery: WorkflowAgentDelivery) -> Binding:
        """The binding a stored delivery was committed with."""
        kind = delivery.cause_kind
        cause = Cause(
            kind=kind,  # type: ignore[arg-type]
            event_id=bytes(delivery.cause_event_id) if delivery.cause_event_id is not None else None,
            scheduled_for=delivery.cause_scheduled_for,
            webhook_invocation_id=delivery.cause_webhook_invocation_id,
        )
        return cls(
            community_id=delivery.community_id,
            workflow_id=delivery.workflow_id,
            run_id=delivery.run_id,
            step_id=delivery.step_id,
            target_pubkey=bytes(delivery.target_pubkey),
            definition_event_id=bytes(delivery.definition_event_id),
            message_event_id=bytes(delivery.message_event_id),
            cause=cause,
        )


@dataclass(frozen=True, slots=True)
class Lease:
    """The capability a holder presents to renew or settle (SPEC section 2).

    ``lease_generation`` is the fence token; ``lease_until`` is the deadline read from
    the database clock when the lease was granted or renewed (informational: the
    database judges expiry by its own clock). A caller may rebuild a lease from these fields.
    """

    community_id: uuid.UUID
    delivery_id: uuid.UUID
    target_pubkey: bytes
    lease_generation: int
    lease_until: dt.datetime

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "community_id", v.uuid_value(self.community_id, "lease.community_id"))
        set_(self, "delivery_id", v.uuid_value(self.delivery_id, "lease.delivery_id"))
        set_(self, "target_pubkey", v.bytes32(self.target_pubkey, "lease.target_pubkey"))
        set_(self, "lease_generation", v.int_in_range(self.lease_generation, "lease.lease_generation", 1, 2**63 - 1))
        set_(self, "lease_until", v.aware_datetime(self.lease_until, "lease.lease_until"))

    @classmethod
    def from_database(
        cls,
        community_id: uuid.UUID,
        delivery_id: uuid.UUID,
        target_pubkey: bytes,
        lease_generation: int,
        lease_until: dt.datetime,
    ) -> Lease:
        """A lease from the row a claim or renew statement returned: the values are the
        database's own (a uuid, 32 bytes, a generation >= 1), so they are not validated again
        as a caller's input is; ``lease_until`` is, unless it is already in UTC (a database
        ``TIME_ZONE`` or ``USE_TZ = False`` make it otherwise: then it is converted, or refused
        if naive, as the constructor does)."""
        if lease_until.tzinfo is not dt.UTC:
            lease_until = v.aware_datetime(lease_until, "lease.lease_until")
        lease = object.__new__(cls)
        set_ = object.__setattr__
        set_(lease, "community_id", community_id)
        set_(lease, "delivery_id", delivery_id)
        set_(lease, "target_pubkey", target_pubkey)
        set_(lease, "lease_generation", lease_generation)
        set_(lease, "lease_until", lease_until)
        return lease


@dataclass(frozen=True, slots=True)
class Claim:
    """A won claim: the lease and the claimed delivery (a model instance whose JSON
    snapshots ``execution_trace``/``trigger_context`` are deferred: loaded on first access)."""

    lease: Lease
    delivery: WorkflowAgentDelivery = field(compare=False)


@dataclass(frozen=True, slots=True)
class Renewed:
    """``renew_delivery`` extended the lease to ``lease_until`` (database clock)."""

    lease: Lease

    @property
    def lease_until(self) -> dt.datetime:
        return self.lease.lease_until


@dataclass(frozen=True, slots=True)
class Settled:
    """``finish_delivery`` applied the outcome; ``status`` is the status now recorded
    (``finished``, ``failed``, or ``pending`` for a retry; ``failed`` if retries ran out)."""

    status: str


@dataclass(frozen=True, slots=True)
class AlreadyTerminal:
    """The same holder (same generation) had already settled this delivery: an idempotent
    retry. ``status`` is the recorded terminal status; it never flips."""

    status: str


@dataclass(frozen=True, slots=True)
class LeaseLost:
    """The lease is no longer current: it expired, a newer claim or the reaper bumped the
    generation, the delivery is gone, or the community is not active. Drop the work."""

    reason: str = "lease is not current"


@dataclass(frozen=True, slots=True)
class Settle:
    """One row of :func:`~buzz_delivery.services.settle_deliveries`: a lease and the arguments
    :func:`~buzz_delivery.services.finish_delivery` would take for it (checked by the batch,
    each keyed by its row: ``settles[2].failure_code``)."""

    lease: Lease
    outcome: str
    failure_code: str | None = None
    failure_message: str | None = None
    retry_after: float | None = None


RenewOutcome = Renewed | LeaseLost
FinishOutcome = Settled | AlreadyTerminal | LeaseLost


@dataclass(frozen=True, slots=True)
class ReapResult:
    """What one reaper run did (or, with ``dry_run``, would do). Counts of deliveries.

    - ``reclaimed``: lapsed leases returned to ``pending`` (generation bumped);
    - ``exhausted``: lapsed leases on their last allowed attempt, now ``failed``;
    - ``expired``: lapsed or pending deliveries past ``expires_at``, now ``expired``;
    - ``skipped_fenced``: lapsed leases left alone because their community is not active;
    - ``skipped_busy``: communities whose lapsed leases were left for a later run because a
      lifecycle move held or waited for their write-fence lock (never waited on; SPEC 4.6), or
      because their batch met a record out of step with its queue row (logged as an error);
    - ``batches``: statements run (a dry run: the statements the run would take).
    """

    reclaimed: int = 0
    exhausted: int = 0
    expired: int = 0
    skipped_fenced: int = 0
    skipped_busy: int = 0
    batches: int = 0
    dry_run: bool = False

    @property
    def total(self) -> int:
        return self.reclaimed + self.exhausted + self.expired
