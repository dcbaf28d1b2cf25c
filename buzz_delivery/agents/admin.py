"""Admin of agent runs (SPEC 12): runs read-only with their journal as a timeline (calls,
results, compensations, approvals); cancel run behind its own permission
(``buzz_agents.cancel_agent_run``), through :func:`~buzz_delivery.agents.services.cancel_agent_run`;
a lost race is a message, never a 500. Agent approvals appear in the engine's approvals queue
(no run, no step) and are decided there."""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.contrib import admin
from django.db.models import Q, QuerySet, TextField
from django.db.models.functions import Cast, Left
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from buzz_delivery.admin import display
from buzz_delivery.admin.base import ReadOnlyAdmin, report, too_many
from buzz_delivery.admin.changelist import SnapshotFreeChangeList
from buzz_delivery.admin.concurrency import ConcurrencyPageMixin, SlotTable
from buzz_delivery.admin.search import parse_uuid
from buzz_delivery.agents.models import AgentRun, JournalEntry, RunOutput
from buzz_delivery.agents.services import AlreadyTerminal, NotFound, cancel_agent_run
from buzz_delivery.agents.states import RUN_TERMINAL
from buzz_delivery.exceptions import BuzzDeliveryError
from buzz_delivery.models import WorkflowAgentDelivery, WorkflowRun
from buzz_delivery.services import flow

# Characters of a journaled call's output shown on its timeline row (its stored JSON text).
OUTPUT_CHARS = 120
# The streamed output shown on a run's page (issue 29): its last chunks, each cut by the query.
OUTPUT_TAIL_CHUNKS = 50
OUTPUT_CHUNK_CHARS = 2000
# Seconds between reloads of a live agent run's page.
LIVE_REFRESH_SECONDS = 5


def timeline_rows(run: AgentRun) -> list[tuple[str, ...]]:
    """One row per event of the run's journal, in order: (when, seq, what, detail). A call's
    output is its stored JSON text, cut by the query (never loaded whole, never a Python repr)."""
    rows: list[tuple[str, ...]] = []
    entries = (
        JournalEntry.objects.filter(community_id=run.community_id, run_id=run.id)
        .defer("args", "output", "compensation")
        .annotate(output_text=Left(Cast("output", TextField()), OUTPUT_CHARS + 1))
        .order_by("seq")
    )
    for e in entries:
        what = "approval requested" if e.kind == "approval" else f"call {e.tool_name}"
        flags = " (destructive)" if e.destructive else ""
        rows.append((display.timestamp(e.created_at), str(e.seq), what + flags, f"generation {e.generation}"))
        if e.status != "pending":
            detail = e.blocked_reason or e.error or ("output " + display.json_line(e.output_text, OUTPUT_CHARS))
            if e.uncertain:
                detail = "uncertain: " + detail
            label = "decision" if e.kind == "approval" else "result"
            rows.append((display.timestamp(e.finished_at), str(e.seq), f"{label}: {e.status}", detail))
        if e.compensation_status:
            rows.append(
                (
                    display.timestamp(e.compensated_at),
                    str(e.seq),
                    f"compensation: {e.compensation_status}",
                    e.compensation_error or "",
                )
            )
    return rows


# The agent runs' concurrency limits page (``AGENT_CONCURRENCY_LIMITS``): the leased runs hold
# the slots (agents migration 0019's partial UNIQUE indexes), the pending runs of a key wait.
AGENT_RUN_SLOTS = SlotTable(
    setting=flow.AGENT_SETTING,
    declared=flow.declared_agent_limits,
    table=AgentRun._meta.db_table,
    held="d.state IN ('running', 'waiting_tool')",
    kinds={"agent": ("slot_agent", ("agent_pubkey",)), "community": ("slot_community", ())},
    pending="d.state = 'pending'",
    waiter_keys={"agent": ("d.agent_pubkey",), "community": ()},
    key_types={"agent": ("bytea",), "community": ()},
    noun="agent runs",
    held_word="leased",
    waiting="pending runs",
    freed_by="settled, parked, cancelled or reaped",
)


@admin.register(AgentRun)
class AgentRunAdmin(ConcurrencyPageMixin, ReadOnlyAdmin):
    concurrency_source = AGENT_RUN_SLOTS
    change_list_template = "admin/buzz_delivery/bd_concurrency_change_list.html"
    # Two facts a cell where they belong together: the list fits a 1400-pixel window with both
    # sidebars open (tests/test_browser.py).
    list_display = ("short_id", "agent_holder", "community", "state_line", "usage", "finished_at")
    list_display_links = ("short_id",)
    list_filter = ("state", "shadow")
    list_select_related = ("community",)
    search_fields = ("id",)  # the search box; get_search_results reads it
    search_help_text = "Agent run id, its delivery's id or the workflow run that started it (UUID)."
    readonly_fields = (
        "id",
        "community",
        "agent_key",
        "state",
        "compensations",
        "shadow",
        "failure_code",
        "failure_message",
        "delivery",
        "source",
        "approval_link",
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
        "input",
        "output",
        "streamed_output",
        "created_at",
        "finished_at",
        "timeline",
        "history_table",
    )
    fields = readonly_fields
    actions = ["cancel_runs"]

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type:
        return SnapshotFreeChangeList  # the list does not load the history

    def has_cancel_agent_run_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("buzz_agents.cancel_agent_run")

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
        """A UUID: that run, the run of that delivery, or the runs a workflow run started (each
        looked up within the community its own row names); anything else matches nothing."""
        term = search_term.strip()
        if not term:
            return queryset, False
        value = parse_uuid(term)
        if value is None:
            return queryset.none(), False
        q = Q(pk=value)
        delivery = WorkflowAgentDelivery.objects.filter(pk=value).values_list("community_id", flat=True).first()
        if delivery is not None:
            q |= Q(community_id=delivery, delivery_id=value)
        source = WorkflowRun.objects.filter(pk=value).values_list("community_id", flat=True).first()
        if source is not None:
            q |= Q(community_id=source, source_run_id=value)
        return queryset.filter(q), False

    def refresh_seconds(self, request: HttpRequest, object_id: str) -> int | None:
        """A live run's page reloads itself every few seconds; a terminal one's does not."""
        pk = parse_uuid(object_id)
        state = AgentRun.objects.filter(pk=pk).values_list("state", flat=True).first() if pk is not None else None
        return LIVE_REFRESH_SECONDS if state is not None and state not in RUN_TERMINAL else None

    @admin.display(description="agent run / created", ordering="id")
    def short_id(self, obj: AgentRun) -> str:
        return format_html(
            '{}<br><span class="bd-quiet">{}</span>', display.short_uuid(obj.pk, 8), display.timestamp(obj.created_at)
        )

    @admin.display(description="agent / holder")
    def agent_holder(self, obj: AgentRun) -> str:
        return format_html('{}<br><span class="bd-quiet">{}</span>', self.agent_hex(obj), display.holder(obj.worker_id))

    @admin.display(description="state", ordering="state")
    def state_line(self, obj: AgentRun) -> str:
        """The state and, below it, whether the run is undoing its calls."""
        unwinding = self.compensations(obj)
        if unwinding == display.EMPTY:
            return obj.get_state_display()
        return format_html("{}<br>{}", obj.get_state_display(), unwinding)

    @admin.display(description="calls / attempts")
    def usage(self, obj: AgentRun) -> str:
        return format_html(
            '{} of {}<br><span class="bd-quiet">attempt {} of {}</span>',
            obj.tool_calls_used,
            obj.max_tool_calls,
            obj.attempts,
            obj.max_attempts,
        )

    @admin.display(description="agent")
    def agent_hex(self, obj: AgentRun) -> str:
        return display.holder(bytes(obj.agent_pubkey).hex())

    @admin.display(description="agent public key")
    def agent_key(self, obj: AgentRun) -> str:
        return display.full_hex(obj.agent_pubkey)

    @admin.display(description="holder")
    def holder(self, obj: AgentRun) -> str:
        return display.holder(obj.worker_id)

    @admin.display(description="compensations")
    def compensations(self, obj: AgentRun) -> str:
        """Whether the run is undoing its calls: a live run still unwinding is a warning; a
        terminal one has finished unwinding (its journal says how each compensation ended)."""
        if not obj.unwinding:
            return display.EMPTY
        if obj.state in RUN_TERMINAL:
            return mark_safe('<span title="the compensations ran; see the journal">unwound</span>')
        return mark_safe('<span class="bd-warn">⟲ unwinding</span>')

    @admin.display(description="delivery")
    def delivery(self, obj: AgentRun) -> str:
        if obj.delivery_id is None:
            return display.EMPTY
        url = reverse("admin:buzz_delivery_workflowagentdelivery_change", args=[obj.delivery_id])
        return format_html('<a href="{}">{}</a>', url, obj.delivery_id)

    @admin.display(description="started by")
    def source(self, obj: AgentRun) -> str:
        """The workflow run and step whose delivery started this run, linked."""
        if obj.source_run_id is None:
            return "an inbound channel event (intake)"
        from buzz_delivery.workflows.models import Run

        engine = Run.objects.filter(pk=obj.source_run_id).exists()  # else a producer's own run
        view = "buzz_workflows_run_change" if engine else "buzz_delivery_workflowrun_change"
        url = reverse(f"admin:{view}", args=[obj.source_run_id])
        return format_html('<a href="{}">workflow run {}</a>, step {}', url, obj.source_run_id, obj.source_step_key)

    @admin.display(description="approval")
    def approval_link(self, obj: AgentRun) -> str:
        """The approval the run asked for (waits on, when waiting_approval), linked."""
        if obj.approval_id is None:
            return display.EMPTY
        url = reverse("admin:buzz_workflows_approval_change", args=[obj.approval_id])
        return format_html('<a href="{}">approval {}</a>', url, obj.approval_id)

    @admin.display(description="history")
    def history_table(self, obj: AgentRun) -> str:
        return display.history_table(obj.history)

    @admin.display(description="streamed output")
    def streamed_output(self, obj: AgentRun) -> str:
        """The run's last chunks (``ctx.emit``) as text, oldest first: at most
        :data:`OUTPUT_TAIL_CHUNKS`, each cut to :data:`OUTPUT_CHUNK_CHARS` by the query (a cut
        chunk ends with ``[…]``), never the whole stream; the page reloads while the run is live."""
        if not obj.output_chunks:
            return "nothing emitted"
        rows = list(
            RunOutput.objects.filter(community_id=obj.community_id, run_id=obj.id)
            .order_by("-seq")
            .annotate(head=Left("chunk", OUTPUT_CHUNK_CHARS + 1))
            .values_list("seq", "head")[:OUTPUT_TAIL_CHUNKS]
        )
        rows.reverse()
        text = "".join(h if len(h) <= OUTPUT_CHUNK_CHARS else h[:OUTPUT_CHUNK_CHARS] + "[…]" for _, h in rows)
        first = rows[0][0] if rows else obj.output_chunks + 1
        shown = f"chunks {first}..{obj.output_chunks}" if first > 1 else f"all {obj.output_chunks} chunks"
        return format_html(
            '<p>{} ({} bytes in all)</p><pre class="agent-output" style="white-space: pre-wrap; max-height: 30em;'
            ' overflow: auto">{}</pre>',
            shown,
            obj.output_bytes,
            text,
        )

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
