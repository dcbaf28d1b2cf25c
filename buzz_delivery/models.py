"""Models of buzz_delivery (SPEC section 3).

Every invariant that matters is enforced by PostgreSQL itself: the CHECK and
UNIQUE constraints and partial indexes below, the tenant-consistent composite
foreign keys and the write-fence function added by migration ``0002``, and the
triggers declared in ``Meta.triggers`` (django-pgtrigger). The Python layer
relies on them; it does not repeat them.

Rows change state only through :mod:`buzz_delivery.services`.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import uuid_utils.compat as uuid_compat
from django.contrib.postgres.functions import RandomUUID
from django.db import models
from django.db.models import F, Func, Q, Value
from django.db.models.functions import Length, Now
from django.db.models.lookups import Exact, LessThanOrEqual

from buzz_delivery import triggers
from buzz_delivery.exceptions import DeliveryWriteRefused

LIFECYCLE_ORDER = ("active", "quiescing", "fenced", "tombstone")


# The predicate of the two age indexes on created_at (every created_at is later: the database
# clock stamps it). The claim query's WHERE does not imply it, so the planner can never walk
# those indexes for a claim; their readers state it. Not ``created_at IS NOT NULL``: PostgreSQL
# 17 and later drop that condition from a query on a NOT NULL column, and the index with it.
CREATED_FLOOR = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
# Priorities (issue 32): a small range, higher first; 0 is the default of every producer.
PRIORITY_MIN = -10
PRIORITY_MAX = 10
# A delivery's singleton key (docs/flow-control.md, "Debounce / singleton"): short, plain text.
SINGLETON_KEY_MAX_CHARS = 64
SINGLETON_KEY_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"

CREATED_FLOOR_SQL = "created_at > '1970-01-01 00:00:00+00'"


def new_uuid7() -> object:
    """A time-ordered UUIDv7 (the ``uuid-utils`` library), as a stdlib ``uuid.UUID``."""
    return uuid_compat.uuid7()


class DeletionState(models.TextChoices):
    """A community's lifecycle state (SPEC section 5). Moves only forward, one step at a time.

    - ``active``: normal; every write allowed.
    - ``quiescing``: writes are fenced; moved on to ``fenced`` by an operator.
    - ``fenced``: writes are fenced; only the purge executor may delete rows.
    - ``tombstone``: permanent end state; the community row is never deleted.
    """

    ACTIVE = "active"
    QUIESCING = "quiescing"
    FENCED = "fenced"
    TOMBSTONE = "tombstone"


class DeliveryStatus(models.TextChoices):
    """Status of a delivery. Who moves a row out of each status, and to where:

    - ``pending``: waiting for a claim. ``claim_delivery`` -> ``claimed``; the reaper ->
      ``expired`` once ``expires_at`` has passed.
    - ``claimed``: leased to one holder. ``finish_delivery`` -> ``finished`` / ``failed`` /
      ``pending`` (retry); the reaper, once the lease lapsed -> ``pending``, ``failed``
      (attempts exhausted) or ``expired``; admin force-fail -> ``failed``.
    - ``finished``, ``failed``, ``expired``: terminal. Only an operator's requeue (admin)
      moves a ``failed``/``expired`` row back to ``pending``.
    """

    PENDING = "pending"
    CLAIMED = "claimed"
    FINISHED = "finished"
    FAILED = "failed"
    EXPIRED = "expired"


TERMINAL_STATUSES = (DeliveryStatus.FINISHED, DeliveryStatus.FAILED, DeliveryStatus.EXPIRED)


class CauseKind(models.TextChoices):
    """What triggered a workflow run (SPEC section 2): exactly one of these."""

    EVENT = "event"
    SCHEDULE = "schedule"
    WEBHOOK = "webhook"


def _len32(field: str) -> Exact:
    return Exact(Length(field), 32)


# Who holds a lease (``claimed_by`` of deliveries, steps and agent runs): at most this long.
HOLDER_MAX_CHARS = 200
# Entries kept in a row's ``history`` (deliveries, steps, agent runs): the append drops the
# oldest past this, so a row that is retried forever stays bounded. Migration 0008's
# ``buzz_delivery_history_push`` and the append-only trigger use the same number.
HISTORY_LIMIT = 50


def history_bounded(field: str) -> Q:
    """CHECK of a ``history`` column: a JSON array of at most :data:`HISTORY_LIMIT` entries."""
    typeof = models.Func(F(field), function="jsonb_typeof", output_field=models.TextField())
    length = models.Func(F(field), function="jsonb_array_length", output_field=models.IntegerField())
    return Q(Exact(typeof, "array"), LessThanOrEqual(length, HISTORY_LIMIT))


class Community(models.Model):
    """The tenant. Rows are never deleted once they leave ``active``."""

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    name = models.CharField(max_length=200, blank=True, default="")
    deletion_state = models.CharField(
        max_length=16, choices=DeletionState.choices, default=DeletionState.ACTIVE, db_default="active"
    )
    # Bumped by the database on every lifecycle move; the purge executor names it.
    fence_generation = models.BigIntegerField(default=0, db_default=0, editable=False)
    state_changed_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "buzz_delivery_community"
        verbose_name_plural = "communities"
        constraints = [
            models.CheckConstraint(
                condition=Q(deletion_state__in=LIFECYCLE_ORDER), name="community_deletion_state_known"
            ),
            models.CheckConstraint(condition=Q(fence_generation__gte=0), name="community_fence_generation_gte_0"),
        ]
        triggers = [triggers.lifecycle_forward_only(), triggers.protect_retired_community()]

    def __str__(self) -> str:
        return self.name or str(self.id)


class CommunityScoped(models.Model):
    """Abstract base of every community-scoped table: carries the write fence trigger."""

    community = models.ForeignKey(Community, on_delete=models.PROTECT, db_index=False)

    class Meta:
        abstract = True


class Workflow(CommunityScoped):
    """A community's workflow definition."""

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    name = models.CharField(max_length=200)
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "buzz_delivery_workflow"
        # The primary key is (id, community_id) in the database (migration 0007, SPEC 15).
        triggers = [*triggers.write_fence()]

    def __str__(self) -> str:
        return self.name


class WorkflowRun(CommunityScoped):
    """One execution of a workflow. Its workflow belongs to the same community (composite FK)."""

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    workflow = models.ForeignKey(
        Workflow, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="runs"
    )
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "buzz_delivery_workflow_run"
        # "Delivery runs": every run deliveries were committed for, started by the engine or not;
        # the engine's state of a run is its "workflow run" (buzz_delivery.workflows, issue 36).
        verbose_name = "delivery run"
        # The primary key is (id, community_id) in the database (migration 0007, SPEC 15).
        constraints = [
            # What a delivery's one key to its run and workflow references (core migration 0036:
            # ``delivery_run_workflow_same_community``); its (community, workflow) prefix serves
            # the cascade from a deleted workflow to its runs, as the plain index it replaced did.
            models.UniqueConstraint(fields=["community", "workflow", "id"], name="workflow_run_workflow_run_key")
        ]
        triggers = [*triggers.write_fence()]

    def __str__(self) -> str:
        return str(self.id)


class Event(CommunityScoped):
    """A community-scoped message event. ``event_id`` and ``pubkey`` are exactly 32 bytes."""

    event_id = models.BinaryField(max_length=32)
    created_at = models.DateTimeField()
    kind = models.IntegerField()
    pubkey = models.BinaryField(max_length=32)
    content = models.TextField(blank=True, default="")
    tags = models.JSONField(default=list, blank=True)

    class Meta:
        db_table = "buzz_delivery_event"
        # The primary key is (id, community_id) in the database (migration 0007, SPEC 15).
        constraints = [
            models.UniqueConstraint(fields=["community", "event_id"], name="event_community_event_id_key"),
            models.CheckConstraint(condition=_len32("event_id"), name="event_event_id_32_bytes"),
            models.CheckConstraint(condition=_len32("pubkey"), name="event_pubkey_32_bytes"),
        ]
        triggers = [*triggers.write_fence()]

    def __str__(self) -> str:
        return bytes(self.event_id).hex()[:16]


class DeliveryColumns(CommunityScoped):
    """One workflow message addressed to one agent (the target), with its lease.

    Identity (the binding, SPEC section 2): community, workflow, run, ``step_id``,
    ``target_pubkey``, ``definition_event_id``, ``message_event_id`` and the cause.
    The lease columns, the policy columns (SPEC section 6) and ``status`` change only
    through :mod:`buzz_delivery.services`.

    The columns of both delivery models (issue 31, stage 1): :class:`DeliveryRecord`, the table
    every writer names, and :class:`WorkflowAgentDelivery`, the view of the old name every reader
    uses (``bench/results/queue-design-plan.md``).
    """

    # UUIDv7 from Python (time-ordered); the database default serves raw-SQL producers.
    id = models.UUIDField(primary_key=True, default=new_uuid7, db_default=RandomUUID(), editable=False)
    workflow = models.ForeignKey(
        Workflow, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="deliveries"
    )
    run = models.ForeignKey(
        WorkflowRun, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="deliveries"
    )
    step_id = models.CharField(max_length=64)
    target_pubkey = models.BinaryField(max_length=32)
    definition_event_id = models.BinaryField(max_length=32)
    # Points at Event(community, event_id) through a composite FK added in migration 0002.
    message_event_id = models.BinaryField(max_length=32)

    cause_kind = models.CharField(max_length=16, choices=CauseKind.choices)
    cause_event_id = models.BinaryField(max_length=32, null=True, blank=True)
    cause_scheduled_for = models.DateTimeField(null=True, blank=True)
    cause_webhook_invocation_id = models.UUIDField(null=True, blank=True)

    status = models.CharField(
        max_length=16, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING, db_default="pending"
    )
    lease_generation = models.BigIntegerField(default=0, db_default=0)
    lease_until = models.DateTimeField(null=True, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())

    # Flow control (issue 32, docs/flow-control.md): higher first, oldest first within it;
    # set at commit (PRIORITY_MIN..PRIORITY_MAX, CHECKed).
    priority = models.SmallIntegerField(default=0, db_default=0)
    # Concurrency limits by key (services/flow.py): the slot this claim holds under each declared
    # limit's key (0..N-1), unique among the claimed deliveries of that key; NULL = no limit.
    slot_community = models.SmallIntegerField(null=True, blank=True, editable=False)
    slot_target = models.SmallIntegerField(null=True, blank=True, editable=False)
    slot_workflow = models.SmallIntegerField(null=True, blank=True, editable=False)
    # Debounce / singleton (services/singleton.py): the producer's key, set at commit and never
    # changed; at most one never-claimed pending delivery per (community, target, key).
    singleton_key = models.CharField(  # noqa: DJ001  (NULL = no key; CHECKed)
        max_length=SINGLETON_KEY_MAX_CHARS, null=True, blank=True, editable=False
    )

    # Policy (SPEC section 6).
    attempt = models.IntegerField(default=0, db_default=0)
    max_attempts = models.IntegerField(null=True, blank=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    failure_code = models.CharField(max_length=64, null=True, blank=True)  # noqa: DJ001  (NULL = none; CHECKed)
    failure_message = models.TextField(null=True, blank=True)  # noqa: DJ001
    execution_trace = models.JSONField(null=True, blank=True)
    trigger_context = models.JSONField(null=True, blank=True)

    # Who holds (or last held) the lease: the claimer's ``holder`` (host:pid:worker, or the
    # gateway's agent key), set by the claim statement and kept after the lease ends.
    claimed_by = models.TextField(null=True, blank=True)  # noqa: DJ001  (NULL = never named)
    # Renewals of the current (or last) lease: the claim sets 0, each renew adds 1.
    renewals = models.IntegerField(default=0, db_default=0)
    # The last HISTORY_LIMIT transitions, oldest first, each appended by the statement that made
    # it (buzz_delivery.services.sql) and never edited (triggers.history_append_only).
    history = models.JSONField(default=list, db_default=Value([], output_field=models.JSONField()), blank=True)
    # Operator requeues of this delivery (services.requeue_delivery adds 1), never reset: which
    # requeue epoch the row is in however much history was dropped since (the tasks backend
    # keys a recorded outcome with it). Not returned by claims (sql.DEFERRED_FIELDS).
    requeues = models.IntegerField(default=0, db_default=0, editable=False)

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"{self.step_id} -> {bytes(self.target_pubkey).hex()[:12]} ({self.status})"

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Refused: deliveries are written only through :mod:`buzz_delivery.services`.

        Saving a claimed instance would write its claim-time snapshot back (an older generation,
        lease and status); the database refuses that too (``delivery_generation_monotonic``)."""
        raise DeliveryWriteRefused(
            f"{type(self).__name__}.save() is refused: use buzz_delivery.services "
            "(commit_deliveries, claim_delivery, finish_delivery...) to change deliveries"
        )

    @property
    def target_hex(self) -> str:
        """``target_pubkey`` as 64 lowercase hex characters."""
        return bytes(self.target_pubkey).hex()

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


# The table behind the view of the old name (issue 31, stage 1, core migration 0034).
DELIVERY_RECORD_TABLE = "buzz_delivery_delivery_record"
DELIVERY_VIEW = "buzz_delivery_delivery"


class DeliveryRecord(DeliveryColumns):
    """The delivery table itself (``buzz_delivery_delivery_record``): its constraints, indexes
    and triggers, its row-level security policies, its foreign keys (``buzz_tasks_result``
    references it), its distribution on Citus. Every statement that writes or locks a delivery
    names it (``buzz_delivery.services.sql.RECORD``); readers use :class:`WorkflowAgentDelivery`."""

    workflow = models.ForeignKey(
        Workflow, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )
    run = models.ForeignKey(
        WorkflowRun, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )

    class Meta:
        db_table = DELIVERY_RECORD_TABLE
        verbose_name = "delivery record"
        verbose_name_plural = "delivery records"
        default_permissions = ()
        constraints = [
            models.UniqueConstraint(
                fields=["community", "run", "step_id", "target_pubkey"], name="delivery_identity_key"
            ),
            models.CheckConstraint(
                condition=(
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
                ),
                name="delivery_cause_exactly_one",
            ),
            models.CheckConstraint(condition=Q(status__in=DeliveryStatus.values), name="delivery_status_known"),
            models.CheckConstraint(
                condition=(
                    Q(status="claimed", lease_until__isnull=False, claimed_at__isnull=False)
                    | (~Q(status="claimed") & Q(lease_until__isnull=True, claimed_at__isnull=True))
                ),
                name="delivery_claimed_iff_lease",
            ),
            models.CheckConstraint(
                condition=(
                    Q(status__in=[s.value for s in TERMINAL_STATUSES], finished_at__isnull=False)
                    | (~Q(status__in=[s.value for s in TERMINAL_STATUSES]) & Q(finished_at__isnull=True))
                ),
                name="delivery_terminal_iff_finished_at",
            ),
            models.CheckConstraint(condition=_len32("target_pubkey"), name="delivery_target_pubkey_32_bytes"),
            models.CheckConstraint(
                condition=_len32("definition_event_id"), name="delivery_definition_event_id_32_bytes"
            ),
            models.CheckConstraint(condition=_len32("message_event_id"), name="delivery_message_event_id_32_bytes"),
            models.CheckConstraint(
                condition=Q(cause_event_id__isnull=True) | Q(_len32("cause_event_id")),
                name="delivery_cause_event_id_32_bytes",
            ),
            models.CheckConstraint(condition=Q(step_id__regex=r"\S"), name="delivery_step_id_not_blank"),
            models.CheckConstraint(condition=Q(lease_generation__gte=0), name="delivery_lease_generation_gte_0"),
            models.CheckConstraint(condition=Q(attempt__gte=0), name="delivery_attempt_gte_0"),
            models.CheckConstraint(
                condition=Q(max_attempts__isnull=True) | Q(max_attempts__gte=1, attempt__lte=F("max_attempts")),
                name="delivery_attempt_within_max",
            ),
            models.CheckConstraint(
                condition=~Q(status="claimed") | Q(attempt__gte=1), name="delivery_claimed_has_attempt"
            ),
            models.CheckConstraint(
                condition=Q(failure_code__isnull=True) | Q(status__in=["failed", "expired"]),
                name="delivery_failure_code_only_when_failed",
            ),
            models.CheckConstraint(
                condition=Q(claimed_by__isnull=True) | Q(LessThanOrEqual(Length("claimed_by"), HOLDER_MAX_CHARS)),
                name="delivery_claimed_by_length",
            ),
            models.CheckConstraint(condition=Q(renewals__gte=0), name="delivery_renewals_gte_0"),
            models.CheckConstraint(condition=history_bounded("history"), name="delivery_history_bounded"),
            models.CheckConstraint(
                condition=Q(priority__gte=PRIORITY_MIN, priority__lte=PRIORITY_MAX), name="delivery_priority_range"
            ),
            *(
                models.CheckConstraint(
                    condition=Q(**{f"{column}__isnull": True}) | Q(**{f"{column}__gte": 0, f"{column}__lt": 1000}),
                    name=f"delivery_{column}_range",
                )
                for column in ("slot_community", "slot_target", "slot_workflow")
            ),
            models.CheckConstraint(
                condition=Q(singleton_key__isnull=True) | Q(singleton_key__regex=SINGLETON_KEY_PATTERN),
                name="delivery_singleton_key_format",
            ),
        ]
        indexes = [
            # The admin's failure-code filter, newest first; only failed and expired rows carry a code.
            models.Index(
                fields=["failure_code", "created_at"],
                condition=Q(failure_code__isnull=False),
                name="delivery_failure_code_idx",
            ),
            # Pruner: a community's rows by age of creation, which bounds terminal rows by age (a
            # terminal's finished_at never precedes its created_at). No index names a column the
            # terminal UPDATE writes (status, finished_at, lease, attempt, holder, history...; the
            # failure code's excepted: only failures pay), so that UPDATE is HOT (core migration
            # 0039, :data:`DELIVERY_RECORD_FILLFACTOR`).
            models.Index(fields=["community", "created_at"], name="delivery_community_created_idx"),
            # The cascade from a deleted message event. A deleted workflow or run reaches its
            # deliveries through their one key to the run (community, workflow, run: core
            # migration 0036), which the identity key's (community, run) prefix serves: no index of
            # their own (each index is one more entry on every claim and settle, none of which is
            # a HOT update).
            models.Index(fields=["community", "message_event_id"], name="delivery_message_event_idx"),
            # The admin lists by age. Its predicate is :data:`CREATED_FLOOR` (every created_at is
            # later), which the claim query's WHERE does not imply: as a plain
            # index on created_at the planner, with statistics taken while most rows were still
            # pending, walked it for the claim (past every settled row, 6 of a claim's 9 ms in a
            # worker's drain) instead of the polling index. The admin's queries add that condition
            # (``DeliveryAdmin.get_queryset``).
            models.Index(fields=["created_at"], condition=Q(created_at__gt=CREATED_FLOOR), name="delivery_created_idx"),
        ]
        # The primary key is (id, community_id) in the database (migration 0007, SPEC 15).
        triggers = [
            *triggers.write_fence(),
            triggers.delivery_binding_immutable(),
            triggers.delivery_generation_monotonic(),
            # The terminal writes the queue row's history plus its entry over the record's copy,
            # which it extends (core 0037); every other statement appends one entry.
            triggers.history_append_only("delivery", terminal_extends=True),
        ]


# Room left free in each page of the record (``fillfactor``, core migration 0039): its terminal
# UPDATE writes the new version on the same page (HOT: no index names what it writes), which
# carries the history, about twice the committed row (bench/results/hot-record.md).
DELIVERY_RECORD_FILLFACTOR = 30

DELIVERY_QUEUE_TABLE = "buzz_delivery_delivery_queue"
# The statuses a queue row may hold: a live delivery (the terminal deletes the row).
LIVE_STATUSES = (DeliveryStatus.PENDING, DeliveryStatus.CLAIMED)
# Room left free in each page of the queue (``fillfactor``, core migration 0037): a claim, a
# renew, a retry rewrite the row on its own page (HOT: no index names what they write).
DELIVERY_QUEUE_FILLFACTOR = 30


class DeliveryQueue(CommunityScoped):
    """The live state of a delivery (issue 31, stage 2; ``bench/results/queue-design-plan.md``):
    one row per pending or claimed delivery, ``buzz_delivery_delivery_queue``, deleted at the
    terminal. Keyed as its record (``(id, community_id)`` in the database, a foreign key to the
    record's primary key, ON DELETE CASCADE: core migration 0037). Its indexes never name a column
    a claim, a renew or a retry writes (status, lease, attempt, history...), so those are HOT
    updates; the slot keys and the singleton key are partial on their own column being set (every
    move out of claimed clears the slots, the claim clears the singleton key). While a delivery is
    live, its record's lease, policy and history columns are not maintained: this row holds the
    truth, and the view (:class:`WorkflowAgentDelivery`) reads it."""

    id = models.UUIDField(primary_key=True, editable=False)
    target_pubkey = models.BinaryField(max_length=32)
    workflow = models.ForeignKey(
        Workflow, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )
    priority = models.SmallIntegerField(default=0, db_default=0)
    created_at = models.DateTimeField()
    # Copied from the record at commit, never changed.
    max_attempts = models.IntegerField(null=True, blank=True)

    status = models.CharField(
        max_length=16, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING, db_default="pending"
    )
    lease_generation = models.BigIntegerField(default=0, db_default=0)
    lease_until = models.DateTimeField(null=True, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    claimed_by = models.TextField(null=True, blank=True)  # noqa: DJ001  (NULL = never named)
    renewals = models.IntegerField(default=0, db_default=0)
    attempt = models.IntegerField(default=0, db_default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    history = models.JSONField(default=list, db_default=Value([], output_field=models.JSONField()), blank=True)
    slot_community = models.SmallIntegerField(null=True, blank=True, editable=False)
    slot_target = models.SmallIntegerField(null=True, blank=True, editable=False)
    slot_workflow = models.SmallIntegerField(null=True, blank=True, editable=False)
    # The pending holder's singleton key: set at commit for a singleton delivery, set NULL by the
    # claim (the record keeps the immutable key). At most one per (community, target, key).
    singleton_key = models.CharField(  # noqa: DJ001  (NULL = no key; CHECKed)
        max_length=SINGLETON_KEY_MAX_CHARS, null=True, blank=True, editable=False
    )

    class Meta:
        db_table = DELIVERY_QUEUE_TABLE
        verbose_name = "delivery queue row"
        verbose_name_plural = "delivery queue"
        default_permissions = ()
        # The primary key is (id, community_id) in the database (core migration 0037, SPEC 15).
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=[s.value for s in LIVE_STATUSES]), name="delivery_queue_status_live"
            ),
            models.CheckConstraint(
                condition=(
                    Q(status="claimed", lease_until__isnull=False, claimed_at__isnull=False)
                    | (~Q(status="claimed") & Q(lease_until__isnull=True, claimed_at__isnull=True))
                ),
                name="delivery_queue_claimed_iff_lease",
            ),
            models.CheckConstraint(condition=_len32("target_pubkey"), name="delivery_queue_target_pubkey_32_bytes"),
            models.CheckConstraint(condition=Q(lease_generation__gte=0), name="delivery_queue_lease_generation_gte_0"),
            models.CheckConstraint(condition=Q(attempt__gte=0), name="delivery_queue_attempt_gte_0"),
            models.CheckConstraint(
                condition=Q(max_attempts__isnull=True) | Q(max_attempts__gte=1, attempt__lte=F("max_attempts")),
                name="delivery_queue_attempt_within_max",
            ),
            models.CheckConstraint(
                condition=~Q(status="claimed") | Q(attempt__gte=1), name="delivery_queue_claimed_has_attempt"
            ),
            models.CheckConstraint(
                condition=Q(claimed_by__isnull=True) | Q(LessThanOrEqual(Length("claimed_by"), HOLDER_MAX_CHARS)),
                name="delivery_queue_claimed_by_length",
            ),
            models.CheckConstraint(condition=Q(renewals__gte=0), name="delivery_queue_renewals_gte_0"),
            models.CheckConstraint(condition=history_bounded("history"), name="delivery_queue_history_bounded"),
            models.CheckConstraint(
                condition=Q(priority__gte=PRIORITY_MIN, priority__lte=PRIORITY_MAX),
                name="delivery_queue_priority_range",
            ),
            *(
                models.CheckConstraint(
                    condition=Q(**{f"{column}__isnull": True}) | Q(**{f"{column}__gte": 0, f"{column}__lt": 1000}),
                    name=f"delivery_queue_{column}_range",
                )
                for column in ("slot_community", "slot_target", "slot_workflow")
            ),
            models.CheckConstraint(
                condition=Q(singleton_key__isnull=True) | Q(singleton_key__regex=SINGLETON_KEY_PATTERN),
                name="delivery_queue_singleton_key_format",
            ),
            # One pending holder per singleton key (services/singleton.py): the commit's INSERT
            # sets the key, the claim sets it NULL, so the commit's ON CONFLICT is its one arbiter.
            models.UniqueConstraint(
                fields=["community", "target_pubkey", "singleton_key"],
                condition=Q(singleton_key__isnull=False),
                name="delivery_queue_singleton_key",
            ),
            # At most N claimed at once per key: N slots, none held twice (services/flow.py). Not
            # partial on the status: every move out of claimed clears the slots.
            *(
                models.UniqueConstraint(
                    fields=["community", *key, column],
                    condition=Q(**{f"{column}__isnull": False}),
                    name=f"delivery_queue_{column}_key",
                )
                for column, key in (
                    ("slot_community", ()),
                    ("slot_target", ("target_pubkey",)),
                    ("slot_workflow", ("workflow",)),
                )
            ),
        ]
        indexes = [
            # Polling: the claim walks this in (priority DESC, created_at, id) order; no predicate
            # (a status in it would make the claim a non-HOT update).
            models.Index(
                fields=["community", "target_pubkey", "-priority", "created_at", "id"], name="delivery_queue_poll_idx"
            ),
            # The admin's and the dashboard's lists of live rows by age. Partial on
            # :data:`CREATED_FLOOR` (true of every row) so only a query that names the floor can
            # use it: without a predicate, a generic plan with stale statistics probed it for a
            # claim's ``id`` instead of the primary key (test_claim_plan_stale_stats).
            models.Index(
                fields=["created_at", "id"],
                condition=Q(created_at__gt=CREATED_FLOOR),
                name="delivery_queue_created_idx",
            ),
            # Reaper TTL pass: live rows that carry a deadline (the claim never changes expires_at).
            models.Index(
                fields=["community", "expires_at"],
                condition=Q(expires_at__isnull=False),
                name="delivery_queue_expiry_idx",
            ),
        ]
        triggers = [
            *triggers.write_fence(),
            # Its key and the target and workflow a claim selects by stay its record's.
            triggers.delivery_binding_immutable("delivery_queue_binding_immutable", triggers.IMMUTABLE_QUEUE_COLUMNS),
            triggers.delivery_generation_monotonic(),
            triggers.history_append_only("delivery_queue"),
        ]

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Refused, as a delivery's: the queue is written only through :mod:`buzz_delivery.services`."""
        raise DeliveryWriteRefused(
            f"{type(self).__name__}.save() is refused: use buzz_delivery.services to change deliveries"
        )


class WorkflowAgentDelivery(DeliveryColumns):
    """A delivery as every reader sees it: ``buzz_delivery_delivery``, a view of
    :class:`DeliveryRecord` LEFT JOIN :class:`DeliveryQueue` (the live columns from the queue row
    while there is one; ``security_invoker``: the reader's row-level security applies to both),
    unmanaged. The admin, the gateway, the tasks backend and the tests read it; nothing writes
    through it (stage 3 would join the outcome into it)."""

    class Meta:
        managed = False
        db_table = DELIVERY_VIEW
        verbose_name = "delivery"
        verbose_name_plural = "deliveries"
        # Operator actions in the admin (SPEC section 8), each gated by its own permission.
        permissions = [
            ("requeue_delivery", "Can requeue failed or expired deliveries"),
            ("force_fail_delivery", "Can force-fail claimed deliveries"),
            ("reap_deliveries", "Can reap expired leases now"),
        ]


RATE_KEY_MAX_CHARS = 64


class RateLimit(CommunityScoped):
    """The current window of one rate limit key in one community (issue 32,
    :mod:`buzz_delivery.services.ratelimits`): ``used`` units taken since ``window_start`` (a
    fixed window of the key's declared period, aligned on the database clock). The limit and the
    period are the operator's settings (``BUZZ_DELIVERY["RATE_LIMITS"]``), never read from here.
    Written only by the one take statement of the services; the primary key is
    (community_id, id) in the database (migration 0025, SPEC 15)."""

    id = models.UUIDField(primary_key=True, default=new_uuid7, editable=False)
    key = models.CharField(max_length=RATE_KEY_MAX_CHARS)
    window_start = models.DateTimeField()
    used = models.BigIntegerField(default=0)
    # Whether the last take of this row was granted: what the take statement returns.
    granted = models.BooleanField(default=True)
    taken_at = models.DateTimeField()

    class Meta:
        db_table = "buzz_delivery_rate_limit"
        constraints = [
            models.UniqueConstraint(fields=["community", "key"], name="rate_limit_one_per_key"),
            models.CheckConstraint(condition=Q(used__gte=0), name="rate_limit_used_not_negative"),
            models.CheckConstraint(condition=Q(key__regex=r"^[A-Za-z0-9_.:-]{1,64}$"), name="rate_limit_key_format"),
        ]
        triggers = [*triggers.write_fence()]

    def __str__(self) -> str:
        return f"{self.key} {self.used}"


SETTLE_TALLY_TABLE = "buzz_delivery_settle_tally"


class SettleTally(CommunityScoped):
    """How many deliveries one statement settled to one terminal status in one community, and when
    (database clock): ``buzz_delivery_settle_tally``, written by the record's AFTER UPDATE statement
    trigger (core migration 0039), one row per statement and (community, status), never per
    delivery. What the settle-rate metric and the dashboard's settled-per-minute chart read, since
    no index of the record may name its terminal columns (its terminal UPDATE is HOT). Insert-only;
    the pruner deletes rows past :data:`SETTLE_TALLY_KEEP`. Its primary key is ``(community_id, at,
    id)`` in the database (the readers' probe, SPEC 15). The community is not a database foreign
    key: every settle would take a KEY SHARE lock on the community's row."""

    community = models.ForeignKey(
        Community, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )
    id = models.UUIDField(primary_key=True, db_default=RandomUUID(), editable=False)
    at = models.DateTimeField()
    status = models.CharField(max_length=16, choices=[(s.value, s.label) for s in TERMINAL_STATUSES])
    n = models.IntegerField()

    class Meta:
        db_table = SETTLE_TALLY_TABLE
        verbose_name = "settle tally"
        verbose_name_plural = "settle tallies"
        default_permissions = ()
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=[s.value for s in TERMINAL_STATUSES]), name="settle_tally_status_terminal"
            ),
            models.CheckConstraint(condition=Q(n__gt=0), name="settle_tally_n_positive"),
        ]
        triggers = [*triggers.write_fence()]

    def __str__(self) -> str:
        return f"{self.status} {self.n} at {self.at}"


# How long the pruner keeps tally rows: the longest window a reader counts (the dashboard's hour)
# and a margin.
SETTLE_TALLY_KEEP = dt.timedelta(hours=1, minutes=10)


class MaintenanceLease(models.Model):
    """A named, time-limited lease that keeps two maintenance runs (``reap_deliveries``,
    ``prune_deliveries``) from overlapping (SPEC section 8).

    One row per job name. A run takes it with a single ``INSERT ... ON CONFLICT DO UPDATE
    ... WHERE lease_until < now()`` (database clock), renews it between batches and deletes it
    when done; a crashed run's lease simply lapses. No session state is held between
    transactions, so it works behind a transaction-pooling connection pooler. Not
    community-scoped. Written only by :mod:`buzz_delivery.services.runlock`.
    """

    name = models.CharField(max_length=100, primary_key=True)
    holder = models.TextField()
    lease_until = models.DateTimeField()
    acquired_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "buzz_delivery_maintenance_lease"

    def __str__(self) -> str:
        return f"{self.name} held by {self.holder}"


class WorkerKind(models.TextChoices):
    """What a registered worker process runs."""

    DELIVERY = "delivery", "delivery worker"
    WORKFLOW = "workflow", "workflow worker"
    AGENT = "agent", "agent worker"


class WorkerRegistration(models.Model):
    """A live worker process (issue 17): who it is and when it last said so.

    Each ``run_delivery_worker``, ``run_workflow_worker`` and ``run_agent_worker`` process
    inserts its row at start, refreshes ``last_heartbeat`` (database clock) every few seconds
    and deletes the row on a clean exit; a killed process leaves its row behind, shown as stale
    once its heartbeat is old and pruned by the reaper later. Not community-scoped (one row per
    process, whatever it works on; ``detail`` says what): a local table on a Citus coordinator,
    like :class:`MaintenanceLease`. Written only by :mod:`buzz_delivery.services.workers`.
    """

    id = models.UUIDField(primary_key=True, editable=False)
    kind = models.CharField(max_length=16, choices=WorkerKind.choices)
    host = models.CharField(max_length=255)
    pid = models.IntegerField()
    name = models.CharField(max_length=200)
    detail = models.TextField(blank=True, default="")
    started_at = models.DateTimeField(db_default=Now())
    last_heartbeat = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "buzz_delivery_worker"
        verbose_name = "live worker"
        verbose_name_plural = "live workers"
        constraints = [
            models.CheckConstraint(condition=Q(kind__in=WorkerKind.values), name="worker_kind_known"),
            models.CheckConstraint(condition=Q(pid__gt=0), name="worker_pid_positive"),
        ]
        indexes = [models.Index(fields=["last_heartbeat"], name="worker_heartbeat_idx")]

    def __str__(self) -> str:
        return f"{self.name} on {self.host} (pid {self.pid})"


class MaintenanceRun(models.Model):
    """What the maintenance runs of one job did (issue 17): how many ran and how the last one
    ended, for the metrics endpoint (``buzz_maintenance_runs_total`` and friends).

    One row per job name (``reap_deliveries``, ``prune_deliveries``, the engine's and agents'
    reapers), upserted by every pass of the command (dry runs excepted) when it prints its
    summary; ``last_finished_at`` from the database clock. ``totals`` (migration 0012): the
    cumulative sum, over every recorded pass, of each count of the summary (``{"reclaimed":
    12, "exhausted": 1, ...}``), added by the same upsert that counts the pass; the reapers'
    ``reclaimed`` and ``exhausted`` are the lease losses the database saw (exported as
    ``buzz_leases_reclaimed_total``). Not community-scoped (like :class:`MaintenanceLease`).
    Written only by :mod:`buzz_delivery.services.workers`.
    """

    name = models.CharField(max_length=100, primary_key=True)
    runs = models.BigIntegerField(default=0)
    last_outcome = models.CharField(max_length=32)
    last_summary = models.JSONField(default=dict)
    last_finished_at = models.DateTimeField(db_default=Now())
    totals = models.JSONField(default=dict, db_default=Value({}, output_field=models.JSONField()))

    class Meta:
        db_table = "buzz_delivery_maintenance_run"
        constraints = [
            models.CheckConstraint(condition=Q(runs__gte=1), name="maintenance_run_runs_gte_1"),
            models.CheckConstraint(
                condition=Q(
                    Exact(Func(F("totals"), function="jsonb_typeof", output_field=models.TextField()), "object")
                ),
                name="maintenance_run_totals_object",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name}: {self.runs} runs, last {self.last_outcome}"
