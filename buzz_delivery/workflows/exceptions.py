"""Exceptions of the workflow engine; each docstring says when it is raised. Bad input is a
``ValidationError`` keyed by the argument, never one of these."""

from __future__ import annotations

from buzz_delivery.exceptions import BuzzDeliveryError


class WorkflowError(BuzzDeliveryError):
    """Base class of the engine's errors."""


class RunNotFound(WorkflowError):
    """No engine run with that id in that community."""


class ApprovalNotFound(WorkflowError):
    """No approval with that id in that community."""


class IdempotencyConflict(WorkflowError):
    """``start_run`` with an idempotency key already used for a run with a different input."""


class RunNotRestartable(WorkflowError):
    """``restart_run`` of a run that has not ended (only terminal runs are restarted)."""
