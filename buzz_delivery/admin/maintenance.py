"""The maintenance jobs list (issue 36): one row per job (``reap_deliveries``,
``prune_deliveries``, the engine's and agents' reapers), how many passes it made, how the last
one ended and when, its last summary and the totals of its counts (the figures behind
``buzz_maintenance_*`` on ``/metrics``). Read-only; written by
:func:`buzz_delivery.services.workers.record_maintenance_run`."""

from __future__ import annotations

from django.contrib import admin
from django.utils.html import format_html

from buzz_delivery.admin.base import ReadOnlyAdmin
from buzz_delivery.models import MaintenanceRun

# Outcomes of a pass that did its job (another run being active counts: the job was done).
GOOD_OUTCOMES = ("ok", "busy", "stopped")


@admin.register(MaintenanceRun)
class MaintenanceRunAdmin(ReadOnlyAdmin):
    list_display = ("name", "runs", "outcome", "last_finished_at")
    ordering = ("name",)
    fields = ("name", "runs", "last_outcome", "last_finished_at", "last_summary", "totals")
    readonly_fields = fields

    @admin.display(description="last outcome", ordering="last_outcome")
    def outcome(self, obj: MaintenanceRun) -> str:
        """The last pass's outcome: an error reads as one."""
        if obj.last_outcome in GOOD_OUTCOMES:
            return obj.last_outcome
        return format_html('<span class="bd-bad">✖ {}</span>', obj.last_outcome or "unknown")
