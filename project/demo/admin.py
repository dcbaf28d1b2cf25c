"""Read-only admin for the demo's runs, so their reports can be looked at after the fact."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from project.demo.models import DemoRun


@admin.register(DemoRun)
class DemoRunAdmin(admin.ModelAdmin):
    list_display = ("started_at", "finished_at", "passed")
    list_filter = ("passed",)
    readonly_fields = ("id", "started_at", "finished_at", "options", "passed", "report")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
