"""Public services of the workflow engine (SPEC section 11). Tests outside the project call
these names; every one validates its arguments (``ValidationError`` keyed by the argument)
before any SQL, uses the database clock, and returns typed outcomes for expected races."""

from buzz_delivery.workflows.definition import validate_definition
from buzz_delivery.workflows.services.approvals import decide_approval, request_approval
from buzz_delivery.workflows.services.definitions import publish_definition
from buzz_delivery.workflows.services.runs import cancel_run, get_run, restart_run, start_run
from buzz_delivery.workflows.services.schedules import create_schedule, start_due_schedules
from buzz_delivery.workflows.services.steps import (
    claim_steps,
    communities_with_ready_steps,
    complete_and_claim_steps,
    complete_step,
    complete_steps,
    fail_step,
    fail_steps,
    fail_steps_skip_locked,
    park_step,
    renew_step,
    renew_steps,
)
from buzz_delivery.workflows.services.types import (
    AlreadyDecided,
    ApprovalRequested,
    Canceled,
    CompletedBatch,
    Decided,
    Expired,
    RenewOutcome,
    RunView,
    StepClaim,
    StepFailure,
    StepLease,
    StepRenewed,
)
from buzz_delivery.workflows.services.waits import (
    DueWaits,
    EventSent,
    communities_with_due_waits,
    end_due_waits,
    send_event,
)

__all__ = [
    "AlreadyDecided",
    "ApprovalRequested",
    "Canceled",
    "CompletedBatch",
    "Decided",
    "DueWaits",
    "EventSent",
    "Expired",
    "RenewOutcome",
    "RunView",
    "StepClaim",
    "StepFailure",
    "StepLease",
    "StepRenewed",
    "cancel_run",
    "claim_steps",
    "communities_with_due_waits",
    "communities_with_ready_steps",
    "complete_and_claim_steps",
    "complete_step",
    "complete_steps",
    "create_schedule",
    "decide_approval",
    "end_due_waits",
    "fail_step",
    "fail_steps",
    "fail_steps_skip_locked",
    "get_run",
    "park_step",
    "publish_definition",
    "renew_step",
    "renew_steps",
    "request_approval",
    "restart_run",
    "send_event",
    "start_due_schedules",
    "start_run",
    "validate_definition",
]
