"""The live workers list (issue 17, 36): every registered worker process and its last heartbeat.

Read-only. A row is *stale* when its heartbeat is older than
:data:`~buzz_delivery.services.workers.STALE_AFTER_SECONDS` (three missed heartbeats) by the
database clock: the process was killed, hangs, or lost its database; it is shown as a warning.
Once its heartbeat is older than :data:`~buzz_delivery.services.workers.PRUNE_AFTER_SECONDS`
the process is gone: the list leaves it out (and the reaper deletes the row on its next pass).
"""

from __future__ import annotations

import datetime as dt

from django.contrib import admin
from django.db.models import BooleanField, DurationField, ExpressionWrapper, F, Q, QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import mark_safe

from buzz_delivery.admin.base import ReadOnlyAdmin
from buzz_delivery.admin.display import duration, timestamp
from buzz_delivery.models import WorkerRegistration
from buzz_delivery.services.workers import PRUNE_AFTER_SECONDS, STALE_AFTER_SECONDS


class StaleFilter(admin.SimpleListFilter):
    title = "heartbeat"
    parameter_name = "stale"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("no", "live"), ("yes", "stale")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if self.value() in ("yes", "no"):
            return queryset.filter(is_stale=self.value() == "yes")
        return queryset


@admin.register(WorkerRegistration)
class WorkerRegistrationAdmin(ReadOnlyAdmin):
    list_display = ("name", "kind", "host", "pid", "detail", "started", "heartbeat", "state")
    list_filter = ("kind", StaleFilter)
    search_fields = ("host", "name", "detail")
    ordering = ("kind", "host", "pid")

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        stale_before = Now() - dt.timedelta(seconds=STALE_AFTER_SECONDS)
        return (
            super()
            .get_queryset(request)
            # Gone: past the prune age, whether or not the reaper has deleted it yet.
            .filter(last_heartbeat__gte=Now() - dt.timedelta(seconds=PRUNE_AFTER_SECONDS))
            .annotate(
                is_stale=ExpressionWrapper(Q(last_heartbeat__lt=stale_before), output_field=BooleanField()),
                silent_for=ExpressionWrapper(Now() - F("last_heartbeat"), output_field=DurationField()),
            )
        )

    @admin.display(description="started", ordering="started_at")
    def started(self, obj: WorkerRegistration) -> str:
        return timestamp(obj.started_at)

    @admin.display(description="last heartbeat", ordering="last_heartbeat")
    def heartbeat(self, obj: WorkerRegistration) -> str:
        return timestamp(obj.last_heartbeat)

    @admin.display(description="state", ordering="is_stale")
    def state(self, obj: WorkerRegistration) -> str:
        """``live``, or a warning: ``stale`` and how long the process has been silent."""
        if getattr(obj, "is_stale", False):
            return format_html(
                '<span class="bd-warn" title="no heartbeat for {} s or more: killed, hung or cut off">'
                "⚠ stale, silent {}</span>",
                f"{STALE_AFTER_SECONDS:g}",
                duration(getattr(obj, "silent_for", None)),
            )
        return mark_safe('<span class="bd-ok">live</span>')
