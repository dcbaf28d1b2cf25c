"""Admin of task results (``django.tasks`` through the inbox, issue 36): read-only. A task's
status, attempts and holders are its delivery's, read in the list's own query (one primary-key
probe of the delivery per listed row, inside the row's community) and linked from its page."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib import admin
from django.db.models import CharField, OuterRef, QuerySet, Subquery
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from buzz_delivery.admin import display
from buzz_delivery.admin.base import ReadOnlyAdmin
from buzz_delivery.admin.search import parse_uuid
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.tasks.models import TaskResult

# The task's status as Django names it, from its delivery's.
STATUS = {"pending": "READY", "claimed": "RUNNING", "finished": "SUCCESSFUL", "failed": "FAILED", "expired": "FAILED"}


class QueueFilter(admin.SimpleListFilter):
    """By queue: the queues ``TASKS`` declares (each backend's ``QUEUES`` and
    ``OPTIONS["TARGETS"]``, and Django's ``default``), no ``DISTINCT`` over the table (Django's
    filter of a field's values reads every row on each page); any queue works by URL
    (``?queue_name=...``). Read from the settings: the admin does not import the framework."""

    title = "queue"
    parameter_name = "queue_name"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        queues = {"default"}
        for backend in (getattr(settings, "TASKS", None) or {}).values():
            queues.update(q for q in backend.get("QUEUES") or () if isinstance(q, str))
            queues.update(q for q in (backend.get("OPTIONS") or {}).get("TARGETS") or () if isinstance(q, str))
        value = self.value()
        if value:
            queues.add(value)
        return [(queue, queue) for queue in sorted(queues)]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        return queryset.filter(queue_name=value) if value else queryset


@admin.register(TaskResult)
class TaskResultAdmin(ReadOnlyAdmin):
    list_display = ("short_id", "task_path", "community", "queue_name", "status", "priority", "enqueued_at")
    list_display_links = ("short_id",)
    list_filter = (QueueFilter,)
    list_select_related = ("community",)
    ordering = ("-id",)  # UUIDv7: newest first, served by task_result_id_idx
    search_fields = ("id",)  # the search box; get_search_results reads it
    search_help_text = "Task result id (UUID) or a task path prefix."
    fields = (
        "id",
        "community",
        "task_path",
        "status",
        "delivery",
        "backend",
        "queue_name",
        "priority",
        "takes_context",
        "run_after",
        "enqueued_at",
        "args",
        "kwargs",
        "return_value",
        "errors",
    )
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        delivery = WorkflowAgentDelivery.objects.filter(
            community_id=OuterRef("community_id"), id=OuterRef("delivery_id")
        )
        return (
            super()
            .get_queryset(request)
            .defer("args", "kwargs", "return_value", "errors")
            .annotate(delivery_status=Subquery(delivery.values("status")[:1], output_field=CharField()))
        )

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        value = parse_uuid(term)
        if value is not None:
            return queryset.filter(pk=value), False
        return queryset.filter(task_path__startswith=term), False

    @admin.display(description="task result", ordering="id")
    def short_id(self, obj: TaskResult) -> str:
        return display.short_uuid(obj.pk)

    @admin.display(description="status")
    def status(self, obj: TaskResult) -> str:
        delivery_status = getattr(obj, "delivery_status", None)
        if delivery_status is None:
            return display.EMPTY
        text = f"{STATUS.get(delivery_status, delivery_status)} ({delivery_status})"
        return format_html('<span class="bd-bad">{}</span>', text) if delivery_status in ("failed", "expired") else text

    @admin.display(description="delivery")
    def delivery(self, obj: Any) -> str:
        url = reverse("admin:buzz_delivery_workflowagentdelivery_change", args=[obj.delivery_id])
        return format_html('<a href="{}">{}</a> (its attempts, holders and history)', url, obj.delivery_id)
