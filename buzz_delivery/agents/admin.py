"""Admin of agent runs (SPEC 12): runs read-only with their journal as a timeline (calls,
results, compensations, approvals); cancel run behind its own permission
(``buzz_agents.cancel_agent_run``), through :func:`~buzz_delivery.agents.services.cancel_agent_run`;
a lost race is a message, never a 500. Agent approvals appear in the engine's approvals queue
(no run, no step) and are decided there."""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join

from buzz_delivery.admin import display
from buzz_delivery.admin.base import ReadOnlyAdmin, report, too_many
from buzz_delivery.admin.changelist import SnapshotFreeChangeList
from buzz_delivery.agents.models import AgentPolicy, AgentRun, JournalEntry
from buzz_delivery.agents.services import AlreadyTerminal, NotFound, cancel_agent_run
from buzz_delivery.exceptions import BuzzDeliveryError


def timeline_rows(run: AgentRun) -> list[tuple[str, ...]]:
    """One row per event of the run's journal, in order: (when, seq, what, detail)."""
    rows: list[tuple[str, ...]] = []
    entries = display.with_json_as_text(
        JournalEntry.objects.filter(community_id=run.community_id, run_id=run.id).order_by("seq"),
        ("args", "output", "compensation"),
    )
    for e in entries:
        what = "approval requested" if e.kind == "approval" else f"call {e.tool_name}"
        flags = " (destructive)" if e.destructive else ""
        rows.append((str(e.created_at), str(e.seq), what + flags, f"generation {e.generation}"))
        if e.status != "pending":
            output = getattr(e, display.json_text_name("output"))  # text: any stored value shows
            detail = e.blocked_reason or e.error or ("output " + (output or "null")[:120])
            if e.uncertain:
                detail = "uncertain: " + detail
            label = "decision" if e.kind == "approval" else "result"
            rows.append((str(e.finished_at), str(e.seq), f"{label}: {e.status}", detail))
        if e.compensation_status:
            rows.append(
                (
                    str(e.compensated_at or ""),
                    str(e.seq),
                    f"compensation: {e.compensation_status}",
                    e.compensation_error or "",
                )
            )
    return rows


@admin.register(AgentRun)
class AgentRunAdmin(ReadOnlyAdmin):
    list_display = (
        "pk",
        "agent_hex",
        "state",
        "holder",
        "unwinding",
        "tool_calls_used",
        "attempts",
        "created_at",
        "finished_at",
    )
    list_filter = ("state", "shadow")
    readonly_fields = (
        "id",
        "community",
        "agent_hex",
        "state",
        "unwinding",
        "shadow",
        "failure_code",
        "failure_message",
        "delivery_id",
        "source_run",
        "source_step_key",
        "approval",
        "lease_generation",
        "lease_until",
        "heartbeat_at",
        "worker_id",
        "renewals",
        "attempts",
        "max_attempts",
        "next_attempt_at",
        "timeout_at",
        "tool_calls_used",
        "max_tool_calls",
        "cost_used",
        "max_cost",
        "input_json",
        "output_json",
        "created_at",
        "finished_at",
        "timeline",
        "history_table",
    )
    fields = readonly_fields
    actions = ["cancel_runs"]
    json_text_fields = ("input", "output")

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type:
        return SnapshotFreeChangeList  # the list does not load the history

    def has_cancel_agent_run_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("buzz_agents.cancel_agent_run")

    @admin.display(description="agent")
    def agent_hex(self, obj: AgentRun) -> str:
        return bytes(obj.agent_pubkey).hex()[:16]

    @admin.display(description="holder")
    def holder(self, obj: AgentRun) -> str:
        return obj.worker_id or display.EMPTY

    @admin.display(description="input")
    def input_json(self, obj: AgentRun) -> str:
        return display.json_field(obj, "input")

    @admin.display(description="output")
    def output_json(self, obj: AgentRun) -> str:
        return display.json_field(obj, "output")

    @admin.display(description="history")
    def history_table(self, obj: AgentRun) -> str:
        return display.history_table(obj.history)

    @admin.display(description="journal")
    def timeline(self, obj: AgentRun) -> str:
        rows = timeline_rows(obj)
        if not rows:
            return "no calls journaled"
        body = format_html_join("", "<tr><td>{}</td><td>#{}</td><td>{}</td><td>{}</td></tr>", rows)
        return format_html(
            '<table class="agent-timeline"><tr><th>when</th><th>seq</th><th>event</th><th>detail</th></tr>{}</table>',
            body,
        )

    @admin.action(description="Cancel selected agent runs", permissions=["cancel_agent_run"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[AgentRun]) -> None:
        rows = list(queryset[:1001])
        if too_many(self, request, rows, "cancelled"):
            return
        done, skipped = [], Counter[str]()
        who = request.user.get_username() or f"user {request.user.pk}"
        for run in rows:
            try:
                outcome = cancel_agent_run(
                    run.community_id, run.pk, reason=f"cancelled by {who}", actor=display.operator_actor(request)
                )
            except BuzzDeliveryError as exc:
                skipped[type(exc).__name__] += 1
                continue
            if isinstance(outcome, AlreadyTerminal):
                skipped[f"already {outcome.status}"] += 1
            elif isinstance(outcome, NotFound):
                skipped["gone"] += 1
            else:
                done.append(run)
        report(self, request, verb="cancelled", done=done, skipped=skipped, change_message="cancel_agent_run")


@admin.register(AgentPolicy)
class AgentPolicyAdmin(ReadOnlyAdmin):
    """The operators' policies for agent runs, read-only here: ``manage.py agent_policy`` (or
    :func:`~buzz_delivery.agents.services.policy.set_policy`) changes them."""

    list_display = (
        "community",
        "scope",
        "max_tool_calls",
        "max_cost",
        "max_attempts",
        "max_timeout_seconds",
        "max_lease_seconds",
        "shadow",
        "updated_by",
        "updated_at",
    )
    readonly_fields = list_display
    fields = readonly_fields

    @admin.display(description="agent")
    def scope(self, obj: AgentPolicy) -> str:
        return "every agent" if obj.agent_pubkey is None else bytes(obj.agent_pubkey).hex()
