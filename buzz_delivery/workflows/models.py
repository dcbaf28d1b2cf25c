"""Models of the workflow engine (SPEC section 11).

Every table is community-scoped (``community_id`` NOT NULL, the core write fence trigger, the
deletion catalog). In the database every primary key and unique key leads with
``community_id`` and every reference between community-scoped tables is a composite foreign key
on ``(community_id, ...)`` (migration ``0002``; the ORM's foreign keys carry no constraint).
Every invariant is a CHECK or a trigger: legal states, terminal once, running <=> lease
columns, counters within bounds, nesting depth bounded. Rows change state only through
:mod:`buzz_delivery.workflows.services` and the Advance triggers of migration ``0002``.
"""

from __future__ import annotations

from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import GinIndex
from django.db import models
from django.db.models import F, Func, Q, Value
from django.db.models.functions import Length, Now
from django.db.models.lookups import Exact, LessThanOrEqual

from buzz_delivery import triggers
from buzz_delivery.models import (
    HOLDER_MAX_CHARS,
    PRIORITY_MAX,
    PRIORITY_MIN,
    CauseKind,
    CommunityScoped,
    Workflow,
    WorkflowRun,
    history_bounded,
    new_uuid7,
)
from buzz_delivery.workflows import wf_triggers
from buzz_delivery.workflows.states import (
    RUN_TERMINAL,
    STEP_TERMINAL,
    ApprovalState,
    OnError,
    OnTimeout,
    RunState,
    StepKind,
    StepState,
)

MAX_DEPTH = 8
TAG_MAX_CHARS = 100
MAX_TAGS = 20
INTEGER = models.IntegerField()


def _len32(field: str) -> Exact:
    return Exact(Length(field), 32)


def _iff(condition: Q, columns: Q, negated: Q) -> Q:
    return (condition & columns) | (~condition & negated)


CAUSE_EXACTLY_ONE = (
    Q(
        cause_kind="event",
        cause_event_id__isnull=False,
        cause_scheduled_for__isnull=True,
        cause_webhook_invocation_id__isnull=True,
    )
    | Q(
        cause_kind="schedule",
        cause_event_id__isnull=True,
        cause_scheduled_for__isnull=False,
        cause_webhook_invocation_id__isnull=True,
    )
    | Q(
        cause_kind="webhook",
        cause_event_id__isnull=True,
        cause_scheduled_for__isnull=True,
        cause_webhook_invocation_id__isnull=False,
    )
)


class DefinitionVersion(CommunityScoped):
    """An immutable, content-hashed version of a workflow's DAG definition.

    ``content``: the validated definition (``{"steps": [...]}``); ``content_hash``: SHA-256 of
    its canonical JSON; ``definition_event_id``: the 32 bytes its runs' deliveries bind to.
    Publishing identical content again returns this row (unique per workflow and hash)."""

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    workflow = models.ForeignKey(
        Workflow, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="versions"
    )
    version = models.IntegerField()
    content = models.JSONField()
    content_hash = models.BinaryField(max_length=32)
    definition_event_id = models.BinaryField(max_length=32)
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "buzz_workflows_definition"
        constraints = [
            models.UniqueConstraint(fields=["community", "workflow", "version"], name="wf_definition_version_key"),
            models.UniqueConstraint(fields=["community", "workflow", "content_hash"], name="wf_definition_hash_key"),
            models.CheckConstraint(condition=Q(version__gte=1), name="wf_definition_version_gte_1"),
            models.CheckConstraint(condition=_len32("content_hash"), name="wf_definition_hash_32_bytes"),
            models.CheckConstraint(condition=_len32("definition_event_id"), name="wf_definition_event_id_32_bytes"),
        ]
        triggers = [*triggers.write_fence(), wf_triggers.immutable("wf_definition_immutable")]

    def __str__(self) -> str:
        return f"{self.workflow_id} v{self.version}"


class Run(CommunityScoped):
    """An engine run: one-to-one with a core :class:`~buzz_delivery.models.WorkflowRun` (same id,
    so deliveries keep pointing at it), pinned to one :class:`DefinitionVersion`."""

    run = models.OneToOneField(
        WorkflowRun, primary_key=True, on_delete=models.DO_NOTHING, db_constraint=False, related_name="engine"
    )
    workflow = models.ForeignKey(
        Workflow, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="engine_runs"
    )
    definition = models.ForeignKey(
        DefinitionVersion, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="runs"
    )
    state = models.CharField(max_length=16, choices=RunState.choices, default=RunState.RUNNING)
    input = models.JSONField(default=dict)
    output = models.JSONField(null=True, blank=True)
    # The user's labels of the run (start_run(tags=...); a child run inherits its parent's), for
    # the admin's search ("tag:customer:42"): at most 20, each 1..100 characters, no whitespace.
    tags = ArrayField(
        models.CharField(max_length=TAG_MAX_CHARS),
        default=list,
        blank=True,
        db_default=Value([], output_field=ArrayField(models.CharField(max_length=TAG_MAX_CHARS))),
    )
    failure_code = models.CharField(max_length=64, null=True, blank=True)  # noqa: DJ001 (NULL = none)
    failure_message = models.TextField(null=True, blank=True)  # noqa: DJ001
    cause_kind = models.CharField(max_length=16, choices=CauseKind.choices)
    cause_event_id = models.BinaryField(max_length=32, null=True, blank=True)
    cause_scheduled_for = models.DateTimeField(null=True, blank=True)
    cause_webhook_invocation_id = models.UUIDField(null=True, blank=True)
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001
    parent_run = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="children",
    )
    parent_step_key = models.CharField(max_length=64, null=True, blank=True)  # noqa: DJ001
    restart_of = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="restarts",
    )
    depth = models.IntegerField(default=0)
    steps_total = models.IntegerField()
    steps_left = models.IntegerField()
    deadline_at = models.DateTimeField(null=True, blank=True)
    # Set when the run ends failed or canceled: its pending deliveries are still to be expired
    # (through the core's service) by the path that ended it or by the next maintenance pass.
    deliveries_to_expire = models.BooleanField(default=False)
    # The trace context the run was started in (W3C headers; NULL without tracing): its steps'
    # spans are its children (buzz_delivery.tracing.work).
    trace_context = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    # Flow control (issue 32): higher first; its steps and the deliveries its steps send take it.
    priority = models.SmallIntegerField(default=0, db_default=0)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "buzz_workflows_run"
        verbose_name = "workflow run"  # apart from the core's "delivery run" (same id)
        constraints = [
            models.CheckConstraint(
                condition=Q(priority__gte=PRIORITY_MIN, priority__lte=PRIORITY_MAX), name="wf_run_priority_range"
            ),
            models.UniqueConstraint(
                fields=["community", "workflow", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="wf_run_idempotency_key",
            ),
            models.CheckConstraint(condition=Q(state__in=RunState.values), name="wf_run_state_known"),
            models.CheckConstraint(
                condition=_iff(Q(state__in=RUN_TERMINAL), Q(finished_at__isnull=False), Q(finished_at__isnull=True)),
                name="wf_run_terminal_iff_finished_at",
            ),
            models.CheckConstraint(condition=CAUSE_EXACTLY_ONE, name="wf_run_cause_exactly_one"),
            models.CheckConstraint(
                condition=Q(cause_event_id__isnull=True) | Q(_len32("cause_event_id")),
                name="wf_run_cause_event_id_32_bytes",
            ),
            models.CheckConstraint(condition=Q(depth__gte=0, depth__lte=MAX_DEPTH), name="wf_run_depth_bounded"),
            models.CheckConstraint(
                condition=_iff(
                    Q(depth=0),
                    Q(parent_run__isnull=True, parent_step_key__isnull=True),
                    Q(parent_run__isnull=False, parent_step_key__isnull=False),
                ),
                name="wf_run_parent_iff_nested",
            ),
            models.CheckConstraint(
                condition=Q(steps_total__gte=1, steps_left__gte=0, steps_left__lte=F("steps_total")),
                name="wf_run_steps_left_within_total",
            ),
            models.CheckConstraint(
                condition=Q(failure_code__isnull=True) | Q(state="failed"), name="wf_run_failure_code_only_when_failed"
            ),
            models.CheckConstraint(
                condition=Q(LessThanOrEqual(Func(F("tags"), function="cardinality", output_field=INTEGER), MAX_TAGS)),
                name="wf_run_tags_bounded",
            ),
        ]
        indexes = [
            # The primary key leads with community_id: this one serves the admin list's order
            # (newest first: ids are UUIDv7) and the lookups by id alone (detail page, a step's
            # or an approval's run) without a scan of the whole table.
            models.Index(fields=["run"], name="wf_run_id_idx"),
            # The list's "failed" filter (an incident's first question): its capped count read
            # a quarter of the table at 1M runs; only failed runs are in it, each written once.
            models.Index(fields=["run"], condition=Q(state="failed"), name="wf_run_failed_idx"),
            models.Index(fields=["community", "workflow", "created_at"], name="wf_run_workflow_idx"),
            models.Index(
                fields=["community", "parent_run"], condition=Q(parent_run__isnull=False), name="wf_run_parent_idx"
            ),
            models.Index(
                fields=["deadline_at"],
                condition=Q(state="running", deadline_at__isnull=False),
                name="wf_run_deadline_idx",
            ),
            models.Index(fields=["community"], condition=Q(deliveries_to_expire=True), name="wf_run_to_expire_idx"),
            # The admin's run search (issue 33), fast at millions of runs: by tag, by a field of
            # the input (jsonb containment), and a workflow's runs newest first.
            GinIndex(fields=["tags"], name="wf_run_tags_idx"),
            GinIndex(fields=["input"], opclasses=["jsonb_path_ops"], name="wf_run_input_idx"),
            models.Index(fields=["workflow", "run"], name="wf_run_workflow_id_idx"),
        ]
        triggers = [*triggers.write_fence(), wf_triggers.terminal_once("wf_run_terminal_once", RUN_TERMINAL)]
        permissions = [
            ("cancel_engine_run", "Can cancel workflow runs"),
            ("restart_engine_run", "Can restart workflow runs from failure"),
            ("retry_engine_step", "Can retry failed workflow steps (restart from failure)"),
        ]

    def __str__(self) -> str:
        return f"run {self.pk} ({self.state})"


class Step(CommunityScoped):
    """One step of one run. Dependencies are copied from the pinned definition at start, so
    the Advance trigger works on this table alone (``dependents``, ``deps_*`` counters)."""

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    run = models.ForeignKey(Run, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="steps")
    key = models.CharField(max_length=64)
    kind = models.CharField(max_length=16, choices=StepKind.choices)
    state = models.CharField(max_length=16, choices=StepState.choices, default=StepState.PENDING)
    position = models.IntegerField(default=0)
    depends_on = ArrayField(models.CharField(max_length=64), default=list, blank=True)
    dependents = ArrayField(models.CharField(max_length=64), default=list, blank=True)
    deps_total = models.IntegerField(default=0)
    deps_done = models.IntegerField(default=0)
    deps_blocked = models.IntegerField(default=0)
    on_error = models.CharField(max_length=16, choices=OnError.choices, default=OnError.FAIL_RUN)
    when_cond = models.JSONField(null=True, blank=True)
    max_attempts = models.IntegerField(default=1)
    attempts = models.IntegerField(default=0)
    timeout_seconds = models.IntegerField(null=True, blank=True)
    backoff_base_seconds = models.FloatField(default=2)
    backoff_cap_seconds = models.FloatField(default=300)
    lease_generation = models.BigIntegerField(default=0)
    lease_until = models.DateTimeField(null=True, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    waiting_since = models.DateTimeField(null=True, blank=True)
    wait_deadline = models.DateTimeField(null=True, blank=True)
    expected = models.IntegerField(null=True, blank=True)
    delivered_terminal = models.IntegerField(default=0)
    delivered_failed = models.IntegerField(default=0)
    tolerate_failures = models.IntegerField(default=0)
    child_run_id = models.UUIDField(null=True, blank=True)
    output = models.JSONField(null=True, blank=True)
    # The last failure: a failed step's own, or the previous attempt's (kept as history while
    # the step retries, waits, or is canceled).
    failure_code = models.CharField(max_length=64, null=True, blank=True)  # noqa: DJ001
    failure_message = models.TextField(null=True, blank=True)  # noqa: DJ001
    skip_reason = models.CharField(max_length=32, null=True, blank=True)  # noqa: DJ001
    # The run's priority (issue 32): claims take higher first, then the longest ready.
    priority = models.SmallIntegerField(default=0, db_default=0)
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Who holds (or last held) the lease, the renewals of that lease, and the step's last
    # transitions (claim, settle, retry, park, approval, reaps), as on deliveries (core 0008).
    claimed_by = models.TextField(null=True, blank=True)  # noqa: DJ001  (NULL = never named)
    renewals = models.IntegerField(default=0, db_default=0)
    history = models.JSONField(default=list, db_default=Value([], output_field=models.JSONField()), blank=True)
    # wait_event: the event it waits for (set when it parks), and what its timeout does; a
    # sleep parks under on_timeout "continue" (its wake time is wait_deadline).
    event_name = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001
    event_key = models.TextField(null=True, blank=True)  # noqa: DJ001
    on_timeout = models.CharField(max_length=16, choices=OnTimeout.choices, null=True, blank=True)  # noqa: DJ001
    # An element step of a map: the map step's key, the item's index, and its own (resolved)
    # spec, which the definition does not hold. NULL for the definition's own steps.
    map_key = models.CharField(max_length=64, null=True, blank=True)  # noqa: DJ001
    item_index = models.IntegerField(null=True, blank=True)
    spec = models.JSONField(null=True, blank=True)
    # Concurrency limits by key (issue 32, services/flow.py ``STEP_CONCURRENCY_LIMITS``): the slot
    # this step's claim holds under each declared limit's key (0..N-1), unique among the running
    # steps of that key; NULL = no limit. ``slot_workflow_id`` is the workflow of the step's run,
    # copied by a claim under limits so the ``workflow`` and ``step`` keys can be indexed here.
    slot_community = models.SmallIntegerField(null=True, blank=True, editable=False)
    slot_workflow = models.SmallIntegerField(null=True, blank=True, editable=False)
    slot_step = models.SmallIntegerField(null=True, blank=True, editable=False)
    slot_workflow_id = models.UUIDField(null=True, blank=True, editable=False)

    class Meta:
        db_table = "buzz_workflows_step"
        verbose_name = "workflow step"
        constraints = [
            models.CheckConstraint(
                condition=Q(priority__gte=PRIORITY_MIN, priority__lte=PRIORITY_MAX), name="wf_step_priority_range"
            ),
            *(
                models.CheckConstraint(
                    condition=Q(**{f"{column}__isnull": True}) | Q(**{f"{column}__gte": 0, f"{column}__lt": 1000}),
                    name=f"wf_step_{column}_range",
                )
                for column in ("slot_community", "slot_workflow", "slot_step")
            ),
            # At most N running at once per key: N slots, none held twice by running steps.
            *(
                models.UniqueConstraint(
                    fields=["community", *key, column],
                    condition=Q(state="running", **{f"{column}__isnull": False}),
                    name=f"wf_step_{column}_key",
                )
                for column, key in (
                    ("slot_community", ()),
                    ("slot_workflow", ("slot_workflow_id",)),
                    ("slot_step", ("slot_workflow_id", "key")),
                )
            ),
            models.UniqueConstraint(fields=["community", "run", "key"], name="wf_step_key"),
            models.CheckConstraint(condition=Q(state__in=StepState.values), name="wf_step_state_known"),
            models.CheckConstraint(condition=Q(kind__in=StepKind.values), name="wf_step_kind_known"),
            models.CheckConstraint(condition=Q(on_error__in=OnError.values), name="wf_step_on_error_known"),
            models.CheckConstraint(condition=Q(key__regex=r"\S"), name="wf_step_key_not_blank"),
            models.CheckConstraint(
                condition=_iff(
                    Q(state="running"),
                    Q(lease_until__isnull=False, claimed_at__isnull=False),
                    Q(lease_until__isnull=True, claimed_at__isnull=True),
                ),
                name="wf_step_running_iff_lease",
            ),
            models.CheckConstraint(
                condition=_iff(Q(state__in=STEP_TERMINAL), Q(finished_at__isnull=False), Q(finished_at__isnull=True)),
                name="wf_step_terminal_iff_finished_at",
            ),
            models.CheckConstraint(
                condition=_iff(Q(state="waiting"), Q(waiting_since__isnull=False), Q(wait_deadline__isnull=True)),
                name="wf_step_waiting_iff_since",
            ),
            models.CheckConstraint(
                condition=Q(deps_blocked__gte=0, deps_blocked__lte=F("deps_done"), deps_done__lte=F("deps_total")),
                name="wf_step_deps_within_bounds",
            ),
            models.CheckConstraint(
                condition=Q(state__in=["pending", "skipped", "canceled"]) | Q(deps_done=F("deps_total")),
                name="wf_step_started_after_all_deps",
            ),
            models.CheckConstraint(
                condition=Q(max_attempts__gte=1, attempts__gte=0, attempts__lte=F("max_attempts")),
                name="wf_step_attempts_within_max",
            ),
            models.CheckConstraint(
                condition=~Q(state="running") | Q(attempts__gte=1), name="wf_step_running_has_attempt"
            ),
            models.CheckConstraint(condition=Q(lease_generation__gte=0), name="wf_step_generation_gte_0"),
            models.CheckConstraint(
                condition=Q(expected__isnull=True, delivered_terminal=0, delivered_failed=0)
                | Q(
                    expected__gte=0,
                    delivered_failed__gte=0,
                    delivered_failed__lte=F("delivered_terminal"),
                    delivered_terminal__lte=F("expected"),
                ),
                name="wf_step_delivery_counters_within_bounds",
            ),
            models.CheckConstraint(condition=Q(tolerate_failures__gte=0), name="wf_step_tolerate_gte_0"),
            models.CheckConstraint(
                condition=Q(output__isnull=True) | Q(state__in=["succeeded", "failed"]),
                name="wf_step_output_only_when_finished",
            ),
            models.CheckConstraint(
                condition=Q(claimed_by__isnull=True) | Q(LessThanOrEqual(Length("claimed_by"), HOLDER_MAX_CHARS)),
                name="wf_step_claimed_by_length",
            ),
            models.CheckConstraint(condition=Q(renewals__gte=0), name="wf_step_renewals_gte_0"),
            models.CheckConstraint(condition=history_bounded("history"), name="wf_step_history_bounded"),
            models.CheckConstraint(
                condition=Q(on_timeout__isnull=True) | Q(on_timeout__in=OnTimeout.values),
                name="wf_step_on_timeout_known",
            ),
            models.CheckConstraint(
                condition=Q(event_name__isnull=True, event_key__isnull=True)
                | Q(event_name__isnull=False, event_key__isnull=False, kind="wait_event"),
                name="wf_step_event_pair",
            ),
            models.CheckConstraint(
                condition=Q(map_key__isnull=True, item_index__isnull=True, spec__isnull=True)
                | Q(map_key__isnull=False, item_index__gte=0, spec__isnull=False),
                name="wf_step_map_element_fields",
            ),
        ]
        indexes = [
            # The admin list's order (newest first, UUIDv7 ids) and lookups by id alone; the
            # primary key leads with community_id.
            models.Index(fields=["id"], name="wf_step_id_idx"),
            # The list's "failed" filter: a rare state spread over the whole table (its capped
            # count read every row); only failed steps are in it, each written once.
            models.Index(fields=["id"], condition=Q(state="failed"), name="wf_step_failed_idx"),
            models.Index(
                fields=["community", "-priority", "ready_at"], condition=Q(state="ready"), name="wf_step_ready_idx"
            ),
            models.Index(fields=["lease_until"], condition=Q(state="running"), name="wf_step_running_lease_idx"),
            models.Index(
                fields=["wait_deadline"],
                condition=Q(state="waiting", wait_deadline__isnull=False),
                name="wf_step_wait_deadline_idx",
            ),
            # send_event finds the steps waiting for (name, key) of a community.
            models.Index(
                fields=["community", "event_name", "event_key"],
                condition=Q(state="waiting", event_name__isnull=False),
                name="wf_step_event_wait_idx",
            ),
        ]
        triggers = [
            *triggers.write_fence(),
            wf_triggers.terminal_once("wf_step_terminal_once", STEP_TERMINAL),
            wf_triggers.generation_monotonic("wf_step_generation_monotonic"),
            triggers.history_append_only("wf_step"),
        ]

    def __str__(self) -> str:
        return f"{self.key} ({self.state})"

    @property
    def is_terminal(self) -> bool:
        return self.state in STEP_TERMINAL


class Approval(CommunityScoped):
    """A human decision a waiting step or an agent run waits for (SPEC 11 "Approvals").
    Requested once per step attempt (its lease generation), decided once, before its deadline.
    An agent run's approval (``buzz_delivery.agents``) has no run, step nor generation: the
    agent run points at it, and a trigger of that app resumes the run when it is closed."""

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    run = models.ForeignKey(
        Run, null=True, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="approvals"
    )
    step = models.ForeignKey(
        Step, null=True, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="approvals"
    )
    step_generation = models.BigIntegerField(null=True)
    state = models.CharField(max_length=16, choices=ApprovalState.choices, default=ApprovalState.PENDING)
    prompt = models.TextField(blank=True, default="")
    requested_at = models.DateTimeField()
    deadline_at = models.DateTimeField()
    closed_at = models.DateTimeField(null=True, blank=True)
    decided_by = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001

    class Meta:
        db_table = "buzz_workflows_approval"
        constraints = [
            models.UniqueConstraint(fields=["community", "step", "step_generation"], name="wf_approval_per_attempt"),
            models.CheckConstraint(condition=Q(state__in=ApprovalState.values), name="wf_approval_state_known"),
            models.CheckConstraint(
                condition=_iff(Q(state="pending"), Q(closed_at__isnull=True), Q(closed_at__isnull=False)),
                name="wf_approval_closed_iff_not_pending",
            ),
            models.CheckConstraint(
                condition=_iff(
                    Q(state__in=["approved", "rejected"]), Q(decided_by__isnull=False), Q(decided_by__isnull=True)
                ),
                name="wf_approval_decided_iff_decider",
            ),
            models.CheckConstraint(condition=Q(deadline_at__gt=F("requested_at")), name="wf_approval_deadline_after"),
            models.CheckConstraint(
                condition=Q(run__isnull=False, step__isnull=False, step_generation__isnull=False)
                | Q(run__isnull=True, step__isnull=True, step_generation__isnull=True),
                name="wf_approval_step_or_none",
            ),
        ]
        indexes = [
            models.Index(
                fields=["community", "requested_at"], condition=Q(state="pending"), name="wf_approval_pending_idx"
            ),
            models.Index(fields=["deadline_at"], condition=Q(state="pending"), name="wf_approval_deadline_idx"),
        ]
        triggers = [
            *triggers.write_fence(),
            wf_triggers.terminal_once("wf_approval_terminal_once", ("approved", "rejected", "expired")),
        ]
        permissions = [("decide_approval", "Can approve or reject workflow approvals")]

    def __str__(self) -> str:
        return f"approval {self.id} ({self.state})"


class MissedSlots(models.TextChoices):
    """What the maintenance does with cron slots that passed while it did not run:
    ``latest`` starts only the most recent due slot (the others are counted as missed);
    ``all`` starts every due slot (at most 100 per pass, oldest first)."""

    LATEST = "latest"
    ALL = "all"


class Schedule(CommunityScoped):
    """A cron schedule of a workflow (UTC). The maintenance starts one run per slot, with
    ``Cause.schedule(slot)`` and an idempotency key naming the schedule and the slot, so a second
    start of the same slot (two overlapping maintenance runs) returns the first run."""

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    workflow = models.ForeignKey(
        Workflow, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="schedules"
    )
    cron = models.CharField(max_length=200)
    input = models.JSONField(default=dict, blank=True)
    missed = models.CharField(max_length=8, choices=MissedSlots.choices, default=MissedSlots.LATEST)
    enabled = models.BooleanField(default=True)
    next_slot_at = models.DateTimeField()
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "buzz_workflows_schedule"
        constraints = [
            models.CheckConstraint(condition=Q(missed__in=MissedSlots.values), name="wf_schedule_missed_known"),
            models.CheckConstraint(condition=Q(cron__regex=r"\S"), name="wf_schedule_cron_not_blank"),
        ]
        indexes = [
            models.Index(fields=["next_slot_at"], condition=Q(enabled=True), name="wf_schedule_due_idx"),
        ]
        triggers = [*triggers.write_fence()]

    def __str__(self) -> str:
        return f"{self.cron} -> {self.workflow_id}"


class SentEvent(CommunityScoped):
    """The last event sent under a (name, key) of a community (SPEC 16 "Engine waits"):
    :func:`~buzz_delivery.workflows.services.send_event` writes it and, in the same transaction,
    resumes every step waiting for it; a ``wait_event`` step that starts while it is kept
    (``expires_at``, ``BUZZ_WORKFLOWS['EVENT_RETENTION_SECONDS']`` after it was sent) takes it
    at once. The row is also the lock a send and a starting wait meet on (``sent_at`` NULL: a
    wait created it, nothing was sent yet), so an event sent while a step parks is never lost.
    The maintenance deletes rows past ``expires_at`` and the placeholders."""

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    name = models.CharField(max_length=200)
    key = models.TextField()
    payload = models.JSONField(null=True, blank=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    sends = models.IntegerField(default=0)
    resumed = models.IntegerField(default=0)
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "buzz_workflows_sent_event"
        constraints = [
            models.UniqueConstraint(fields=["community", "name", "key"], name="wf_sent_event_key"),
            models.CheckConstraint(
                condition=Q(sent_at__isnull=True, payload__isnull=True, expires_at__isnull=True, sends=0)
                | Q(sent_at__isnull=False, payload__isnull=False, expires_at__isnull=False, sends__gte=1),
                name="wf_sent_event_sent_iff_payload",
            ),
            models.CheckConstraint(condition=Q(resumed__gte=0), name="wf_sent_event_resumed_gte_0"),
        ]
        indexes = [models.Index(fields=["expires_at"], name="wf_sent_event_expires_idx")]
        triggers = [*triggers.write_fence()]
        permissions = [("send_workflow_event", "Can send workflow events to waiting steps")]

    def __str__(self) -> str:
        return f"{self.name}:{self.key}"
