"""A ChangeList for huge tables (SPEC section 8).

- :meth:`SnapshotFreeChangeList.get_queryset` defers the JSON snapshot columns
  (``execution_trace``, ``trigger_context``): list pages and actions never load them.
- :meth:`SnapshotFreeChangeList.date_drilldown` builds the ``date_hierarchy`` links without
  Django's ``SELECT DISTINCT date_trunc(...)`` over the whole (filtered) table: the range comes
  from the first and last value of the indexed date column of the unfiltered table (two index
  endpoint reads, ``ORDER BY ... LIMIT 1``; with the paginator's ``always_true``, the condition
  of a partial index on that column) and every year / month / day inside it is offered, whether or not it holds
  rows. The changelist template renders it with ``admin/date_hierarchy.html``.
"""

from __future__ import annotations

import calendar
import datetime as dt
from typing import Any

from django.contrib.admin.views.main import ChangeList
from django.db.models import JSONField
from django.utils import formats, timezone
from django.utils.text import capfirst

SNAPSHOT_FIELDS = ("execution_trace", "trigger_context", "history")  # large JSON: deferred in lists


class JSONFreeChangeList(ChangeList):
    """Every list of a :class:`~buzz_delivery.admin.base.ReadOnlyAdmin`: neither the model's JSON
    fields nor those of the rows its ``list_select_related`` joins are loaded by a list page or
    an action (a stored value nested too deeply for Python's parser failed the page; issue 27).
    No list column shows a JSON field."""

    def get_queryset(self, request: Any, exclude_parameters: Any = None) -> Any:
        queryset = super().get_queryset(request, exclude_parameters)
        deferred = [f.attname for f in _json_fields(self.model)]
        joined = self.list_select_related if isinstance(self.list_select_related, list | tuple) else ()
        for name in joined:
            target = self.model._meta.get_field(name).related_model
            deferred += [f"{name}__{f.name}" for f in _json_fields(target)]
        return queryset.defer(*deferred) if deferred else queryset


def _json_fields(model: Any) -> list[Any]:
    return [f for f in model._meta.concrete_fields if isinstance(f, JSONField)]


class SnapshotFreeChangeList(JSONFreeChangeList):
    def get_queryset(self, request: Any, exclude_parameters: Any = None) -> Any:
        queryset = super().get_queryset(request, exclude_parameters)
        deferred = [name for name in SNAPSHOT_FIELDS if any(f.name == name for f in self.model._meta.fields)]
        return queryset.defer(*deferred) if deferred else queryset

    def _link(self, **values: int) -> str:
        field = self.date_hierarchy
        params = {f"{field}__{part}": value for part, value in values.items()}
        return self.get_query_string(params, [f"{field}__"])

    def date_drilldown(self) -> dict[str, Any]:
        """Context for ``admin/date_hierarchy.html``: ``show``, ``back``, ``choices``."""
        field = self.date_hierarchy
        if not field:
            return {"show": False}
        year = self.params.get(f"{field}__year")
        month = self.params.get(f"{field}__month")
        day = self.params.get(f"{field}__day")
        try:
            year, month, day = (int(v) if v else None for v in (year, month, day))
        except (TypeError, ValueError):
            return {"show": False}

        if year and month and day:
            date = dt.date(year, month, day)
            return {
                "show": True,
                "back": {"link": self._link(year=year, month=month), "title": _title(date, "YEAR_MONTH_FORMAT")},
                "choices": [{"title": _title(date, "MONTH_DAY_FORMAT")}],
            }
        if year and month:
            days = calendar.monthrange(year, month)[1]
            return {
                "show": True,
                "back": {"link": self._link(year=year), "title": str(year)},
                "choices": [
                    {
                        "link": self._link(year=year, month=month, day=d),
                        "title": _title(dt.date(year, month, d), "MONTH_DAY_FORMAT"),
                    }
                    for d in range(1, days + 1)
                ],
            }
        first, last = self._range()
        if year:
            months = range(1, 13)
            if first and last:
                months = range(first.month if first.year == year else 1, (last.month if last.year == year else 12) + 1)
            return {
                "show": True,
                "back": {"link": self._link(), "title": "All dates"},
                "choices": [
                    {"link": self._link(year=year, month=m), "title": _title(dt.date(year, m, 1), "YEAR_MONTH_FORMAT")}
                    for m in months
                ],
            }
        if not (first and last):
            return {"show": False}
        return {
            "show": True,
            "choices": [{"link": self._link(year=y), "title": str(y)} for y in range(first.year, last.year + 1)],
        }

    def _range(self) -> tuple[dt.datetime | None, dt.datetime | None]:
        rows = self.model._default_manager.all()
        # The condition a partial index on the date column needs (DeliveryPaginator.always_true):
        # without it MIN/MAX scan the whole table instead of reading the index's two ends.
        always_true = getattr(self.model_admin.paginator, "always_true", None)
        if always_true is not None:
            rows = rows.filter(always_true)
        # The two ends as ``ORDER BY ... LIMIT 1`` reads, not MIN/MAX: PostgreSQL reads an
        # index's end for MIN/MAX only over a single table, and the deliveries' list is a view
        # joining the record to the live queue (issue 31, stage 2), where MIN/MAX scan every row.
        column = self.date_hierarchy
        ends = rows.order_by().values_list(column, flat=True)
        first, last = ends.order_by(column).first(), ends.order_by(f"-{column}").first()
        if first is not None and timezone.is_aware(first):
            first, last = timezone.localtime(first), timezone.localtime(last)
        return first, last


def _title(date: dt.date, fmt: str) -> str:
    return capfirst(formats.date_format(date, fmt))
