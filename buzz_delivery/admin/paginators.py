"""Row counts that stay cheap at millions of rows (SPEC section 8: no exact COUNT over the
whole table).

- Unfiltered list: the planner's table size, ``pg_class.reltuples`` (kept by autovacuum/ANALYZE).
- Filtered list: an exact count capped at :attr:`EstimatedCountPaginator.exact_count_cap`
  rows (``SELECT count(*) FROM (SELECT ... LIMIT cap + 1)``); past the cap, the planner's
  row estimate for the filtered query (``EXPLAIN``), never less than the cap.

Estimated pages past the real end show an empty page; they never error.
"""

from __future__ import annotations

import json

from django.core.paginator import Paginator
from django.db.models import Q, QuerySet
from django.utils.functional import cached_property

from buzz_delivery.services.stats import table_row_estimate


def planner_row_estimate(queryset: QuerySet) -> int:
    """The planner's estimate of how many rows ``queryset`` returns (``EXPLAIN``, nothing run)."""
    plan = json.loads(queryset.order_by().explain(format="json"))
    return int(plan[0]["Plan"]["Plan Rows"])


def capped_count(queryset: QuerySet, cap: int) -> int:
    """``min(count, cap + 1)``: an exact count that stops reading after ``cap + 1`` rows."""
    return queryset.order_by().values("pk")[: cap + 1].count()


class EstimatedCountPaginator(Paginator):
    """A paginator for huge tables: ``count`` never runs an unbounded ``COUNT(*)``.

    Pair it with ``show_full_result_count = False`` on the ModelAdmin (which otherwise counts
    the whole table once more).
    """

    exact_count_cap = 10_000
    # A condition true of every row that the ModelAdmin's queryset always carries (to match a
    # partial index's predicate): a list filtered by it alone still counts as unfiltered.
    always_true: Q | None = None

    def _unfiltered(self, queryset: QuerySet) -> bool:
        where = queryset.query.where
        if not where:
            return True
        return (
            self.always_true is not None and where == queryset.model._base_manager.filter(self.always_true).query.where
        )

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if not isinstance(queryset, QuerySet):
            return len(queryset)
        if self._unfiltered(queryset):
            estimate = table_row_estimate(queryset.model)
            if estimate is not None and estimate > self.exact_count_cap:
                return estimate
        counted = capped_count(queryset, self.exact_count_cap)
        if counted <= self.exact_count_cap:
            return counted
        return max(counted, planner_row_estimate(queryset))
