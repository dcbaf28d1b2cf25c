"""Admin pages of communities (tenants), workflows, runs and events (SPEC section 8). Read-only.

A community's lifecycle moves only through the "Advance lifecycle" action, which calls
``services.advance_community`` after a confirmation page; ``deletion_state`` is never an
editable field. The action is gated by the ``buzz_delivery.change_community`` permission:
moving the lifecycle is the only change the admin makes to a community.
"""

from __future__ import annotations

from collections import Counter

from django.contrib import admin
from django.contrib.admin import helpers
from django.core.exceptions import ValidationError
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html

from buzz_delivery import services
from buzz_delivery.admin import display
from buzz_delivery.admin.base import MAX_ACTION_ROWS, ReadOnlyAdmin, report, too_many
from buzz_delivery.admin.search import HEX_PREFIX, hex_prefix_range, parse_uuid
from buzz_delivery.exceptions import BuzzDeliveryError
from buzz_delivery.models import LIFECYCLE_ORDER, Community, Event, Workflow, WorkflowRun


def next_state(state: str) -> str | None:
    """The lifecycle state after ``state``, or None after ``tombstone``."""
    index = LIFECYCLE_ORDER.index(state)
    return LIFECYCLE_ORDER[index + 1] if index + 1 < len(LIFECYCLE_ORDER) else None


def uuid_search(queryset: QuerySet, term: str, text_field: str | None = None) -> QuerySet:
    """A UUID matches the primary key exactly; other text matches ``text_field`` by prefix."""
    value = parse_uuid(term.strip())
    if value is not None:
        return queryset.filter(pk=value)
    if text_field and term.strip():
        return queryset.filter(**{f"{text_field}__startswith": term.strip()})
    return queryset


@admin.register(Community)
class CommunityAdmin(ReadOnlyAdmin):
    list_display = ("name", "short_id", "deletion_state", "fence_generation", "state_changed_at", "created_at")
    list_filter = ("deletion_state",)
    ordering = ("name", "id")
    search_fields = ("name",)
    search_help_text = "Community id (UUID) or name prefix."
    actions = ("advance_lifecycle",)
    fields = ("id", "name", "deletion_state", "fence_generation", "state_changed_at", "created_at", "deliveries")
    readonly_fields = fields

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
        return uuid_search(queryset, search_term, "name"), False

    @admin.display(description="id", ordering="id")
    def short_id(self, obj: Community) -> str:
        return display.short_uuid(obj.id)

    @admin.display(description="deliveries")
    def deliveries(self, obj: Community) -> str:
        url = reverse("admin:buzz_delivery_workflowagentdelivery_changelist")
        return format_html('<a href="{}?community={}">Deliveries of this community</a>', url, obj.pk)

    def has_advance_lifecycle_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("buzz_delivery.change_community")

    @admin.action(permissions=["advance_lifecycle"], description="Advance lifecycle to the next state…")
    def advance_lifecycle(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        """First a confirmation page (the move is permanent), then ``services.advance_community``
        for each selected community, one step forward."""
        communities = list(queryset.order_by("name", "id")[: MAX_ACTION_ROWS + 1])
        if too_many(self, request, communities, "moved"):
            return None
        if request.POST.get("post") != "yes":
            context = {
                **self.admin_site.each_context(request),
                "title": "Advance the lifecycle of these communities?",
                "opts": self.opts,
                "moves": [(c, next_state(c.deletion_state)) for c in communities],
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            }
            return TemplateResponse(request, "admin/buzz_delivery/community/advance_lifecycle.html", context)
        done: list[Community] = []
        skipped: Counter[str] = Counter()
        for community in communities:
            target = next_state(community.deletion_state)
            if target is None:
                skipped["already tombstone (the end state)"] += 1
                continue
            try:
                services.advance_community(community.pk, target)
            except (BuzzDeliveryError, ValidationError) as exc:
                skipped[str(exc)] += 1
                continue
            done.append(community)
        report(
            self,
            request,
            verb="moved",
            done=done,
            skipped=skipped,
            change_message="Lifecycle advanced one step (services.advance_community)",
        )
        return None


@admin.register(Workflow)
class WorkflowAdmin(ReadOnlyAdmin):
    list_display = ("name", "short_id", "community", "created_at")
    list_select_related = ("community",)
    ordering = ("-id",)  # UUIDv7: newest first, served by the primary key
    search_fields = ("name",)
    search_help_text = "Workflow id (UUID) or name prefix."
    fields = ("id", "community", "name", "created_at")
    readonly_fields = fields

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
        return uuid_search(queryset, search_term, "name"), False

    @admin.display(description="id", ordering="id")
    def short_id(self, obj: Workflow) -> str:
        return display.short_uuid(obj.id)


@admin.register(WorkflowRun)
class WorkflowRunAdmin(ReadOnlyAdmin):
    list_display = ("short_id", "workflow_name", "community", "created_at")
    list_select_related = ("community",)
    ordering = ("-id",)  # UUIDv7: newest first, served by the primary key
    search_fields = ("id",)
    search_help_text = "Run id (UUID)."
    fields = ("id", "community", "workflow", "created_at", "deliveries")
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).annotate(workflow_name=display.workflow_name_of_row())

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
        if search_term.strip() and parse_uuid(search_term.strip()) is None:
            return queryset.none(), False
        return uuid_search(queryset, search_term), False

    @admin.display(description="run", ordering="id")
    def short_id(self, obj: WorkflowRun) -> str:
        return display.short_uuid(obj.id)

    @admin.display(description="workflow")
    def workflow_name(self, obj: WorkflowRun) -> str:
        return getattr(obj, "workflow_name", "")

    @admin.display(description="deliveries")
    def deliveries(self, obj: WorkflowRun) -> str:
        url = reverse("admin:buzz_delivery_workflowagentdelivery_changelist")
        return format_html('<a href="{}?q={}">Deliveries of this run</a>', url, obj.pk)


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ("event", "kind", "author", "community", "created_at")
    list_select_related = ("community",)
    ordering = ("-id",)  # served by the primary key
    search_fields = ("event_id",)
    search_help_text = "Event id: a hex prefix (1-64 hex characters)."
    fields = ("community", "event_id_hex", "created_at", "kind", "pubkey_hex", "content", "tags")
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return (
            super().get_queryset(request).defer("content", "tags")
            if _is_list(request)
            else (super().get_queryset(request))
        )

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        if not HEX_PREFIX.match(term):
            return queryset.none(), False
        low, high = hex_prefix_range(term)
        q = Q(event_id__gte=low) & (Q(event_id__lt=high) if high is not None else Q())
        return queryset.filter(q), False

    @admin.display(description="event id", ordering="id")
    def event(self, obj: Event) -> str:
        return display.short_hex(obj.event_id)

    @admin.display(description="author")
    def author(self, obj: Event) -> str:
        return display.short_hex(obj.pubkey)

    @admin.display(description="event id")
    def event_id_hex(self, obj: Event) -> str:
        return display.full_hex(obj.event_id)

    @admin.display(description="author public key")
    def pubkey_hex(self, obj: Event) -> str:
        return display.full_hex(obj.pubkey)


def _is_list(request: HttpRequest) -> bool:
    match = getattr(request, "resolver_match", None)
    return bool(match and match.url_name and match.url_name.endswith("_changelist"))
