"""The live workers list (issue 17): every registered worker process and its last heartbeat.

Read-only. A row is *stale* when its heartbeat is older than
:data:`~buzz_delivery.services.workers.STALE_AFTER_SECONDS` by the database clock (the process
was killed, hangs, or lost its database); the reaper deletes such rows later.
"""

from __future__ import annotations

import datetime as dt

from django.contrib import admin
from django.db.models import BooleanField, ExpressionWrapper, Q, QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest

from buzz_delivery.admin.base import ReadOnlyAdmin
from buzz_delivery.admin.display import timestamp
from buzz_delivery.models import WorkerRegistration
from buzz_delivery.services.workers import STALE_AFTER_SECONDS


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
    list_display = ("name", "kind", "host", "pid", "detail", "started", "heartbeat", "stale")
    list_filter = ("kind", StaleFilter)
    search_fields = ("host", "name", "detail")
    ordering = ("kind", "host", "pid")

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        stale_before = Now() - dt.timedelta(seconds=STALE_AFTER_SECONDS)
        return (
            super()
            .get_queryset(request)
            .annotate(is_stale=ExpressionWrapper(Q(last_heartbeat__lt=stale_before), output_field=BooleanField()))
        )

    @admin.display(description="started", ordering="started_at")
    def started(self, obj: WorkerRegistration) -> str:
        return timestamp(obj.started_at)

    @admin.display(description="last heartbeat", ordering="last_heartbeat")
    def heartbeat(self, obj: WorkerRegistration) -> str:
        return timestamp(obj.last_heartbeat)

    @admin.display(description="stale", boolean=True, ordering="is_stale")
    def stale(self, obj: WorkerRegistration) -> bool:
        return bool(getattr(obj, "is_stale", False))
