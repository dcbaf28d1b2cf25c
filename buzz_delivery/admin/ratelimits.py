"""The rate limits list (issue 32, docs/flow-control.md): one row per (community, key) window of
``buzz_delivery_rate_limit`` with its key's declared limit and period and the units used in its
current window (0 once the window ended, by the database clock). Read-only; written only by the
take statement of :mod:`buzz_delivery.services.ratelimits`. The limits themselves are settings
(``BUZZ_DELIVERY["RATE_LIMITS"]``), shown here, never read from the rows."""

from __future__ import annotations

import datetime as dt

from django.contrib import admin
from django.db.models import DateTimeField, Func, QuerySet
from django.http import HttpRequest
from django.utils.html import format_html

from buzz_delivery.admin.base import ReadOnlyAdmin
from buzz_delivery.admin.display import timestamp
from buzz_delivery.models import RateLimit
from buzz_delivery.services.ratelimits import RateLimitSpec, declared_rate_limits


class DbNow(Func):
    """``buzz_delivery_now()``: the services' database clock."""

    function = "buzz_delivery_now"
    template = "%(function)s()"
    output_field = DateTimeField()


def current_use(obj: RateLimit, spec: RateLimitSpec | None) -> int:
    """Units used in the row's window if it is still the current one, else 0."""
    now = getattr(obj, "db_now", None)
    if spec is None or now is None:
        return 0
    return obj.used if obj.window_start + dt.timedelta(seconds=spec.period) > now else 0


@admin.register(RateLimit)
class RateLimitAdmin(ReadOnlyAdmin):
    list_display = ("key", "community", "use", "limit", "period", "window")
    list_filter = ("key",)
    search_fields = ("key",)
    ordering = ("key", "community_id")
    fields = ("community", "key", "window_start", "used", "taken_at")
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).annotate(db_now=DbNow())

    def _spec(self, obj: RateLimit) -> RateLimitSpec | None:
        return declared_rate_limits().get(obj.key)

    @admin.display(description="used now")
    def use(self, obj: RateLimit) -> str:
        """Units used in the current window, over the limit in red (a charge after a call)."""
        spec = self._spec(obj)
        used = current_use(obj, spec)
        if spec is not None and used > spec.limit:
            return format_html('<span class="bd-bad">{} (over)</span>', used)
        return str(used)

    @admin.display(description="limit")
    def limit(self, obj: RateLimit) -> str:
        spec = self._spec(obj)
        return "not declared" if spec is None else str(spec.limit)

    @admin.display(description="period (s)")
    def period(self, obj: RateLimit) -> str:
        spec = self._spec(obj)
        return "" if spec is None else f"{spec.period:g}"

    @admin.display(description="window start", ordering="window_start")
    def window(self, obj: RateLimit) -> str:
        return timestamp(obj.window_start)
