"""Admin screens of the gateway: enrollments (read-only list, a "Revoke" action) and the replay
store (read-only). Enrolling is done with ``manage.py gateway_enrollment enroll`` (a key is
64 hex characters an operator pastes once; a command leaves a record in the shell history and
the JSON output). Every change goes through :mod:`buzz_delivery.gateway.services`.
"""

from __future__ import annotations

from collections import Counter

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from buzz_delivery.admin import display
from buzz_delivery.admin.base import ReadOnlyAdmin, report, too_many
from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.gateway import services
from buzz_delivery.gateway.models import Enrollment, SeenEvent


@admin.register(Enrollment)
class EnrollmentAdmin(ReadOnlyAdmin):
    list_display = ("agent_hex", "community", "enrolled_at", "enrolled_by", "revoked_at")
    list_select_related = ("community",)
    ordering = ("-enrolled_at",)
    fields = ("id", "community", "agent_key", "enrolled_at", "enrolled_by", "revoked_at")
    readonly_fields = fields
    actions = ("revoke",)
    search_help_text = "Agent key hex prefix."
    search_fields = ("enrolled_by",)

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
        term = search_term.strip().lower()
        if len(term) == 64:
            try:
                return queryset.filter(agent_pubkey=bytes.fromhex(term)), False
            except ValueError:
                pass
        return super().get_search_results(request, queryset, search_term)

    @admin.display(description="agent key")
    def agent_hex(self, obj: Enrollment) -> str:
        """First 8 and last 4 hex characters, the whole key as tooltip (the detail page's in full)."""
        return display.holder(obj.agent_hex)

    @admin.display(description="agent public key")
    def agent_key(self, obj: Enrollment) -> str:
        return obj.agent_hex

    @admin.action(description="Revoke the selected enrollments", permissions=["revoke"])
    def revoke(self, request: HttpRequest, queryset: QuerySet) -> None:
        rows = list(queryset[:1001])
        if too_many(self, request, rows, "revoked"):
            return
        done, skipped = [], Counter[str]()
        for row in rows:
            try:
                outcome = services.revoke(row.community_id, bytes(row.agent_pubkey))
            except CommunityNotWritable:
                skipped["the community is not active"] += 1
                continue
            if outcome.revoked:
                done.append(row)
            else:
                skipped["already revoked"] += 1
        report(self, request, verb="revoked", done=done, skipped=skipped, change_message="Revoked enrollment")

    def has_revoke_permission(self, request: HttpRequest) -> bool:
        """Revoking needs the model's ``change`` permission (the list itself stays read-only)."""
        return request.user.has_perm("buzz_gateway.change_enrollment")


@admin.register(SeenEvent)
class SeenEventAdmin(ReadOnlyAdmin):
    """The replay store: a list only. Its key is the raw 32-byte event id, which Django's admin
    puts in a change link as a Python ``b'...'`` repr that no page resolves (each row led to "seen
    event ... doesn't exist"); the list shows every column there is, so rows link nowhere."""

    list_display = ("event_hex", "agent_hex", "created_at", "seen_at")
    list_display_links = None
    ordering = ("-seen_at",)

    @admin.display(description="event id")
    def event_hex(self, obj: SeenEvent) -> str:
        return display.holder(bytes(obj.event_id).hex())

    @admin.display(description="agent")
    def agent_hex(self, obj: SeenEvent) -> str:
        return display.holder(bytes(obj.pubkey).hex())
