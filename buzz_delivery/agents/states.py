"""States of agent runs and journal entries (SPEC section 12), with who moves a row out of each."""

from __future__ import annotations

from django.db import models


class RunState(models.TextChoices):
    """State of one agent run.

    - ``pending``: claimable once ``next_attempt_at`` passed. ``claim_agent_runs`` -> ``running``;
      ``cancel_agent_run`` -> ``cancelled``; the reaper past ``timeout_at`` -> ``timeout``.
    - ``running``: leased (lease columns and ``worker_id`` set). ``journal_call`` ->
      ``waiting_tool``; ``request_approval`` -> ``waiting_approval``; ``complete_run`` ->
      ``completed``; ``fail_run`` -> ``failed`` (or stays ``running`` with ``unwinding`` while its
      compensations run); the reaper, once the lease lapsed -> ``pending`` (attempt counted,
      backoff) or ``failed`` (``attempts_exhausted``).
    - ``waiting_tool``: leased, a journaled call is in flight. ``record_call_result`` ->
      ``running``; otherwise as ``running``.
    - ``waiting_approval``: no lease; parked on an engine approval. Its decision (or expiry)
      -> ``pending`` (a trigger, in the deciding transaction).
    - ``completed``, ``failed``, ``cancelled``, ``timeout``: terminal, once (a trigger refuses
      any change).
    """

    PENDING = "pending"
    RUNNING = "running"
    WAITING_TOOL = "waiting_tool"
    WAITING_APPROVAL = "waiting_approval"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"


RUN_TERMINAL = ("completed", "failed", "cancelled", "timeout")
RUN_LEASED = ("running", "waiting_tool")


class CallStatus(models.TextChoices):
    """Status of one journal entry: ``pending`` (journaled, not yet answered) -> ``succeeded`` |
    ``failed`` (``record_call_result``, or the approval's decision for an approval entry).
    Terminal once."""

    PENDING = "pending"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class CompensationStatus(models.TextChoices):
    """Compensation of one journal entry: NULL (not undone) -> ``compensating`` (begun, under the
    run's lease) -> ``compensated`` | ``compensation_failed`` (terminal once)."""

    COMPENSATING = "compensating"
    COMPENSATED = "compensated"
    COMPENSATION_FAILED = "compensation_failed"


class EntryKind(models.TextChoices):
    TOOL = "tool"
    APPROVAL = "approval"
