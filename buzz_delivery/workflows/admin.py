"""Admin of the workflow engine (SPEC section 11): definitions, runs, steps and approvals,
read-only; the run page draws the DAG (server-side SVG) with a "why not running" line per step;
fenced actions (cancel run, restart run, retry a failed step, approve/reject) each behind its
own permission and each through :mod:`buzz_delivery.workflows.services`; a lost race is a
message, never a 500."""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.apps import apps
from django.contrib import admin
from django.db import connection
from django.db.models import Case, DateTimeField, Func, OuterRef, Q, QuerySet, Subquery, UUIDField, Value, When
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from buzz_delivery.admin import display
from buzz_delivery.admin.base import ReadOnlyAdmin, report, too_many
from buzz_delivery.admin.changelist import SnapshotFreeChangeList
from buzz_delivery.admin.concurrency import ConcurrencyPageMixin, SlotTable
from buzz_delivery.admin.search import parse_uuid
from buzz_delivery.exceptions import BuzzDeliveryError
from buzz_delivery.services import AlreadyTerminal, flow
from buzz_delivery.workflows import dag, search
from buzz_delivery.workflows.models import Approval, DefinitionVersion, Run, Schedule, SentEvent, Step
from buzz_delivery.workflows.services import (
    AlreadyDecided,
    Decided,
    cancel_run,
    decide_approval,
    restart_run,
    send_event,
)
from buzz_delivery.workflows.states import RUN_TERMINAL


def _db_now() -> Any:
    with connection.cursor() as cursor:
        cursor.execute("SELECT buzz_delivery_now()")
        return cursor.fetchone()[0]


# Seconds between reloads of a live run's page (ReadOnlyAdmin.refresh_seconds).
LIVE_REFRESH_SECONDS = 5


def _link(view: str, pk: Any, text: str) -> str:
    return format_html('<a href="{}">{}</a>', reverse(f"admin:{view}", args=[pk]), text)


def run_link(run_id: Any) -> str:
    """The engine run's page, its id shortened (a list column: no query)."""
    if run_id is None:
        return display.EMPTY
    return _link("buzz_workflows_run_change", run_id, f"run …{str(run_id)[-8:]}")


def _run_q(value: Any, prefix: str = "") -> Q:
    """Rows of the engine run ``value``, its community looked up first (by the run's id index),
    so the probe is served by a key that leads with community_id."""
    community_id = Run.objects.filter(pk=value).values_list("community_id", flat=True).first()
    if community_id is None:
        return Q(pk__in=[])
    return Q(community_id=community_id, **{f"{prefix}run_id": value})


def _run_state_of_row() -> Subquery:
    """The state of the row's engine run, looked up on ``(community_id, run_id)``: on Citus a
    subquery inside one shard group, where Django's join on ``run_id`` alone would need
    repartitioning (SPEC section 15); one primary-key probe per listed row on PostgreSQL."""
    runs = Run.objects.filter(community_id=OuterRef("community_id"), run_id=OuterRef("run_id"))
    return Subquery(runs.values("state")[:1])


class _WorkflowNameColumn:
    """A ``workflow`` list column read from an annotation on ``(community_id, workflow_id)``
    (:func:`buzz_delivery.admin.display.workflow_name_of_row`) instead of a join on the
    workflow's id alone, which Citus must repartition (SPEC section 15); the same text."""

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).annotate(workflow_name=display.workflow_name_of_row())  # type: ignore[misc]

    @admin.display(description="workflow", ordering="workflow_name")
    def workflow_name(self, obj: Any) -> str:
        return getattr(obj, "workflow_name", None) or str(obj.workflow_id)


def _perm(codename: str):  # type: ignore[no-untyped-def]
    def has(self: admin.ModelAdmin, request: HttpRequest) -> bool:
        return request.user.has_perm(f"buzz_workflows.{codename}")

    return has


@admin.register(DefinitionVersion)
class DefinitionVersionAdmin(_WorkflowNameColumn, ReadOnlyAdmin):
    list_display = ("workflow_name", "version", "community", "hash_hex", "created_at")
    list_select_related = ("community",)
    readonly_fields = ("workflow", "version", "hash_hex", "definition_event_hex", "content", "created_at")
    exclude = ("content_hash", "definition_event_id")

    @admin.display(description="content hash")
    def hash_hex(self, obj: DefinitionVersion) -> str:
        return bytes(obj.content_hash).hex()[:16]

    @admin.display(description="definition event id")
    def definition_event_hex(self, obj: DefinitionVersion) -> str:
        return bytes(obj.definition_event_id).hex()


@admin.register(Run)
class RunAdmin(_WorkflowNameColumn, ReadOnlyAdmin):
    list_display = ("short_id", "workflow_name", "community", "state", "progress", "finished_at")
    list_display_links = ("short_id",)
    list_filter = ("state",)
    list_select_related = ("community",)  # the workflow's name: an annotation (_WorkflowNameColumn)
    # The search box: tags, input fields, id prefixes, state, workflow (buzz_delivery.workflows.search).
    search_fields = ("=tags",)
    search_help_text = search.HELP
    readonly_fields = (
        "run",
        "community",
        "workflow",
        "definition",
        "state",
        "tags",
        "failure_code",
        "failure_message",
        "input",
        "output",
        "parent_run",
        "parent_step_key",
        "restart_of",
        "depth",
        "created_at",
        "finished_at",
        "dag",
        "step_table",
        "approvals",
        "agent_runs",
    )
    fields = readonly_fields
    actions = ["cancel_runs", "restart_runs"]

    has_cancel_engine_run_permission = _perm("cancel_engine_run")
    has_restart_engine_run_permission = _perm("restart_engine_run")

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Run], search_term: str) -> Any:
        return queryset.filter(search.run_search(search_term)), False

    @admin.display(description="workflow run / created", ordering="run")
    def short_id(self, obj: Run) -> str:
        shown = " ".join(tag[:30] for tag in obj.tags[:3]) + (" ..." if len(obj.tags) > 3 else "")
        tags = format_html('<br><span class="bd-quiet">{}</span>', shown) if obj.tags else ""
        return format_html(
            '{}<br><span class="bd-quiet">{}</span>{}',
            display.short_uuid(obj.pk, 8),
            display.timestamp(obj.created_at),
            tags,
        )

    @admin.display(description="steps left")
    def progress(self, obj: Run) -> str:
        """Steps left of the run's steps and, for a sub-workflow's run, its nesting depth."""
        depth = format_html('<br><span class="bd-quiet">depth {}</span>', obj.depth) if obj.depth else ""
        return format_html("{} of {}{}", obj.steps_left, obj.steps_total, depth)

    def refresh_seconds(self, request: HttpRequest, object_id: str) -> int | None:
        """A running run's page reloads itself every few seconds; a terminal one's does not."""
        pk = parse_uuid(object_id)
        state = Run.objects.filter(pk=pk).values_list("state", flat=True).first() if pk is not None else None
        return LIVE_REFRESH_SECONDS if state is not None and state not in RUN_TERMINAL else None

    @admin.display(description="approvals")
    def approvals(self, obj: Run) -> str:
        """Each approval a step of this run asked for, linked (the queue decides them)."""
        queryset = Approval.objects.filter(community_id=obj.community_id, run_id=obj.pk)
        rows = list(queryset.only("id", "state", "step_id").order_by("requested_at")[:50])
        if not rows:
            return display.EMPTY
        # The steps' keys on (community_id, run_id), not joined on the step's id alone (SPEC 15).
        keys = dict(Step.objects.filter(community_id=obj.community_id, run_id=obj.pk).values_list("id", "key"))
        return format_html_join(
            ", ",
            "{} ({})",
            ((_link("buzz_workflows_approval_change", a.pk,
                    f"step {keys[a.step_id]}" if a.step_id in keys else "approval"), a.state)
             for a in rows),
        )  # fmt: skip

    @admin.display(description="agent runs")
    def agent_runs(self, obj: Run) -> str:
        """The agent runs its send_message steps' deliveries started (agents app installed)."""
        if not apps.is_installed("buzz_delivery.agents"):
            return display.EMPTY
        url = reverse("admin:buzz_agents_agentrun_changelist")
        return format_html('<a href="{}?q={}">Agent runs started by this run</a>', url, obj.pk)

    def _steps(self, obj: Run) -> list[Step]:
        # The drawing and the table read no JSON field: none is loaded (a step's stored output,
        # however deep, cannot fail the run's page; issue 27).
        steps = Step.objects.filter(community_id=obj.community_id, run_id=obj.pk).order_by("position")
        return list(steps.defer("when_cond", "output", "history"))

    @admin.display(description="DAG")
    def dag(self, obj: Run) -> str:
        return dag.dag_svg(self._steps(obj), _db_now())

    @admin.display(description="steps")
    def step_table(self, obj: Run) -> str:
        return dag.steps_table(self._steps(obj), _db_now())

    @admin.action(description="Cancel selected runs", permissions=["cancel_engine_run"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        rows = list(queryset[:1001])
        if too_many(self, request, rows, "canceled"):
            return
        done, skipped = [], Counter[str]()
        for run in rows:
            try:
                outcome = cancel_run(run.community_id, run.pk)
            except BuzzDeliveryError as exc:
                skipped[type(exc).__name__] += 1
                continue
            if isinstance(outcome, AlreadyTerminal):
                skipped[f"already {outcome.status}"] += 1
            else:
                done.append(run)
        report(self, request, verb="canceled", done=done, skipped=skipped, change_message="cancel_run")

    @admin.action(description="Restart selected runs from failure", permissions=["restart_engine_run"])
    def restart_runs(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        rows = list(queryset[:1001])
        if too_many(self, request, rows, "restarted"):
            return
        done, skipped = [], Counter[str]()
        for run in rows:
            if run.state not in RUN_TERMINAL:
                skipped["still running"] += 1
                continue
            try:
                restart_run(run.community_id, run.pk, from_failure=True)
            except BuzzDeliveryError as exc:
                skipped[type(exc).__name__] += 1
                continue
            done.append(run)
        report(self, request, verb="restarted", done=done, skipped=skipped, change_message="restart_run")


# The workflow steps' concurrency limits page (``STEP_CONCURRENCY_LIMITS``): the running steps
# hold the slots (workflows migration 0022's partial UNIQUE indexes; a running step records its
# run's workflow in ``slot_workflow_id``), the ready steps of a key wait (a ready step's workflow
# is its run's, read through the run in the same community).
STEP_SLOTS = SlotTable(
    setting=flow.STEP_SETTING,
    declared=flow.declared_step_limits,
    table=Step._meta.db_table,
    held="d.state = 'running'",
    kinds={
        "community": ("slot_community", ()),
        "workflow": ("slot_workflow", ("slot_workflow_id",)),
        "step": ("slot_step", ("slot_workflow_id", "key")),
    },
    pending="d.state = 'ready'",
    join=f"JOIN {Run._meta.db_table} AS w ON w.community_id = d.community_id AND w.run_id = d.run_id",
    waiter_keys={"community": (), "workflow": ("w.workflow_id",), "step": ("w.workflow_id", "d.key")},
    key_types={"community": (), "workflow": ("uuid",), "step": ("uuid", "text")},
    noun="workflow steps",
    held_word="running",
    waiting="ready steps",
    freed_by="settled, parked, cancelled or reaped",
)


@admin.register(Step)
class StepAdmin(ConcurrencyPageMixin, ReadOnlyAdmin):
    concurrency_source = STEP_SLOTS
    change_list_template = "admin/buzz_delivery/bd_concurrency_change_list.html"
    list_display = ("key", "run_column", "community", "kind", "state", "holder", "attempts", "why", "finished_at")
    list_filter = ("state", "kind")
    list_select_related = ("community",)  # the run column needs no join (run_link)
    readonly_fields = (
        *(f.name for f in Step._meta.fields if f.name != "history"),
        "approvals",
        "history_table",
    )
    exclude = ("history",)  # shown as a table (history_table)
    search_fields = ("key",)
    search_help_text = "Step id or run id (UUID), or a step key prefix."
    actions = ["retry_failed_steps", "send_awaited_events"]

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type:
        return SnapshotFreeChangeList  # the list does not load the history

    def get_queryset(self, request: HttpRequest) -> QuerySet[Step]:
        # The database clock, read by the list's own query: "why not running" costs no
        # statement per row.
        return (
            super()
            .get_queryset(request)
            .annotate(db_now=Func(function="buzz_delivery_now", output_field=DateTimeField()))
        )

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
        """A UUID: the step with that id or the steps of that run; other text: a key prefix."""
        term = search_term.strip()
        if not term:
            return queryset, False
        value = parse_uuid(term)
        if value is None:
            return queryset.filter(key__startswith=term), False
        return queryset.filter(Q(pk=value) | _run_q(value)), False

    @admin.display(description="run", ordering="run")
    def run_column(self, obj: Step) -> str:
        return run_link(obj.run_id)

    @admin.display(description="holder")
    def holder(self, obj: Step) -> str:
        return display.holder(obj.claimed_by)

    @admin.display(description="history")
    def history_table(self, obj: Step) -> str:
        return display.history_table(obj.history)

    @admin.display(description="approvals")
    def approvals(self, obj: Step) -> str:
        """The approvals this step asked for, one per attempt (its lease generation), linked."""
        rows = Approval.objects.filter(community_id=obj.community_id, step_id=obj.pk).order_by("requested_at")
        rows = rows.only("id", "state", "step_generation")[:50]
        if not rows:
            return display.EMPTY
        return format_html_join(
            ", ",
            "{} ({})",
            ((_link("buzz_workflows_approval_change", a.pk, f"attempt {a.step_generation}"), a.state) for a in rows),
        )

    has_retry_engine_step_permission = _perm("retry_engine_step")

    @admin.display(description="why not running")
    def why(self, obj: Step) -> str:
        return dag.why_not_running(obj, getattr(obj, "db_now", None) or _db_now())

    has_send_workflow_event_permission = _perm("send_workflow_event")

    @admin.action(
        description="Send the event these waiting steps wait for (payload: who sent it)",
        permissions=["send_workflow_event"],
    )
    def send_awaited_events(self, request: HttpRequest, queryset: QuerySet[Step]) -> None:
        """``send_event`` for the (name, key) each selected waiting ``wait_event`` step waits
        for, once per (community, name, key): it resumes every step waiting for it."""
        rows = list(queryset[:1001])
        if too_many(self, request, rows, "sent"):
            return
        done, skipped, sent = [], Counter[str](), set()
        who = request.user.get_username() or f"user {request.user.pk}"
        for step in rows:
            if step.state != "waiting" or step.event_name is None or step.event_key is None:
                skipped[f"{step.state} {step.kind}, not waiting for an event"] += 1
                continue
            event = (step.community_id, step.event_name, step.event_key)
            if event not in sent:
                try:
                    send_event(step.community_id, step.event_name, step.event_key, {"sent_by": who, "via": "admin"})
                except BuzzDeliveryError as exc:
                    skipped[type(exc).__name__] += 1
                    continue
                sent.add(event)
            done.append(step)
        report(self, request, verb="sent the event of", done=done, skipped=skipped, change_message="send_event")

    @admin.action(description="Retry failed steps (restart their run from failure)", permissions=["retry_engine_step"])
    def retry_failed_steps(self, request: HttpRequest, queryset: QuerySet[Step]) -> None:
        rows = list(queryset.annotate(run_state=_run_state_of_row())[:1001])
        if too_many(self, request, rows, "retried"):
            return
        done, skipped, seen = [], Counter[str](), set()
        for step in rows:
            if step.state != "failed":
                skipped[f"{step.state}, not failed"] += 1
                continue
            if step.run_state not in RUN_TERMINAL:
                skipped["its run is still running"] += 1
                continue
            if step.run_id in seen:
                done.append(step)
                continue
            try:
                restart_run(step.community_id, step.run_id, from_failure=True)
            except BuzzDeliveryError as exc:
                skipped[type(exc).__name__] += 1
                continue
            seen.add(step.run_id)
            done.append(step)
        report(self, request, verb="retried", done=done, skipped=skipped, change_message="restart_run from failure")


@admin.register(Approval)
class ApprovalAdmin(ReadOnlyAdmin):
    """The approvals queue: pending first, oldest first; approve/reject need ``decide_approval``."""

    list_display = ("short_id", "state", "asked_by", "community", "prompt_line", "deadline_at", "decided_by")
    list_display_links = ("short_id",)
    list_filter = ("state",)
    list_select_related = ("community",)  # the run column needs no join (run_link)
    # Pending first (alphabetically "approved" came first), then oldest first.
    ordering = (Case(When(state="pending", then=Value(0)), default=Value(1)).asc(), "requested_at")
    readonly_fields = (
        "id",
        "community",
        "asked_by",
        "run",
        "step",
        "state",
        "prompt",
        "requested_at",
        "deadline_at",
        "closed_at",
        "decided_by",
    )
    fields = readonly_fields
    actions = ["approve", "reject"]
    search_fields = ("id",)  # the search box; get_search_results reads it
    search_help_text = "Approval id, workflow run id or agent run id (UUID)."

    has_decide_approval_permission = _perm("decide_approval")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Approval]:
        queryset = super().get_queryset(request)
        if not apps.is_installed("buzz_delivery.agents"):
            return queryset
        from buzz_delivery.agents.models import AgentRun

        # The agent run waiting on (or that waited on) the approval: one probe of
        # ag_run_approval_idx per listed row, inside the row's community.
        asking = AgentRun.objects.filter(community_id=OuterRef("community_id"), approval_id=OuterRef("id"))
        return queryset.annotate(agent_run_id=Subquery(asking.values("id")[:1], output_field=UUIDField()))

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
        """A UUID: that approval, the approvals of that workflow run, or the one an agent run
        waits (or waited) on; anything else matches nothing."""
        term = search_term.strip()
        if not term:
            return queryset, False
        value = parse_uuid(term)
        if value is None:
            return queryset.none(), False
        q = Q(pk=value) | _run_q(value)
        if apps.is_installed("buzz_delivery.agents"):
            from buzz_delivery.agents.models import AgentRun

            waited = AgentRun.objects.filter(pk=value).values_list("community_id", "approval_id").first()
            if waited is not None and waited[1] is not None:
                q |= Q(community_id=waited[0], pk=waited[1])
        return queryset.filter(q), False

    @admin.display(description="approval / requested", ordering="requested_at")
    def short_id(self, obj: Approval) -> str:
        return format_html(
            '{}<br><span class="bd-quiet">{}</span>', display.short_uuid(obj.pk, 8), display.timestamp(obj.requested_at)
        )

    @admin.display(description="asked by")
    def asked_by(self, obj: Approval) -> str:
        """What asked for the decision, linked: a workflow run's step, or an agent run."""
        if obj.run_id is not None:
            return format_html(
                "{}<br>{}", run_link(obj.run_id), _link("buzz_workflows_step_change", obj.step_id, "its step")
            )
        agent_run = getattr(obj, "agent_run_id", None)
        if agent_run is not None:
            return _link("buzz_agents_agentrun_change", agent_run, f"agent run …{str(agent_run)[-8:]}")
        return display.EMPTY

    @admin.display(description="prompt")
    def prompt_line(self, obj: Approval) -> str:
        return format_html("{}", obj.prompt[:80])

    def _decide(self, request: HttpRequest, queryset: QuerySet[Approval], decision: str) -> None:
        rows = list(queryset[:1001])
        if too_many(self, request, rows, decision):
            return
        done, skipped = [], Counter[str]()
        who = request.user.get_username() or f"user {request.user.pk}"
        for approval in rows:
            try:
                outcome = decide_approval(approval.community_id, approval.id, decision, who)
            except BuzzDeliveryError as exc:
                skipped[type(exc).__name__] += 1
                continue
            if isinstance(outcome, Decided):
                done.append(approval)
            elif isinstance(outcome, AlreadyDecided):
                skipped[f"already {outcome.state} by {outcome.decided_by}"] += 1
            else:
                skipped["expired"] += 1
        report(self, request, verb=decision, done=done, skipped=skipped, change_message=f"decide_approval {decision}")

    @admin.action(description="Approve selected approvals", permissions=["decide_approval"])
    def approve(self, request: HttpRequest, queryset: QuerySet[Approval]) -> None:
        self._decide(request, queryset, "approved")

    @admin.action(description="Reject selected approvals", permissions=["decide_approval"])
    def reject(self, request: HttpRequest, queryset: QuerySet[Approval]) -> None:
        self._decide(request, queryset, "rejected")


@admin.register(SentEvent)
class SentEventAdmin(ReadOnlyAdmin):
    """Events kept for the waits that start after them (``send_event``); rows without ``sent_at``
    are the locks of waits for which nothing was sent yet."""

    list_display = ("name", "key", "community", "sent_at", "expires_at", "sends", "resumed")
    list_select_related = ("community",)
    readonly_fields = ("name", "key", "payload", "sent_at", "expires_at", "sends", "resumed", "created_at")
    search_fields = ("=name", "=key")


@admin.register(Schedule)
class ScheduleAdmin(_WorkflowNameColumn, ReadOnlyAdmin):
    list_display = ("workflow_name", "community", "cron", "missed", "enabled", "next_slot_at")
    list_select_related = ("community",)
    readonly_fields = ("workflow", "cron", "input", "missed", "enabled", "next_slot_at", "created_at")
