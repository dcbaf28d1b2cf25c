"""States of engine runs, steps and approvals (SPEC section 11), with who moves a row out of each."""

from __future__ import annotations

from django.db import models


class RunState(models.TextChoices):
    """State of an engine run.

    - ``pending``: reserved (a run is created ``running``; nothing is left pending today).
    - ``running``: its steps execute; the Advance trigger ends it when every step is terminal
      (``succeeded``), at once when a step fails under ``on_error: fail_run`` (``failed``);
      ``cancel_run`` -> ``canceled``; the maintenance -> ``failed`` (``run_deadline``).
    - ``succeeded``, ``failed``, ``canceled``: terminal, once (a trigger refuses any change).
    """

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"


RUN_TERMINAL = ("succeeded", "failed", "canceled")


class StepState(models.TextChoices):
    """State of one step of one run.

    - ``pending``: dependencies not all terminal. Advance -> ``ready`` or ``skipped``. A ``map``
      step comes back here once, from ``running``, when it expands into its items (one
      dependency each; ``services.maps``).
    - ``ready``: claimable once ``next_attempt_at`` passed. ``claim_steps`` -> ``running``.
    - ``running``: leased (lease columns set). ``complete_step`` -> ``succeeded``/``waiting``;
      ``fail_step`` -> ``ready`` (retry) or ``failed``; the maintenance, once the lease lapsed,
      -> ``ready`` or ``failed`` (``attempts_exhausted``), or -> ``failed`` (``step_timeout``).
    - ``waiting``: parked on deliveries, a child run, an approval, a wake time (``sleep``) or an
      event (``wait_event``), no lease. Their settling transaction (``send_event`` for an event)
      -> ``succeeded``/``failed``; the maintenance or an orchestrator's poll, past
      ``wait_deadline`` -> ``failed`` (``wait_timeout``), or as ``on_timeout`` says
      (``succeeded`` with a null output: a sleep that is due; ``skipped``).
    - ``succeeded``, ``failed``, ``skipped``, ``canceled``: terminal, once. ``cancel_run`` and a
      failing run move every non-terminal step to ``canceled`` (generation + 1).
    """

    PENDING = "pending"
    READY = "ready"
    RUNNING = "running"
    WAITING = "waiting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"
    CANCELED = "canceled"


STEP_TERMINAL = ("succeeded", "failed", "skipped", "canceled")


class StepKind(models.TextChoices):
    """What a step does once claimed (SPEC sections 11 and 16 "Engine waits"): ``sleep`` and
    ``wait_event`` park ``waiting`` without a lease (until a time, or until an event or their
    timeout); ``map`` runs one element step per item of a runtime list and collects them."""

    FUNCTION = "function"
    SEND_MESSAGE = "send_message"
    SUB_WORKFLOW = "sub_workflow"
    APPROVAL = "approval"
    SLEEP = "sleep"
    WAIT_EVENT = "wait_event"
    MAP = "map"


class OnTimeout(models.TextChoices):
    """What a ``wait_event`` step does when its wait times out: ``fail`` (``wait_timeout``, its
    ``on_error`` applies), ``continue`` (succeeds with a null output), ``skip_dependents``
    (``skipped``: its dependents are skipped, the run goes on). A ``sleep`` step is a wait
    whose timeout is its wake time, under ``continue``."""

    FAIL = "fail"
    CONTINUE = "continue"
    SKIP_DEPENDENTS = "skip_dependents"


class OnError(models.TextChoices):
    """What a failed step does to the rest of its run (SPEC section 11)."""

    FAIL_RUN = "fail_run"
    CONTINUE = "continue"
    SKIP_DEPENDENTS = "skip_dependents"


class ApprovalState(models.TextChoices):
    """- ``pending``: awaiting a decision until ``deadline_at``. ``decide_approval`` ->
    ``approved``/``rejected``; the maintenance, past the deadline -> ``expired``; a cancel
    -> ``expired``. The other three are terminal, once."""

    PENDING = "pending"
    APPROVED = "approved"
    REJECTED = "rejected"
    EXPIRED = "expired"
