"""The common frame of every buzz_delivery ModelAdmin (SPEC section 8).

Read-only: no add, no change form that saves, no delete. Rows change state only through
:mod:`buzz_delivery.services`, called by admin actions. Lists never count the whole table
(:class:`~buzz_delivery.admin.paginators.EstimatedCountPaginator`, no full result count, no
facets). Actions end with :func:`report`, which tells the operator how many rows were done
and how many were skipped and why, writes ``LogEntry`` rows and logs through Python logging.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.admin.views.main import ERROR_FLAG
from django.core.exceptions import ValidationError
from django.db.models import DateTimeField, Field, ForeignObject, JSONField, Model, TextField
from django.db.models.functions import Cast, Left, Length
from django.http import HttpRequest, HttpResponseRedirect

from buzz_delivery.admin import display
from buzz_delivery.admin.changelist import JSONFreeChangeList
from buzz_delivery.admin.display import timestamp
from buzz_delivery.admin.filters import CommunityFilter
from buzz_delivery.admin.paginators import EstimatedCountPaginator

logger = logging.getLogger("buzz_delivery.admin")

# An action touches at most this many rows; a bigger selection is refused as a whole.
MAX_ACTION_ROWS = 1000


@functools.cache
def timestamp_column(field: DateTimeField) -> Callable[[Model], str]:
    """A column (or detail line) showing ``field`` as ``YYYY-MM-DD HH:MM:SS``, sortable by it.
    One function per field, so a detail page's fieldsets and read-only fields name the same one."""

    @admin.display(description=field.verbose_name, ordering=field.name)
    def column(obj: Model) -> str:
        return timestamp(getattr(obj, field.attname))

    column.__name__ = field.name
    return column


# The annotations a detail page reads a JSON field's stored text from (ReadOnlyAdmin.get_object).
JSON_TEXT = "bd_json_text_{}"
JSON_CHARS = "bd_json_chars_{}"


@functools.cache
def json_column(field: JSONField) -> Callable[[Model], str]:
    """A detail line showing JSON ``field`` bounded (:func:`display.json_text`): from the text
    the database rendered when :meth:`ReadOnlyAdmin.get_object` loaded the row so, else from
    the loaded value."""

    @admin.display(description=field.verbose_name)
    def column(obj: Model) -> str:
        if hasattr(obj, JSON_TEXT.format(field.attname)):
            return display.json_text(
                getattr(obj, JSON_TEXT.format(field.attname)), getattr(obj, JSON_CHARS.format(field.attname))
            )
        return display.pretty_json(getattr(obj, field.attname))

    column.__name__ = field.name
    return column


def _shown(model: type[Model], name: Any) -> Any:
    """What a detail page shows for ``name``: a date-time or JSON field through its column."""
    if isinstance(name, list | tuple):
        return type(name)(_shown(model, inner) for inner in name)
    if not isinstance(name, str):
        return name
    try:
        field = model._meta.get_field(name)
    except Exception:  # an admin method's name
        return name
    if isinstance(field, DateTimeField) and field.concrete:
        return timestamp_column(field)
    if isinstance(field, JSONField):
        return json_column(field)
    return name


def json_fields(model: type[Model]) -> list[Field]:
    return [f for f in model._meta.concrete_fields if isinstance(f, JSONField)]


def _cache_related_without_json(obj: Model) -> None:
    """Load the rows ``obj`` points to (shown as links on its page) without their JSON fields,
    so a related row's stored value cannot fail this page either; what they show (``__str__``)
    reads none (issue 27)."""
    for field in obj._meta.concrete_fields:
        target = field.related_model if field.is_relation else None
        if target is None or isinstance(target, str) or getattr(obj, field.attname) is None:
            continue
        assert isinstance(field, ForeignObject), field  # a concrete relation: a ForeignKey or OneToOneField
        heavy = [f.name for f in json_fields(target)]
        if heavy and not field.is_cached(obj):
            related = target._base_manager.defer(*heavy).filter(pk=getattr(obj, field.attname)).first()
            field.set_cached_value(obj, related)


class ReadOnlyAdmin(admin.ModelAdmin):
    """View-only ModelAdmin for tables that can hold millions of rows.

    Every date-time field, in lists and on detail pages, is ``YYYY-MM-DD HH:MM:SS`` in the current
    time zone (:func:`display.timestamp`), which each page states once under its title; every
    JSON field of a detail page is read as the text the database renders, at most
    :data:`display.JSON_MAX_CHARS` characters of it, and shown indented (:func:`display.json_text`):
    a stored value nested a thousand deep or a megabyte large renders, cut, with a note.
    A community-scoped model's list has the community filter."""

    paginator = EstimatedCountPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    list_per_page = 100
    list_max_show_all = 500
    change_list_template = "admin/buzz_delivery/bd_change_list.html"
    change_form_template = "admin/buzz_delivery/bd_change_form.html"

    def get_list_display(self, request: HttpRequest) -> list[Any]:
        fields = {f.name: f for f in self.model._meta.concrete_fields if isinstance(f, DateTimeField)}
        return [
            timestamp_column(fields[name]) if isinstance(name, str) and name in fields else name
            for name in super().get_list_display(request)
        ]

    def get_list_filter(self, request: HttpRequest) -> list[Any]:
        filters = list(super().get_list_filter(request))
        scoped = any(f.name == "community" for f in self.model._meta.concrete_fields)
        if scoped and CommunityFilter not in filters:
            filters.append(CommunityFilter)
        return filters

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        return [
            (title, {**options, "fields": _shown(self.model, list(options["fields"]))})
            for title, options in super().get_fieldsets(request, obj)
        ]

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        """The row of a detail page, its JSON fields not loaded but annotated with their text as
        the database renders it (cut at :data:`display.JSON_MAX_CHARS` + 1 characters) and its
        length: no value, however deep or large, goes through Python's recursive parser whole."""
        queryset = self.get_queryset(request)
        model = queryset.model
        names = [f.attname for f in json_fields(model)]
        if names:
            queryset = queryset.defer(*names).annotate(
                **{JSON_TEXT.format(n): Left(Cast(n, TextField()), display.JSON_MAX_CHARS + 1) for n in names},
                **{JSON_CHARS.format(n): Length(Cast(n, TextField())) for n in names},
            )
        field = model._meta.pk if from_field is None else model._meta.get_field(from_field)
        try:
            value = field.to_python(object_id)
            if isinstance(value, str) and "\x00" in value:  # PostgreSQL text cannot hold it: no such row
                return None
            obj = queryset.get(**{field.name: value})
        except (model.DoesNotExist, ValidationError, ValueError):
            return None
        _cache_related_without_json(obj)
        return obj

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type:
        return JSONFreeChangeList

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> Any:
        """Django's, except that a query string holding a NUL (which PostgreSQL text cannot hold)
        is treated as a bad lookup (Django's ``?e=1`` page), not sent to the database (issue 27)."""
        if any("\x00" in key or any("\x00" in v for v in values) for key, values in request.GET.lists()):
            return HttpResponseRedirect(f"{request.path}?{ERROR_FLAG}=1")
        return super().changelist_view(request, extra_context)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> Any:
        extra = {"buzz_refresh_seconds": self.refresh_seconds(request, object_id), **(extra_context or {})}
        return super().change_view(request, object_id, form_url, extra)

    def refresh_seconds(self, request: HttpRequest, object_id: str) -> int | None:
        """Seconds after which the detail page reloads itself (a live run), or None."""
        return None

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
