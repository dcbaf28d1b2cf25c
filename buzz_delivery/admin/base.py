"""The common frame of every buzz_delivery ModelAdmin (SPEC section 8).

Read-only: no add, no change form that saves, no delete. Rows change state only through
:mod:`buzz_delivery.services`, called by admin actions. Lists never count the whole table
(:class:`~buzz_delivery.admin.paginators.EstimatedCountPaginator`, no full result count, no
facets). Actions end with :func:`report`, which tells the operator how many rows were done
and how many were skipped and why, writes ``LogEntry`` rows and logs through Python logging.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.models import CHANGE, LogEntry
from django.db.models import DateTimeField, Model
from django.http import HttpRequest

from buzz_delivery.admin.display import timestamp
from buzz_delivery.admin.paginators import EstimatedCountPaginator

logger = logging.getLogger("buzz_delivery.admin")

# An action touches at most this many rows; a bigger selection is refused as a whole.
MAX_ACTION_ROWS = 1000


def timestamp_column(field: DateTimeField) -> Callable[[Model], str]:
    """A list column showing ``field`` as ``YYYY-MM-DD HH:MM:SS``, sortable by it."""

    @admin.display(description=field.verbose_name, ordering=field.name)
    def column(obj: Model) -> str:
        return timestamp(getattr(obj, field.attname))

    column.__name__ = field.name
    return column


class ReadOnlyAdmin(admin.ModelAdmin):
    """View-only ModelAdmin for tables that can hold millions of rows.

    Every date-time field named in ``list_display`` is shown as ``YYYY-MM-DD HH:MM:SS`` (local
    time, with seconds), like the lists' own time columns, instead of the locale's format."""

    paginator = EstimatedCountPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    list_per_page = 100
    list_max_show_all = 500

    def get_list_display(self, request: HttpRequest) -> list[Any]:
        fields = {f.name: f for f in self.model._meta.concrete_fields if isinstance(f, DateTimeField)}
        return [
            timestamp_column(fields[name]) if isinstance(name, str) and name in fields else name
            for name in super().get_list_display(request)
        ]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # False makes Django render the detail page read-only and refuse any POST to it;
        # viewing needs the model's ``view`` (or ``change``) permission as usual.
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def too_many(model_admin: admin.ModelAdmin, request: HttpRequest, rows: list[Any], verb: str) -> bool:
    """Refuse (with a message) a selection larger than :data:`MAX_ACTION_ROWS`."""
    if len(rows) <= MAX_ACTION_ROWS:
        return False
    model_admin.message_user(
        request,
        f"Nothing {verb}: select at most {MAX_ACTION_ROWS} rows for one action (narrow the filter).",
        messages.ERROR,
    )
    return True


def report(
    model_admin: admin.ModelAdmin,
    request: HttpRequest,
    *,
    verb: str,
    done: Iterable[Model],
    skipped: Counter[str],
    change_message: str,
) -> None:
    """Tell the operator what an action did, log a ``LogEntry`` (CHANGE) for every row it
    changed, and log one line to the ``buzz_delivery.admin`` logger."""
    done = list(done)
    if done:
        LogEntry.objects.log_actions(
            user_id=request.user.pk,  # type: ignore[arg-type]
            queryset=done,
            action_flag=CHANGE,
            change_message=change_message,
        )
    noun = model_admin.opts.verbose_name if len(done) == 1 else model_admin.opts.verbose_name_plural
    parts = [f"{verb.capitalize()} {len(done)} {noun}."]
    if skipped:
        reasons = "; ".join(f"{count} {reason}" for reason, count in skipped.most_common())
        parts.append(f"Skipped {sum(skipped.values())}: {reasons}.")
    level = messages.SUCCESS if done and not skipped else messages.WARNING if done else messages.ERROR
    if not done and not skipped:
        level = messages.INFO
    model_admin.message_user(request, " ".join(parts), level)
    logger.info(
        "admin %s: user=%s %s done=%d skipped=%s",
        change_message,
        request.user.get_username(),
        model_admin.opts.label,
        len(done),
        dict(skipped),
    )
