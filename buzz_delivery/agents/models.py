"""Models of agent runs (SPEC section 12).

Every table is community-scoped (``community_id`` NOT NULL, the core write fence trigger, the
deletion catalog). In the database every primary and unique key leads with ``community_id`` and
every reference between community-scoped tables is a composite foreign key on
``(community_id, ...)`` (migration ``0002``; the ORM's foreign keys carry no constraint). Every
invariant is a CHECK or a trigger: legal states, terminal once, leased states <=> lease columns,
budgets within their caps, a contiguous journal sequence per run. Rows change state only through
:mod:`buzz_delivery.agents.services` and the triggers of migration ``0002``.
"""

from __future__ import annotations

from django.db import models
from django.db.models import F, Q, Value
from django.db.models.functions import Coalesce, Length, Now
from django.db.models.lookups import Exact

from buzz_delivery import triggers
from buzz_delivery.agents import ag_triggers
from buzz_delivery.agents.states import RUN_LEASED, RUN_TERMINAL, CallStatus, CompensationStatus, EntryKind, RunState
from buzz_delivery.models import (
    PRIORITY_MAX,
    PRIORITY_MIN,
    CommunityScoped,
    WorkflowRun,
    history_bounded,
    new_uuid7,
)
from buzz_delivery.workflows import wf_triggers
from buzz_delivery.workflows.models import Approval, Step

DEFAULT_MAX_TOOL_CALLS = 100
DEFAULT_MAX_COST = 1_000_000


def _len32(field: str) -> Exact:
    return Exact(Length(field), 32)


def _iff(condition: Q, columns: Q, negated: Q) -> Q:
    return (condition & columns) | (~condition & negated)


class AgentRun(CommunityScoped):
    """One agent run: started from a delivery (``accept_delivery``; ``delivery_id``,
    ``source_run_id``, ``source_step_key`` set) or from an inbound channel event
    (``intake_event``). Budgets: ``max_tool_calls`` journal entries, ``max_cost`` cost units
    (integers, the caller's unit), enforced by CHECKs on the ``*_used`` counters."""

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    agent_pubkey = models.BinaryField(max_length=32)
    state = models.CharField(max_length=20, choices=RunState.choices, default=RunState.PENDING)
    unwinding = models.BooleanField(default=False)
    shadow = models.BooleanField(default=False)
    input = models.JSONField(default=dict)
    input_hash = models.BinaryField(max_length=32)
    output = models.JSONField(null=True, blank=True)
    output_hash = models.BinaryField(max_length=32, null=True, blank=True)
    failure_code = models.CharField(max_length=64, null=True, blank=True)  # noqa: DJ001 (NULL = none)
    failure_message = models.TextField(null=True, blank=True)  # noqa: DJ001
    delivery_id = models.UUIDField(null=True, blank=True)
    source_run = models.ForeignKey(
        WorkflowRun,
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="agent_runs",
    )
    source_step_key = models.CharField(max_length=64, null=True, blank=True)  # noqa: DJ001
    approval = models.ForeignKey(
        Approval,
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="agent_runs",
    )
    lease_generation = models.BigIntegerField(default=0)
    lease_until = models.DateTimeField(null=True, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    worker_id = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001
    attempts = models.IntegerField(default=0)
    max_attempts = models.IntegerField(default=3)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    timeout_at = models.DateTimeField(null=True, blank=True)
    max_tool_calls = models.IntegerField(default=DEFAULT_MAX_TOOL_CALLS)
    tool_calls_used = models.IntegerField(default=0)
    max_cost = models.BigIntegerField(default=DEFAULT_MAX_COST)
    cost_used = models.BigIntegerField(default=0)
    # The operator's cap on this run's lease length (its policy when it was created; NULL = the
    # core's MAX_LEASE_SECONDS): claims and heartbeats asking for more get this much.
    max_lease_seconds = models.FloatField(null=True, blank=True)
    # The trace context the run was accepted in (W3C headers; NULL without tracing): its
    # handler's spans are its children (buzz_delivery.tracing.work).
    trace_context = models.JSONField(null=True, blank=True)
    # Flow control (issue 32): the accepted delivery's priority (0 for an intake); claims take
    # higher first, oldest first within one.
    priority = models.SmallIntegerField(default=0, db_default=0)
    # Concurrency limits by key (issue 32, services/flow.py ``AGENT_CONCURRENCY_LIMITS``): the slot
    # this run's claim holds under each declared limit's key (0..N-1), unique among the leased
    # runs of that key; NULL = no limit. A run out of its leased states holds no slot.
    slot_community = models.SmallIntegerField(null=True, blank=True, editable=False)
    slot_agent = models.SmallIntegerField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    finished_at = models.DateTimeField(null=True, blank=True)
    # The holder is ``worker_id``; these count its lease's heartbeats and keep the run's last
    # transitions (claim, complete, fail, park, cancel, reaps), as on deliveries (core 0008).
    renewals = models.IntegerField(default=0, db_default=0)
    history = models.JSONField(default=list, db_default=Value([], output_field=models.JSONField()), blank=True)
    # Streamed output (issue 29, SPEC 16): chunks emitted so far (the last chunk's seq) and their
    # bytes (UTF-8), counted by the fenced statement that inserts each chunk (agents/services/output.py).
    output_chunks = models.IntegerField(default=0, db_default=0, editable=False)
    output_bytes = models.BigIntegerField(default=0, db_default=0, editable=False)

    class Meta:
        db_table = "buzz_agents_run"
        constraints = [
            models.CheckConstraint(
                condition=Q(priority__gte=PRIORITY_MIN, priority__lte=PRIORITY_MAX), name="ag_run_priority_range"
            ),
            *(
                models.CheckConstraint(
                    condition=Q(**{f"{column}__isnull": True}) | Q(**{f"{column}__gte": 0, f"{column}__lt": 1000}),
                    name=f"ag_run_{column}_range",
                )
                for column in ("slot_community", "slot_agent")
            ),
            # At most N leased at once per key: N slots, none held twice by leased runs.
            *(
                models.UniqueConstraint(
                    fields=["community", *key, column],
                    condition=Q(state__in=RUN_LEASED, **{f"{column}__isnull": False}),
                    name=f"ag_run_{column}_key",
                )
                for column, key in (("slot_community", ()), ("slot_agent", ("agent_pubkey",)))
            ),
            models.UniqueConstraint(
                fields=["community", "delivery_id"],
                condition=Q(delivery_id__isnull=False),
                name="ag_run_one_per_delivery",
            ),
            models.CheckConstraint(condition=Q(state__in=RunState.values), name="ag_run_state_known"),
            models.CheckConstraint(
                condition=_iff(Q(state__in=RUN_TERMINAL), Q(finished_at__isnull=False), Q(finished_at__isnull=True)),
                name="ag_run_terminal_iff_finished_at",
            ),
            models.CheckConstraint(
                condition=_iff(
                    Q(state__in=RUN_LEASED),
                    Q(lease_until__isnull=False, claimed_at__isnull=False, worker_id__isnull=False),
                    Q(lease_until__isnull=True, claimed_at__isnull=True),
                ),
                name="ag_run_leased_iff_lease",
            ),
            models.CheckConstraint(
                condition=~Q(state="waiting_approval") | Q(approval__isnull=False),
                name="ag_run_waiting_approval_has_approval",
            ),
            models.CheckConstraint(
                condition=Q(delivery_id__isnull=True, source_run__isnull=True, source_step_key__isnull=True)
                | Q(delivery_id__isnull=False, source_run__isnull=False, source_step_key__isnull=False),
                name="ag_run_delivery_source_all_or_none",
            ),
            models.CheckConstraint(condition=_len32("agent_pubkey"), name="ag_run_agent_pubkey_32_bytes"),
            models.CheckConstraint(condition=_len32("input_hash"), name="ag_run_input_hash_32_bytes"),
            models.CheckConstraint(
                condition=_iff(
                    Q(state="completed"),
                    Q(output_hash__isnull=False) & Q(_len32("output_hash")),
                    Q(output_hash__isnull=True),
                ),
                name="ag_run_output_hash_iff_completed",
            ),
            models.CheckConstraint(condition=Q(lease_generation__gte=0), name="ag_run_generation_gte_0"),
            models.CheckConstraint(
                condition=Q(max_attempts__gte=1, attempts__gte=0, attempts__lte=F("max_attempts")),
                name="ag_run_attempts_within_max",
            ),
            models.CheckConstraint(
                condition=Q(max_tool_calls__gte=0, tool_calls_used__gte=0, tool_calls_used__lte=F("max_tool_calls")),
                name="ag_run_tool_calls_within_budget",
            ),
            models.CheckConstraint(
                condition=Q(max_cost__gte=0, cost_used__gte=0, cost_used__lte=F("max_cost")),
                name="ag_run_cost_within_budget",
            ),
            models.CheckConstraint(
                condition=Q(failure_code__isnull=True)
                | Q(state__in=["failed", "cancelled", "timeout"])
                | Q(unwinding=True),
                name="ag_run_failure_code_only_when_failing",
            ),
            models.CheckConstraint(condition=Q(renewals__gte=0), name="ag_run_renewals_gte_0"),
            models.CheckConstraint(
                condition=Q(output_chunks__gte=0, output_bytes__gte=0), name="ag_run_output_counters_gte_0"
            ),
            models.CheckConstraint(condition=history_bounded("history"), name="ag_run_history_bounded"),
        ]
        indexes = [
            # The admin list's order (newest first, UUIDv7 ids) and lookups by id alone; the
            # primary key leads with community_id.
            models.Index(fields=["id"], name="ag_run_id_idx"),
            # The list's filters on rare values spread over the whole table (a capped count read
            # every row): only the runs in that state, or shadow runs, are in these.
            models.Index(fields=["id"], condition=Q(state="failed"), name="ag_run_failed_idx"),
            models.Index(fields=["id"], condition=Q(state="waiting_approval"), name="ag_run_waiting_approval_idx"),
            models.Index(fields=["id"], condition=Q(shadow=True), name="ag_run_shadow_idx"),
            models.Index(
                fields=["community", "agent_pubkey", "-priority", "created_at"],
                condition=Q(state="pending"),
                name="ag_run_pending_idx",
            ),
            models.Index(fields=["lease_until"], condition=Q(state__in=RUN_LEASED), name="ag_run_lease_idx"),
            models.Index(
                fields=["timeout_at"],
                condition=Q(timeout_at__isnull=False) & ~Q(state__in=RUN_TERMINAL),
                name="ag_run_timeout_idx",
            ),
            models.Index(
                fields=["community", "source_run", "source_step_key"],
                condition=Q(source_run__isnull=False),
                name="ag_run_source_idx",
            ),
            # The run that asked for an approval (the approvals list's "asked by", the decision
            # trigger's resume): a probe within the approval's community instead of a scan of it.
            models.Index(
                fields=["community", "approval"], condition=Q(approval__isnull=False), name="ag_run_approval_idx"
            ),
        ]
        triggers = [
            *triggers.write_fence(),
            wf_triggers.terminal_once("ag_run_terminal_once", RUN_TERMINAL),
            wf_triggers.generation_monotonic("ag_run_generation_monotonic"),
            ag_triggers.counters_step_by_one(),
            triggers.history_append_only("ag_run"),
        ]
        permissions = [("cancel_agent_run", "Can cancel agent runs")]

    def __str__(self) -> str:
        return f"agent run {self.pk} ({self.state})"


class JournalEntry(CommunityScoped):
    """One journaled tool call (or approval) of a run, written before the call is made
    (SPEC 12 "Journal"). A resumed handler replays it by ``replay_key`` (its scope and index in the
    scope). ``seq`` is contiguous per run from 1 (a trigger checks it against the
    run's ``tool_calls_used``); ``idempotency_key`` is handed to the tool; ``generation`` is the
    run lease generation that journaled it, ``result_generation`` the one that recorded the result."""

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    run = models.ForeignKey(
        AgentRun, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="journal"
    )
    seq = models.IntegerField()
    # Replay key (agents migration 0022, docs/agents.md "Resume"): the entry is call ``scope_index``
    # of scope ``scope`` ('' = the run's root); NULL (entries journaled before 0022) means ``seq``.
    scope = models.CharField(max_length=200, default="", db_default="", blank=True)
    scope_index = models.IntegerField(null=True, blank=True)
    kind = models.CharField(max_length=16, choices=EntryKind.choices, default=EntryKind.TOOL)
    tool_name = models.CharField(max_length=200)
    idempotency_key = models.CharField(max_length=200)
    input_hash = models.BinaryField(max_length=32)
    args = models.JSONField(null=True, blank=True)
    cost = models.BigIntegerField(default=0)
    destructive = models.BooleanField(default=False)
    compensation = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=CallStatus.choices, default=CallStatus.PENDING)
    uncertain = models.BooleanField(default=False)
    blocked_reason = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001
    error = models.TextField(null=True, blank=True)  # noqa: DJ001
    output = models.JSONField(null=True, blank=True)
    output_hash = models.BinaryField(max_length=32, null=True, blank=True)
    latency_ms = models.IntegerField(null=True, blank=True)
    approval = models.ForeignKey(
        Approval,
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="+",
    )
    generation = models.BigIntegerField()
    result_generation = models.BigIntegerField(null=True, blank=True)
    compensation_status = models.CharField(  # noqa: DJ001
        max_length=24, choices=CompensationStatus.choices, null=True, blank=True
    )
    compensation_generation = models.BigIntegerField(null=True, blank=True)
    compensation_error = models.TextField(null=True, blank=True)  # noqa: DJ001
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    finished_at = models.DateTimeField(null=True, blank=True)
    compensated_at = models.DateTimeField(null=True, blank=True)

    @property
    def replay_key(self) -> tuple[str, int]:
        """(scope, index) a resumed handler replays this entry at."""
        return self.scope, self.scope_index if self.scope_index is not None else self.seq

    class Meta:
        db_table = "buzz_agents_journal"
        ordering = ["seq"]
        constraints = [
            models.UniqueConstraint(fields=["community", "run", "seq"], name="ag_journal_seq_key"),
            models.UniqueConstraint(
                F("community"), F("run"), F("scope"), Coalesce("scope_index", "seq"), name="ag_journal_scope_key"
            ),
            models.CheckConstraint(
                condition=Q(scope_index__isnull=True) | Q(scope_index__gte=1), name="ag_journal_scope_index_gte_1"
            ),
            models.UniqueConstraint(fields=["community", "idempotency_key"], name="ag_journal_idempotency_key"),
            models.CheckConstraint(condition=Q(seq__gte=1), name="ag_journal_seq_gte_1"),
            models.CheckConstraint(condition=Q(status__in=CallStatus.values), name="ag_journal_status_known"),
            models.CheckConstraint(condition=Q(kind__in=EntryKind.values), name="ag_journal_kind_known"),
            models.CheckConstraint(condition=Q(tool_name__regex=r"\S"), name="ag_journal_tool_name_not_blank"),
            models.CheckConstraint(condition=_len32("input_hash"), name="ag_journal_input_hash_32_bytes"),
            models.CheckConstraint(
                condition=Q(output_hash__isnull=True) | Q(_len32("output_hash")), name="ag_journal_output_hash_32_bytes"
            ),
            models.CheckConstraint(condition=Q(cost__gte=0), name="ag_journal_cost_gte_0"),
            models.CheckConstraint(
                condition=_iff(Q(status="pending"), Q(finished_at__isnull=True), Q(finished_at__isnull=False)),
                name="ag_journal_finished_iff_answered",
            ),
            models.CheckConstraint(
                condition=Q(compensation_status__isnull=True)
                | (
                    Q(compensation_status__in=CompensationStatus.values, compensation__isnull=False)
                    & (Q(status="succeeded") | Q(status="failed", uncertain=True))
                ),
                name="ag_journal_compensation_of_done_call",
            ),
            models.CheckConstraint(
                condition=_iff(
                    Q(compensation_status__in=["compensated", "compensation_failed"]),
                    Q(compensated_at__isnull=False),
                    Q(compensated_at__isnull=True),
                ),
                name="ag_journal_compensated_iff_at",
            ),
            models.CheckConstraint(
                condition=~Q(kind="approval") | Q(approval__isnull=False), name="ag_journal_approval_entry_has_approval"
            ),
        ]
        triggers = [
            *triggers.write_fence(),
            ag_triggers.status_once(),
            ag_triggers.compensation_forward_only(),
            ag_triggers.journal_identity_immutable(),
        ]

    def __str__(self) -> str:
        return f"#{self.seq} {self.tool_name} ({self.status})"


class RunOutput(CommunityScoped):
    """One chunk of a run's streamed output (issue 29, SPEC 16 "Streamed output"): ``seq`` is
    gapless per run from 1 (a trigger checks it against the run's ``output_chunks``, which the
    same fenced statement bumped); ``generation`` is the run lease generation that emitted it.
    Written only by :func:`buzz_delivery.agents.services.output.emit_output`, never updated; the
    rows go with their run (composite foreign key, ``ON DELETE CASCADE``, migration 0018)."""

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    run = models.ForeignKey(
        AgentRun, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="stream"
    )
    seq = models.IntegerField()
    chunk = models.TextField()
    generation = models.BigIntegerField()
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "buzz_agents_output"
        ordering = ["seq"]
        constraints = [
            models.UniqueConstraint(fields=["community", "run", "seq"], name="ag_output_seq_key"),
            models.CheckConstraint(condition=Q(seq__gte=1), name="ag_output_seq_gte_1"),
            models.CheckConstraint(condition=~Q(chunk=""), name="ag_output_chunk_not_empty"),
        ]
        triggers = [*triggers.write_fence(), wf_triggers.immutable("ag_output_immutable")]

    def __str__(self) -> str:
        return f"#{self.seq} ({len(self.chunk)} characters)"


class IntakeKey(CommunityScoped):
    """The idempotency key of an inbound channel event (SPEC 12 "Start"): one run per
    (community, channel type, provider event id); ``payload_hash`` tells a retry from a conflict."""

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    channel_type = models.CharField(max_length=64)
    provider_event_id = models.CharField(max_length=200)
    payload_hash = models.BinaryField(max_length=32)
    run = models.ForeignKey(
        AgentRun, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="intake_keys"
    )
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "buzz_agents_intake_key"
        constraints = [
            models.UniqueConstraint(
                fields=["community", "channel_type", "provider_event_id"], name="ag_intake_key_unique"
            ),
            models.CheckConstraint(condition=Q(channel_type__regex=r"\S"), name="ag_intake_channel_type_not_blank"),
            models.CheckConstraint(
                condition=Q(provider_event_id__regex=r"\S"), name="ag_intake_provider_event_id_not_blank"
            ),
            models.CheckConstraint(condition=_len32("payload_hash"), name="ag_intake_payload_hash_32_bytes"),
        ]
        triggers = [*triggers.write_fence(), wf_triggers.immutable("ag_intake_key_immutable")]

    def __str__(self) -> str:
        return f"{self.channel_type}:{self.provider_event_id}"


class StepWait(CommunityScoped):
    """The fan-in of a ``send_message`` step with ``await: agent_run`` (SPEC 11/12 "Back to the
    workflow"): created by a trigger when the step parks, counted by triggers when one of its
    deliveries fails or expires (no run will come) and when an agent run started from one of
    them becomes terminal; ``outputs`` keyed by target hex becomes the step's output."""

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    step = models.ForeignKey(
        Step, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="agent_waits"
    )
    run_id = models.UUIDField()
    step_key = models.CharField(max_length=64)
    expected = models.IntegerField()
    done = models.IntegerField(default=0)
    failed = models.IntegerField(default=0)
    tolerate_failures = models.IntegerField(default=0)
    outputs = models.JSONField(default=dict)

    class Meta:
        db_table = "buzz_agents_step_wait"
        constraints = [
            models.UniqueConstraint(fields=["community", "run_id", "step_key"], name="ag_step_wait_step_key"),
            models.UniqueConstraint(fields=["community", "step"], name="ag_step_wait_one_per_step"),
            models.CheckConstraint(
                condition=Q(
                    expected__gte=0, done__gte=0, done__lte=F("expected"), failed__gte=0, failed__lte=F("done")
                ),
                name="ag_step_wait_counters_within_bounds",
            ),
        ]
        triggers = [*triggers.write_fence()]

    def __str__(self) -> str:
        return f"{self.step_key}: {self.done}/{self.expected}"


class AgentPolicy(CommunityScoped):
    """The operator's policy for the agent runs of one community (``agent_pubkey`` NULL) or of
    one agent key in it (issue 27, SPEC 16 "Trust"): caps on a run's budgets (``max_tool_calls``,
    ``max_cost``), attempts, deadline (``max_timeout_seconds``) and lease length
    (``max_lease_seconds``), and ``shadow`` (True forces shadow mode). NULL inherits: the agent's
    row, then the community's, then the ``BUZZ_AGENTS`` settings. A caller (the gateway's accept,
    ``accept_delivery``, ``intake_event``, a claim, a heartbeat) may ask for less, never for more:
    see :mod:`buzz_delivery.agents.services.policy`, the only writer."""

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    agent_pubkey = models.BinaryField(max_length=32, null=True, blank=True)
    max_tool_calls = models.IntegerField(null=True, blank=True)
    max_cost = models.BigIntegerField(null=True, blank=True)
    max_attempts = models.IntegerField(null=True, blank=True)
    max_timeout_seconds = models.IntegerField(null=True, blank=True)
    max_lease_seconds = models.FloatField(null=True, blank=True)
    shadow = models.BooleanField(null=True, blank=True)
    updated_at = models.DateTimeField(db_default=Now())
    updated_by = models.CharField(max_length=200, default="", blank=True)

    class Meta:
        db_table = "buzz_agents_policy"
        verbose_name_plural = "agent policies"
        constraints = [
            models.UniqueConstraint(
                fields=["community", "agent_pubkey"], nulls_distinct=False, name="ag_policy_one_per_scope"
            ),
            models.CheckConstraint(
                condition=Q(agent_pubkey__isnull=True) | Q(_len32("agent_pubkey")), name="ag_policy_agent_32_bytes"
            ),
            models.CheckConstraint(
                condition=Q(max_tool_calls__isnull=True) | Q(max_tool_calls__gte=0, max_tool_calls__lte=100_000),
                name="ag_policy_max_tool_calls_range",
            ),
            models.CheckConstraint(
                condition=Q(max_cost__isnull=True) | Q(max_cost__gte=0, max_cost__lte=2**53 - 1),
                name="ag_policy_max_cost_range",
            ),
            models.CheckConstraint(
                condition=Q(max_attempts__isnull=True) | Q(max_attempts__gte=1, max_attempts__lte=100),
                name="ag_policy_max_attempts_range",
            ),
            models.CheckConstraint(
                condition=Q(max_timeout_seconds__isnull=True)
                | Q(max_timeout_seconds__gte=1, max_timeout_seconds__lte=30 * 86400),
                name="ag_policy_max_timeout_range",
            ),
            models.CheckConstraint(
                condition=Q(max_lease_seconds__isnull=True) | Q(max_lease_seconds__gt=0),
                name="ag_policy_max_lease_positive",
            ),
        ]
        triggers = [*triggers.write_fence()]

    def __str__(self) -> str:
        scope = bytes(self.agent_pubkey).hex()[:16] if self.agent_pubkey is not None else "every agent"
        return f"policy of {scope}"
