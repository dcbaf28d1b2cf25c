"""Admin of the workflow engine (SPEC section 11): definitions, runs, steps and approvals,
read-only; the run page draws the DAG (server-side SVG) with a "why not running" line per step;
fenced actions (cancel run, restart run, retry a failed step, approve/reject) each behind its
own permission and each through :mod:`buzz_delivery.workflows.services`; a lost race is a
message, never a 500."""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.contrib import admin
from django.db import connection
from django.db.models import Case, DateTimeField, Func, QuerySet, Value, When
from django.http import HttpRequest
from django.utils.html import format_html

from buzz_delivery.admin import display
from buzz_delivery.admin.base import ReadOnlyAdmin, report, too_many
from buzz_delivery.admin.changelist import SnapshotFreeChangeList
from buzz_delivery.exceptions import BuzzDeliveryError
from buzz_delivery.services import AlreadyTerminal
from buzz_delivery.workflows import dag
from buzz_delivery.workflows.models import Approval, DefinitionVersion, Run, Schedule, Step
from buzz_delivery.workflows.services import AlreadyDecided, Decided, cancel_run, decide_approval, restart_run
from buzz_delivery.workflows.states import RUN_TERMINAL

# The step's JSON columns (besides its history): the detail page reads them as text.
STEP_JSON_FIELDS = ("when_cond", "output")


def _db_now() -> Any:
    with connection.cursor() as cursor:
        cursor.execute("SELECT buzz_delivery_now()")
        return cursor.fetchone()[0]


def _perm(codename: str):  # type: ignore[no-untyped-def]
    def has(self: admin.ModelAdmin, request: HttpRequest) -> bool:
        return request.user.has_perm(f"buzz_workflows.{codename}")

    return has


@admin.register(DefinitionVersion)
class DefinitionVersionAdmin(ReadOnlyAdmin):
    list_display = ("workflow", "version", "hash_hex", "created_at")
    list_select_related = ("workflow",)
    readonly_fields = ("workflow", "version", "hash_hex", "definition_event_hex", "content_json", "created_at")
    exclude = ("content_hash", "definition_event_id", "content")
    json_text_fields = ("content",)

    @admin.display(description="content")
    def content_json(self, obj: DefinitionVersion) -> str:
        return display.json_field(obj, "content")

    @admin.display(description="content hash")
    def hash_hex(self, obj: DefinitionVersion) -> str:
        return bytes(obj.content_hash).hex()[:16]

    @admin.display(description="definition event id")
    def definition_event_hex(self, obj: DefinitionVersion) -> str:
        return bytes(obj.definition_event_id).hex()


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    list_display = ("pk", "workflow", "state", "depth", "steps_left", "created_at", "finished_at")
    list_filter = ("state",)
    list_select_related = ("workflow",)
    readonly_fields = (
        "run",
        "workflow",
        "definition",
        "state",
        "failure_code",
        "failure_message",
        "input_json",
        "output_json",
        "parent_run",
        "parent_step_key",
        "restart_of",
        "depth",
        "created_at",
        "finished_at",
        "dag",
        "step_table",
    )
    fields = readonly_fields
    actions = ["cancel_runs", "restart_runs"]
    json_text_fields = ("input", "output")

    has_cancel_engine_run_permission = _perm("cancel_engine_run")
    has_restart_engine_run_permission = _perm("restart_engine_run")

    def _steps(self, obj: Run) -> list[Step]:
        # The drawing reads no JSON column: none is loaded (any stored value keeps the page up).
        steps = Step.objects.filter(community_id=obj.community_id, run_id=obj.pk).order_by("position")
        return list(steps.defer(*STEP_JSON_FIELDS, "history"))

    @admin.display(description="input")
    def input_json(self, obj: Run) -> str:
        return display.json_field(obj, "input")

    @admin.display(description="output")
    def output_json(self, obj: Run) -> str:
        return display.json_field(obj, "output")

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


@admin.register(Step)
class StepAdmin(ReadOnlyAdmin):
    list_display = ("key", "run", "kind", "state", "holder", "attempts", "why", "finished_at")
    list_filter = ("state", "kind")
    readonly_fields = (
        *(f.name for f in Step._meta.fields if f.name != "history" and f.name not in STEP_JSON_FIELDS),
        "when_json",
        "output_json",
        "history_table",
    )
    exclude = ("history", *STEP_JSON_FIELDS)  # history shown as a table, JSON read as text
    actions = ["retry_failed_steps"]
    json_text_fields = STEP_JSON_FIELDS

    @admin.display(description="when")
    def when_json(self, obj: Step) -> str:
        return display.json_field(obj, "when_cond")

    @admin.display(description="output")
    def output_json(self, obj: Step) -> str:
        return display.json_field(obj, "output")

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type:
        return SnapshotFreeChangeList  # the list does not load the history

    def get_queryset(self, request: HttpRequest) -> QuerySet[Step]:
        # The database clock, read by the list's own query: "why not running" costs no
        # statement per row.
        # The "run" column: one join, not one query per row, without the run's JSON columns.
        return (
            super()
            .get_queryset(request)
            .select_related("run")
            .defer("run__input", "run__output")
            .annotate(db_now=Func(function="buzz_delivery_now", output_field=DateTimeField()))
        )

    @admin.display(description="holder")
    def holder(self, obj: Step) -> str:
        return obj.claimed_by or display.EMPTY

    @admin.display(description="history")
    def history_table(self, obj: Step) -> str:
        return display.history_table(obj.history)

    has_retry_engine_step_permission = _perm("retry_engine_step")

    @admin.display(description="why not running")
    def why(self, obj: Step) -> str:
        return dag.why_not_running(obj, getattr(obj, "db_now", None) or _db_now())

    @admin.action(description="Retry failed steps (restart their run from failure)", permissions=["retry_engine_step"])
    def retry_failed_steps(self, request: HttpRequest, queryset: QuerySet[Step]) -> None:
        rows = list(queryset.select_related("run")[:1001])
        if too_many(self, request, rows, "retried"):
            return
        done, skipped, seen = [], Counter[str](), set()
        for step in rows:
            if step.state != "failed":
                skipped[f"{step.state}, not failed"] += 1
                continue
            if step.run.state not in RUN_TERMINAL:
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

    list_display = ("id", "run", "state", "prompt_line", "requested_at", "deadline_at", "decided_by")
    list_filter = ("state",)
    list_select_related = ("run",)  # the "run" column: one join, not one query per row
    # Pending first (alphabetically "approved" came first), then oldest first.
    ordering = (Case(When(state="pending", then=Value(0)), default=Value(1)).asc(), "requested_at")
    readonly_fields = ("run", "step", "state", "prompt", "requested_at", "deadline_at", "closed_at", "decided_by")
    exclude = ("step_generation",)
    actions = ["approve", "reject"]

    has_decide_approval_permission = _perm("decide_approval")

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


@admin.register(Schedule)
class ScheduleAdmin(ReadOnlyAdmin):
    list_display = ("workflow", "cron", "missed", "enabled", "next_slot_at")
    list_select_related = ("workflow",)
    readonly_fields = ("workflow", "cron", "input_json", "missed", "enabled", "next_slot_at", "created_at")
    exclude = ("input",)
    json_text_fields = ("input",)

    @admin.display(description="input")
    def input_json(self, obj: Schedule) -> str:
        return display.json_field(obj, "input")
