"""Value types of the engine's services: step leases and claims, approval outcomes, run views.

Step transitions return the core's outcome types (:class:`~buzz_delivery.services.Settled`,
:class:`~buzz_delivery.services.AlreadyTerminal`, :class:`~buzz_delivery.services.LeaseLost`,
:class:`~buzz_delivery.services.Renewed`-like :class:`StepRenewed`)."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from buzz_delivery.services import AlreadyTerminal, LeaseLost, Settled
from buzz_delivery.services import validation as v

if TYPE_CHECKING:
    from buzz_delivery.workflows.models import Approval, Run, Step


@dataclass(frozen=True, slots=True)
class StepLease:
    """The capability a step holder presents (SPEC section 11): community, step, its run,
    ``lease_generation`` (fence token), ``attempts`` (the attempt it holds, 1-based) and
    ``lease_until`` (database clock; informational). Rebuildable from its fields."""

    community_id: uuid.UUID
    step_id: uuid.UUID
    run_id: uuid.UUID
    lease_generation: int
    attempts: int
    lease_until: dt.datetime

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "community_id", v.uuid_value(self.community_id, "lease.community_id"))
        set_(self, "step_id", v.uuid_value(self.step_id, "lease.step_id"))
        set_(self, "run_id", v.uuid_value(self.run_id, "lease.run_id"))
        set_(self, "lease_generation", v.int_in_range(self.lease_generation, "lease.lease_generation", 1, 2**63 - 1))
        set_(self, "attempts", v.int_in_range(self.attempts, "lease.attempts", 1, 100))
        set_(self, "lease_until", v.aware_datetime(self.lease_until, "lease.lease_until"))

    @classmethod
    def from_database(
        cls,
        community_id: uuid.UUID,
        step_id: uuid.UUID,
        run_id: uuid.UUID,
        lease_generation: int,
        attempts: int,
        lease_until: dt.datetime,
    ) -> StepLease:
        """A lease from the row a claim statement returned: the values are the database's own
        (uuids, a generation >= 1), so they are not validated again as a caller's input is:
        the caller passes only ``attempts`` within 1..100 and a ``lease_until`` in UTC, else
        it calls the constructor."""
        lease = object.__new__(cls)
        set_ = object.__setattr__
        set_(lease, "community_id", community_id)
        set_(lease, "step_id", step_id)
        set_(lease, "run_id", run_id)
        set_(lease, "lease_generation", lease_generation)
        set_(lease, "attempts", attempts)
        set_(lease, "lease_until", lease_until)
        return lease


@dataclass(frozen=True, slots=True)
class StepClaim:
    """A won step claim: the lease, the step row (as claimed) and its definition entry."""

    lease: StepLease
    step: Step = field(compare=False)
    spec: dict[str, Any] = field(compare=False)


@dataclass(frozen=True, slots=True)
class StepRenewed:
    """``renew_step`` extended the lease to ``lease.lease_until`` (database clock)."""

    lease: StepLease


StepOutcome = Settled | AlreadyTerminal | LeaseLost
RenewOutcome = StepRenewed | LeaseLost


@dataclass(frozen=True, slots=True)
class StepFailure:
    """One failed attempt to record with :func:`~buzz_delivery.workflows.services.fail_steps`:
    the lease it was made under and the arguments :func:`~buzz_delivery.workflows.services.fail_step`
    takes (``retry_after``: a provider's Retry-After, seconds, or None)."""

    lease: StepLease
    failure_code: str
    failure_message: str | None = None
    retryable: bool = True
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class CompletedBatch:
    """What :func:`~buzz_delivery.workflows.services.complete_and_claim_steps` did:
    ``outcomes`` (one per completion, in order; ``None``: not attempted, its run was locked by
    another transaction) and ``claims`` (the ready steps it claimed in the same transaction,
    oldest ready first)."""

    outcomes: list[StepOutcome | None]
    claims: list[StepClaim]


@dataclass(frozen=True, slots=True)
class ApprovalRequested:
    """``request_approval`` parked the step and created ``approval`` (deadline on the DB clock)."""

    approval: Approval = field(compare=False)


@dataclass(frozen=True, slots=True)
class Decided:
    """``decide_approval`` recorded ``state`` (``approved``/``rejected``); the step moved on."""

    state: str
    decided_by: str
    decided_at: dt.datetime


@dataclass(frozen=True, slots=True)
class AlreadyDecided:
    """Someone decided first: ``state`` and ``decided_by`` are theirs."""

    state: str
    decided_by: str
    decided_at: dt.datetime


@dataclass(frozen=True, slots=True)
class Expired:
    """The approval's deadline passed (or its run ended) before a decision."""

    deadline_at: dt.datetime


DecideOutcome = Decided | AlreadyDecided | Expired


@dataclass(frozen=True, slots=True)
class RunView:
    """``get_run``: the engine run and its steps (definition order)."""

    run: Run = field(compare=False)
    steps: list[Step] = field(compare=False)

    @property
    def state(self) -> str:
        return self.run.state

    def step(self, key: str) -> Step:
        """The step with that key (``KeyError`` when none)."""
        for s in self.steps:
            if s.key == key:
                return s
        raise KeyError(key)


@dataclass(frozen=True, slots=True)
class Canceled:
    """``cancel_run`` ended the run (and ``runs - 1`` child runs) and expired ``deliveries``."""

    runs: int
    deliveries: int
