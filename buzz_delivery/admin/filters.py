"""Changelist filters for deliveries (SPEC section 8). None of them counts rows per option."""

from __future__ import annotations

import uuid

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.db.models import Q, QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest

from buzz_delivery.models import (
    CREATED_FLOOR,
    LIVE_STATUSES,
    Community,
    DeliveryQueue,
    WorkflowAgentDelivery,
)

# Communities are few; the filter still lists at most this many (by name). Any community can
# be filtered on through the URL (``?community=<uuid>``) or the link on a community's page.
COMMUNITY_CHOICES_LIMIT = 50
# The statuses a queue row holds (issue 31, stage 2); the others are the record's.
LIVE_VALUES = tuple(str(s) for s in LIVE_STATUSES)


def lease_expired_q() -> Q:
    """Claimed with ``lease_until`` before the database clock's ``now()``."""
    return Q(status="claimed", lease_until__lt=Now())


def _live(**state: object) -> Q:
    """The deliveries whose queue row (the live state, issue 31 stage 2) matches ``state``: ids
    read from ``buzz_delivery_delivery_queue`` alone, not the view's merged status (a ``CASE``
    over the LEFT JOIN, which the planner can only test after probing the queue for every row it
    walks, ``bench/results/queue-design-plan.md`` 2.4). Measured at 200k rows
    (``bench/admin_changelist.py``'s mix; best of 3, load 5): pending 18 -> 4.5 ms, lease expired
    111 -> 14 ms, claimed 73 -> 62 ms."""
    return Q(pk__in=DeliveryQueue.objects.filter(**state).values("id"))


def by_state(
    queryset: QuerySet, *, status: str | None = None, failure_code: str | None = None, lease: str | None = None
) -> QuerySet:
    """Deliveries narrowed by their state, the one way the changelist's state filters narrow
    them: ``status``, ``failure_code``, ``lease`` (``"expired"``: claimed, its lease past the
    database clock and not yet reaped; ``"running"``: claimed, its lease still running).

    The live states (pending, claimed, a lease) are read from the queue (:func:`_live`). A
    terminal status stays the view's: the record owns it (a terminal delivery has no queue row),
    but the view hides the record's own column behind the merged one, and testing it by id
    (``id IN`` the record's rows of that status) probes the record's large primary key for each
    walked row where the view probes the small queue's (measured at 200k rows: failed 41 -> 67
    ms, expired 90 -> 158 ms); stage 3 gives the terminals their own table and age index. The
    failure code is the record's own column (the view passes it through: its index serves the
    filter)."""
    if status in LIVE_VALUES:
        queryset = queryset.filter(_live(status=status))
    elif status:
        queryset = queryset.filter(status=status)
    if failure_code:
        queryset = queryset.filter(failure_code=failure_code)
    if lease == "expired":
        queryset = queryset.filter(_live(status="claimed", lease_until__lt=Now()))
    elif lease == "running":
        queryset = queryset.filter(_live(status="claimed", lease_until__gte=Now()))
    return queryset


class StatusFilter(admin.ChoicesFieldListFilter):
    """By status (Django's choices filter: its links and ``?status__exact=`` as before), through
    :func:`by_state`."""

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        values = self.used_parameters.get(self.lookup_kwarg)
        if set(self.used_parameters) == {self.lookup_kwarg} and isinstance(values, list) and len(values) == 1:
            return by_state(queryset, status=values[0])
        narrowed = super().queryset(request, queryset)  # no status, or a hand-made URL's several
        return queryset if narrowed is None else narrowed


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
            return by_state(queryset, lease="expired")
        if self.value() == "no":
            return by_state(queryset, lease="running")
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
        return by_state(queryset, failure_code=value) if value else queryset
