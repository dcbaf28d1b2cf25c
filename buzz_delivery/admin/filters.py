"""Changelist filters for deliveries (SPEC section 8). None of them counts rows per option."""

from __future__ import annotations

import uuid

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.db.models import Q, QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest

from buzz_delivery.models import CREATED_FLOOR, Community, WorkflowAgentDelivery

# Communities are few; the filter still lists at most this many (by name). Any community can
# be filtered on through the URL (``?community=<uuid>``) or the link on a community's page.
COMMUNITY_CHOICES_LIMIT = 50


def lease_expired_q() -> Q:
    """Claimed with ``lease_until`` before the database clock's ``now()``."""
    return Q(status="claimed", lease_until__lt=Now())


class CommunityFilter(admin.SimpleListFilter):
    """By community: one query over the community table, no COUNT per option."""

    title = "community"
    parameter_name = "community"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        rows = Community.objects.order_by("name", "id").values_list("id", "name", "deletion_state")
        return [
            (str(pk), f"{name or pk}" + ("" if state == "active" else f" ({state})"))
            for pk, name, state in rows[:COMMUNITY_CHOICES_LIMIT]
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        if not value:
            return queryset
        try:
            return queryset.filter(community_id=uuid.UUID(value))
        except ValueError:
            raise IncorrectLookupParameters(f"community: {value!r} is not a UUID") from None


class LeaseExpiredFilter(admin.SimpleListFilter):
    """Claimed deliveries whose lease ran out (database clock) and that no reaper has returned
    yet (``yes``), or whose lease is still running (``no``). Served by the claimed-lease index."""

    title = "lease expired"
    parameter_name = "lease_expired"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("yes", "Expired, not yet reaped"), ("no", "Running")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if self.value() == "yes":
            return queryset.filter(lease_expired_q())
        if self.value() == "no":
            return queryset.filter(status="claimed", lease_until__gte=Now())
        return queryset


# The codes the system itself writes (reaper, TTL, operator action); handlers add their own.
SYSTEM_FAILURE_CODES = ("attempts_exhausted", "delivery_expired", "operator_force_failed")
# The filter also offers the codes found among this many newest deliveries (one bounded read
# of delivery_created_idx; a code seen only further back is still filterable by URL).
RECENT_FAILURE_SCAN = 5000


class FailureCodeFilter(admin.SimpleListFilter):
    """By failure code: the system's own codes and those of the newest deliveries, no COUNT and
    no ``DISTINCT`` over the table; any code works through the URL (``?failure_code=...``)."""

    title = "failure code"
    parameter_name = "failure_code"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        newest = (
            WorkflowAgentDelivery.objects.filter(created_at__gt=CREATED_FLOOR)  # the index's predicate
            .order_by("-created_at")
            .values("failure_code")[:RECENT_FAILURE_SCAN]
        )
        recent = {row["failure_code"] for row in newest if row["failure_code"]}
        codes = sorted(set(SYSTEM_FAILURE_CODES) | recent)
        value = self.value()
        if value and value not in codes:
            codes.append(value)
        return [(code, code) for code in codes]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        return queryset.filter(failure_code=value) if value else queryset
