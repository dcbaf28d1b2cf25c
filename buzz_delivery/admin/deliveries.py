"""The delivery admin (SPEC section 8): a fast, read-only changelist and detail page, operator
actions through the services, and the dashboard page.

Permissions (declared in ``WorkflowAgentDelivery.Meta.permissions``, migration 0003):

- ``buzz_delivery.view_workflowagentdelivery``: the list, detail page and dashboard;
- ``buzz_delivery.requeue_delivery``: "Requeue failed/expired" (``services.requeue_delivery``);
- ``buzz_delivery.force_fail_delivery``: "Force-fail claimed" (``services.force_fail_delivery``);
- ``buzz_delivery.reap_deliveries``: "Reap expired leases now" (``services.reap``, fleet-wide,
  under the same run lease as the ``reap_deliveries`` command).

Each of these actions bumps the lease generation, so a current holder is fenced.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import BooleanField, Case, DateTimeField, F, Q, QuerySet, Value, When
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from buzz_delivery import services
from buzz_delivery.admin import display, search
from buzz_delivery.admin.base import MAX_ACTION_ROWS, ReadOnlyAdmin, logger, report, too_many
from buzz_delivery.admin.changelist import SnapshotFreeChangeList
from buzz_delivery.admin.concurrency import DELIVERIES, load_concurrency_use
from buzz_delivery.admin.dashboard import load_dashboard
from buzz_delivery.admin.filters import (
    CommunityFilter,
    FailureCodeFilter,
    LeaseExpiredFilter,
    StatusFilter,
    by_state,
    lease_expired_q,
)
from buzz_delivery.admin.paginators import EstimatedCountPaginator
from buzz_delivery.exceptions import BuzzDeliveryError
from buzz_delivery.models import CREATED_FLOOR, Event, WorkflowAgentDelivery
from buzz_delivery.services.runlock import LeaseBusy, run_lease

REAP_LEASE_SECONDS = 120
# Columns an action needs to call a service and write a LogEntry (``__str__``).
ACTION_COLUMNS = ("id", "community_id", "step_id", "target_pubkey", "status", "lease_generation")


# Hex characters of the ids and keys shown in the delivery list (the full value is the tooltip).
LIST_ID_CHARS = 8

# Characters of the message event's content shown on a delivery's page.
PREVIEW_CHARS = 200


class DeliveryPaginator(EstimatedCountPaginator):
    """The deliveries' list: ``get_queryset`` always adds the age index's predicate."""

    always_true = Q(created_at__gt=CREATED_FLOOR)


@admin.register(WorkflowAgentDelivery)
class DeliveryAdmin(ReadOnlyAdmin):
    list_display = (
        "short_id",
        "status",
        "community_target",
        "workflow_run_step",
        "holder",
        "in_status",
        "due",
        "attempts",
        "failure",
    )
    list_display_links = ("short_id",)
    list_filter = (("status", StatusFilter), FailureCodeFilter, "cause_kind", CommunityFilter, LeaseExpiredFilter)
    list_select_related = ("community",)
    date_hierarchy = "created_at"
    paginator = DeliveryPaginator
    # Served by delivery_created_idx (created_at, partial: see get_queryset); Django appends
    # "-pk" as a tie-breaker.
    ordering = ("-created_at",)
    # The search box appears only with search_fields; get_search_results does the work.
    search_fields = ("step_id",)
    search_help_text = search.HELP_TEXT
    actions = ("requeue_selected", "force_fail_selected", "reap_expired_now")
    change_list_template = "admin/buzz_delivery/workflowagentdelivery/change_list.html"
    change_form_template = "admin/buzz_delivery/workflowagentdelivery/change_form.html"

    class Media:
        # The list fits a 1400-pixel window with both sidebars open (wrapping headers and cells).
        css = {"all": ("buzz_delivery/admin/deliveries.css",)}

    identity_fields = (
        "id",
        "community",
        "workflow",
        "run",
        "step_id",
        "target_hex",
        "definition_event_hex",
        "message_event_hex",
        "cause_kind",
        "cause_value",
    )
    lease_fields = (
        "status",
        "lease_generation",
        "claimed_by",
        "renewals",
        "lease_deadline",
        "claimed_at",
        "finished_at",
        "created_at",
    )
    policy_fields = ("attempt", "max_attempts", "next_attempt_at", "expires_at", "failure_code", "failure_message")
    snapshot_fields = ("execution_trace", "trigger_context")  # bounded JSON (ReadOnlyAdmin)
    history_fields = ("history_table",)
    fieldsets = (
        ("Identity", {"fields": identity_fields}),
        ("Lease", {"fields": lease_fields}),
        ("Policy", {"fields": policy_fields}),
        ("History (last 50 transitions, written by the statements that made them)", {"fields": history_fields}),
        ("Snapshots", {"classes": ("collapse",), "fields": snapshot_fields}),
    )
    readonly_fields = identity_fields + lease_fields + policy_fields + history_fields + snapshot_fields

    # --- queryset, changelist, search -------------------------------------------------

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        # "lease expired" is judged by the database clock, in the same query.
        return (
            super()
            .get_queryset(request)
            # Always true (the database clock stamps created_at); it lets the planner use
            # delivery_created_idx, whose predicate it is, so that the claim can never walk it.
            .filter(DeliveryPaginator.always_true)
            .annotate(
                workflow_name=display.workflow_name_of_row(),
                lease_expired=Case(
                    When(lease_expired_q(), then=Value(True)), default=Value(False), output_field=BooleanField()
                ),
                # When the row entered its status: claimed at its claim, terminal at its settle,
                # pending at its commit (a retried delivery: its first commit). Database clock.
                status_since=Case(
                    When(status="claimed", then=F("claimed_at")),
                    When(status="pending", then=F("created_at")),
                    default=F("finished_at"),
                    output_field=DateTimeField(),
                ),
                db_now=Now(),
            )
        )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type:
        return SnapshotFreeChangeList

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
        q = search.delivery_search_q(search_term)
        return (queryset if q is None else queryset.filter(q)), False

    # --- columns ----------------------------------------------------------------------

    # The list's ids are shortened to LIST_ID_CHARS hex characters (the full value is each one's
    # tooltip), and a delivery's creation time shares its cell: the list fits a 1400-pixel
    # window with both sidebars open (issue 17; static/buzz_delivery/admin/deliveries.css).

    @admin.display(description="delivery / created", ordering="created_at")
    def short_id(self, obj: WorkflowAgentDelivery) -> str:
        return format_html(
            '{}<br><span class="bd-quiet">{}</span>',
            display.short_uuid(obj.id, LIST_ID_CHARS),
            display.timestamp(obj.created_at),
        )

    @admin.display(description="community / target", ordering="community")
    def community_target(self, obj: WorkflowAgentDelivery) -> str:
        """Whom the delivery is for: its community and, below it, the target agent's key."""
        return format_html(
            '{}<br><span class="bd-quiet">{}</span>',
            obj.community.name,
            display.short_hex(obj.target_pubkey, LIST_ID_CHARS),
        )

    @admin.display(description="workflow / run / step")
    def workflow_run_step(self, obj: WorkflowAgentDelivery) -> str:
        return format_html(
            "{} / {} / {}",
            getattr(obj, "workflow_name", ""),
            display.short_uuid(obj.run_id, LIST_ID_CHARS),
            obj.step_id,
        )

    @admin.display(description="lease until", ordering="lease_until")
    def lease_deadline(self, obj: WorkflowAgentDelivery) -> str:
        if obj.lease_until is None:
            return display.EMPTY
        stamp = display.timestamp(obj.lease_until)
        if getattr(obj, "lease_expired", False):
            return format_html('{} <strong style="color: var(--error-fg, #ba2121)">expired</strong>', stamp)
        return stamp

    @admin.display(description="in status")
    def in_status(self, obj: WorkflowAgentDelivery) -> str:
        since, now = getattr(obj, "status_since", None), getattr(obj, "db_now", None)
        return display.duration(now - since) if since is not None and now is not None else display.EMPTY

    @admin.display(description="lease until / next attempt")
    def due(self, obj: WorkflowAgentDelivery) -> str:
        """One column for the row's next deadline (a list that fits the window): a claimed
        row's lease end, a pending row's next attempt after a retry backoff."""
        if obj.status == "claimed":
            return self.lease_deadline(obj)
        if obj.status == "pending" and obj.next_attempt_at is not None:
            return format_html("next attempt {}", display.timestamp(obj.next_attempt_at))
        return display.EMPTY

    @admin.display(description="failure code", ordering="failure_code")
    def failure(self, obj: WorkflowAgentDelivery) -> str:
        return obj.failure_code or display.EMPTY

    @admin.display(description="holder")
    def holder(self, obj: WorkflowAgentDelivery) -> str:
        return display.holder(obj.claimed_by)

    @admin.display(description="attempt / gen", ordering="lease_generation")
    def attempts(self, obj: WorkflowAgentDelivery) -> str:
        """The attempt (of the most allowed) and, below it, the lease generation."""
        attempt = f"{obj.attempt}/{obj.max_attempts}" if obj.max_attempts else str(obj.attempt)
        return format_html('{}<br><span class="bd-quiet">gen {}</span>', attempt, obj.lease_generation)

    # --- detail page ------------------------------------------------------------------

    @admin.display(description="target public key")
    def target_hex(self, obj: WorkflowAgentDelivery) -> str:
        return display.full_hex(obj.target_pubkey)

    @admin.display(description="definition event id")
    def definition_event_hex(self, obj: WorkflowAgentDelivery) -> str:
        return display.full_hex(obj.definition_event_id)

    @admin.display(description="message event")
    def message_event_hex(self, obj: WorkflowAgentDelivery) -> str:
        """The message event's full id, linked to its page, with the start of its content."""
        event = (
            Event.objects.filter(community_id=obj.community_id, event_id=obj.message_event_id)
            .only("id", "content")
            .first()
        )
        if event is None:
            return display.full_hex(obj.message_event_id)
        preview = event.content if len(event.content) <= PREVIEW_CHARS else event.content[:PREVIEW_CHARS] + "…"
        return format_html(
            '<a href="{}">{}</a><br><span class="help">{}</span>',
            reverse("admin:buzz_delivery_event_change", args=[event.pk]),
            display.full_hex(obj.message_event_id),
            preview,
        )

    @admin.display(description="cause")
    def cause_value(self, obj: WorkflowAgentDelivery) -> str:
        if obj.cause_kind == "event":
            return display.full_hex(obj.cause_event_id)
        if obj.cause_kind == "schedule":
            return display.timestamp(obj.cause_scheduled_for)
        return str(obj.cause_webhook_invocation_id)

    @admin.display(description="history")
    def history_table(self, obj: WorkflowAgentDelivery) -> str:
        return display.history_table(obj.history)

    # --- permissions of the actions ---------------------------------------------------

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("buzz_delivery.requeue_delivery")

    def has_force_fail_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("buzz_delivery.force_fail_delivery")

    def has_reap_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("buzz_delivery.reap_deliveries")

    # --- actions ----------------------------------------------------------------------

    def _each(self, request: HttpRequest, queryset: QuerySet, verb: str, message: str, call: Any) -> None:
        rows = list(queryset.select_related(None).order_by().only(*ACTION_COLUMNS)[: MAX_ACTION_ROWS + 1])
        if too_many(self, request, rows, verb):
            return
        done: list[WorkflowAgentDelivery] = []
        skipped: Counter[str] = Counter()
        for delivery in rows:
            try:
                outcome = call(delivery)
            except (BuzzDeliveryError, ValidationError) as exc:
                skipped[str(exc)] += 1
                continue
            if outcome.done:
                done.append(delivery)
            else:
                skipped[outcome.reason] += 1
        report(self, request, verb=verb, done=done, skipped=skipped, change_message=message)

    @admin.action(permissions=["requeue"], description="Requeue selected failed/expired deliveries")
    def requeue_selected(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._each(
            request,
            queryset,
            "requeued",
            "Requeued (failed/expired -> pending, generation bumped)",
            lambda d: services.requeue_delivery(d.community_id, d.id, actor=display.operator_actor(request)),
        )

    @admin.action(permissions=["force_fail"], description="Force-fail selected claimed deliveries")
    def force_fail_selected(self, request: HttpRequest, queryset: QuerySet) -> None:
        user = request.user.get_username()
        self._each(
            request,
            queryset,
            "force-failed",
            "Force-failed (claimed -> failed, generation bumped)",
            lambda d: services.force_fail_delivery(
                d.community_id, d.id, failure_message=f"force-failed by {user}", actor=display.operator_actor(request)
            ),
        )

    @admin.action(permissions=["reap"], description="Reap expired leases now (all communities)")
    def reap_expired_now(self, request: HttpRequest, queryset: QuerySet) -> None:
        lapsed = dict(
            by_state(queryset, lease="expired").order_by().values_list("id", "lease_generation")[:MAX_ACTION_ROWS]
        )
        result = self.reap_now(request)
        if result is None:
            return
        moved = [
            d
            for d in WorkflowAgentDelivery.objects.filter(id__in=lapsed).only(*ACTION_COLUMNS)
            if d.lease_generation > lapsed[d.id]
        ]
        if moved:
            report(
                self,
                request,
                verb="reaped",
                done=moved,
                skipped=Counter[str](),
                change_message="Reaped by an operator (lease expired, generation bumped)",
            )

    def reap_now(self, request: HttpRequest) -> services.ReapResult | None:
        """Run the fleet-wide reap under the ``reap_deliveries`` run lease and tell the operator."""
        with run_lease("reap_deliveries", REAP_LEASE_SECONDS) as lease:
            if isinstance(lease, LeaseBusy):
                self.message_user(
                    request,
                    f"Skipped: a reap_deliveries run is active (holder {lease.holder}); try again later.",
                    messages.WARNING,
                )
                return None
            result = services.reap()
        self.message_user(
            request,
            f"Reaped all communities: {result.reclaimed} reclaimed, {result.exhausted} attempts exhausted, "
            f"{result.expired} expired; skipped {result.skipped_fenced} (community not active).",
            messages.SUCCESS,
        )
        logger.info("admin reap now: user=%s %s", request.user.get_username(), result)
        return result

    # --- dashboard --------------------------------------------------------------------

    def _url_name(self, view: str) -> str:
        return f"{self.opts.app_label}_{self.opts.model_name}_{view}"

    def get_urls(self) -> list[Any]:
        return [
            path("dashboard/", self.admin_site.admin_view(self.dashboard_view), name=self._url_name("dashboard")),
            path(
                "concurrency/",
                self.admin_site.admin_view(self.concurrency_view),
                name=self._url_name("concurrency"),
            ),
            *super().get_urls(),
        ]

    def dashboard_view(self, request: HttpRequest) -> HttpResponse:
        """GET: the figures of :func:`load_dashboard`. POST ``reap``: reap now (needs ``reap_deliveries``)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        url = reverse(f"admin:{self._url_name('dashboard')}")
        if request.method == "POST":
            if not self.has_reap_permission(request):
                raise PermissionDenied
            self.reap_now(request)
            return HttpResponseRedirect(url)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Delivery dashboard",
            "dashboard": load_dashboard(),
            "can_reap": self.has_reap_permission(request),
            "changelist_url": reverse(f"admin:{self._url_name('changelist')}"),
        }
        return TemplateResponse(request, "admin/buzz_delivery/dashboard.html", context)

    def concurrency_view(self, request: HttpRequest) -> HttpResponse:
        """GET: each declared concurrency limit, the slots held per key and the waiters of the keys
        at their limit (:func:`~buzz_delivery.admin.concurrency.load_concurrency_use`). Read-only."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Concurrency limits",
            "use": load_concurrency_use(),
            "page": DELIVERIES,
            "changelist_url": reverse(f"admin:{self._url_name('changelist')}"),
            "dashboard_url": reverse(f"admin:{self._url_name('dashboard')}"),
        }
        return TemplateResponse(request, "admin/buzz_delivery/concurrency.html", context)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The detail page, with a button per operator action that applies to this delivery now
        (requeue a failed or expired one, force-fail a claimed one) and that the user may take, in
        an active community only: a fenced community's rows refuse both (its writes are fenced)."""
        pk = search.parse_uuid(object_id)
        row = (
            WorkflowAgentDelivery.objects.filter(pk=pk).values_list("status", "community__deletion_state").first()
            if pk is not None
            else None
        )
        status, community_state = row if row is not None else (None, None)
        if community_state != "active":
            status = None
        buttons = []
        if status in ("failed", "expired") and self.has_requeue_permission(request):
            buttons.append(
                {"name": "requeue_selected", "label": "Requeue", "help": "back to pending, generation bumped"}
            )
        if status == "claimed" and self.has_force_fail_permission(request):
            buttons.append(
                {"name": "force_fail_selected", "label": "Force-fail", "help": "claimed -> failed, generation bumped"}
            )
        extra = {
            "buzz_actions": buttons,
            "buzz_changelist_url": reverse(f"admin:{self._url_name('changelist')}"),
            **(extra_context or {}),
        }
        return super().change_view(request, object_id, form_url, extra)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        extra = {"dashboard_url": reverse(f"admin:{self._url_name('dashboard')}"), **(extra_context or {})}
        return super().changelist_view(request, extra)
