"""The operators' dashboard (SPEC section 8): a few cheap figures about the delivery table.

Every query is served by a partial index and reads only the rows that matter now:

- ``pending`` / ``claimed`` counts: exact up to :data:`EXACT_CAP`, via the polling and
  claimed-lease partial indexes; terminal counts are the planner's estimates (marked ``≈``)
  once the table holds more than :data:`EXACT_CAP` rows, exact below that;
- active work per community: pending (capped, polling index per community) and claimed /
  expired-lease rows (claimed-lease index, bounded by the number of live leases);
- the oldest pending delivery's age; leases expired but not yet reaped;
- settled deliveries per minute over the last hour (terminal-age index, last hour only).

All times come from the database clock.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from django.db import connection
from django.db.models import Count

from buzz_delivery.admin.paginators import capped_count, planner_row_estimate, table_row_estimate
from buzz_delivery.models import TERMINAL_STATUSES, Community, WorkflowAgentDelivery

DELIVERY = WorkflowAgentDelivery._meta.db_table
COMMUNITY = Community._meta.db_table
EXACT_CAP = 100_000
COMMUNITY_ROWS = 50

STATUS_COUNTS = f"""
SELECT
    (SELECT count(*) FROM (SELECT 1 FROM {DELIVERY} WHERE status = 'pending' LIMIT %(cap)s) AS p),
    (SELECT count(*) FROM (SELECT 1 FROM {DELIVERY} WHERE status = 'claimed' LIMIT %(cap)s) AS c),
    (SELECT count(*) FROM {DELIVERY} WHERE status = 'claimed' AND lease_until < now()),
    (SELECT now() - min(created_at) FROM {DELIVERY} WHERE status = 'pending'),
    now()
"""

PER_COMMUNITY = f"""
SELECT c.id, c.name, c.deletion_state,
       (SELECT count(*) FROM (
            SELECT 1 FROM {DELIVERY} AS d
            WHERE d.community_id = c.id AND d.status = 'pending' LIMIT %(cap)s) AS p) AS pending,
       coalesce(l.claimed, 0), coalesce(l.lapsed, 0)
FROM {COMMUNITY} AS c
LEFT JOIN (
    SELECT d.community_id, count(*) AS claimed, count(*) FILTER (WHERE d.lease_until < now()) AS lapsed
    FROM {DELIVERY} AS d WHERE d.status = 'claimed' GROUP BY d.community_id
) AS l ON l.community_id = c.id
ORDER BY c.name, c.id
LIMIT %(rows)s
"""

SETTLED_PER_MINUTE = f"""
SELECT date_trunc('minute', finished_at) AS minute, status, count(*)
FROM {DELIVERY}
WHERE status IN ('finished', 'failed', 'expired') AND finished_at >= now() - interval '1 hour'
GROUP BY 1, 2
ORDER BY 1
"""


@dataclass
class CommunityLoad:
    """Active work of one community."""

    id: str
    name: str
    deletion_state: str
    pending: int
    claimed: int
    lapsed: int


@dataclass
class MinuteBucket:
    """Deliveries settled in one minute, per terminal status."""

    minute: dt.datetime
    counts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass
class Dashboard:
    """The dashboard's figures. ``pending``/``claimed`` above :attr:`cap` are capped; ``terminal``
    counts per terminal status are the planner's estimates when ``terminal_estimated``."""

    now: dt.datetime
    pending: int
    claimed: int
    lapsed_leases: int
    oldest_pending_age: dt.timedelta | None
    terminal: dict[str, int]
    terminal_estimated: bool
    communities: list[CommunityLoad] = field(default_factory=list)
    minutes: list[MinuteBucket] = field(default_factory=list)
    cap: int = EXACT_CAP

    @property
    def settled_last_hour(self) -> int:
        return sum(bucket.total for bucket in self.minutes)

    @property
    def settled_per_minute(self) -> float:
        return self.settled_last_hour / 60

    @property
    def busiest_minute(self) -> int:
        return max((bucket.total for bucket in self.minutes), default=0)

    @property
    def oldest_pending_text(self) -> str:
        """The oldest pending delivery's age, e.g. ``"2 h 05 min"``, or ``"none pending"``."""
        if self.oldest_pending_age is None:
            return "none pending"
        seconds = max(int(self.oldest_pending_age.total_seconds()), 0)
        days, rest = divmod(seconds, 86_400)
        hours, rest = divmod(rest, 3600)
        minutes, seconds = divmod(rest, 60)
        if days:
            return f"{days} d {hours:02d} h"
        if hours:
            return f"{hours} h {minutes:02d} min"
        return f"{minutes} min {seconds:02d} s"

    def bars(self) -> list[dict[str, object]]:
        """One row per minute with a settled count: minute, total, per-status counts and the
        bar width in percent of the busiest minute."""
        top = self.busiest_minute or 1
        return [
            {"minute": b.minute, "total": b.total, "counts": b.counts, "percent": round(100 * b.total / top)}
            for b in self.minutes
        ]


def load_dashboard() -> Dashboard:
    """Read the figures: five or six statements (an ``EXPLAIN`` per terminal status on a big table)."""
    with connection.cursor() as cursor:
        cursor.execute(STATUS_COUNTS, {"cap": EXACT_CAP + 1})
        pending, claimed, lapsed, oldest, now = cursor.fetchone()
        cursor.execute(PER_COMMUNITY, {"cap": EXACT_CAP + 1, "rows": COMMUNITY_ROWS})
        communities = [CommunityLoad(str(row[0]), row[1], *row[2:]) for row in cursor.fetchall()]
        cursor.execute(SETTLED_PER_MINUTE)
        buckets: dict[dt.datetime, dict[str, int]] = {}
        for minute, status, count in cursor.fetchall():
            buckets.setdefault(minute, {})[status] = count
    size = table_row_estimate(WorkflowAgentDelivery)
    if size is None:  # never analysed: count, but stop past the cap
        size = capped_count(WorkflowAgentDelivery.objects.all(), EXACT_CAP)
    estimated = size > EXACT_CAP
    if estimated:
        terminal = {
            status.value: planner_row_estimate(WorkflowAgentDelivery.objects.filter(status=status.value))
            for status in TERMINAL_STATUSES
        }
    else:  # a small table: exact counts are cheap
        terminal = {status.value: 0 for status in TERMINAL_STATUSES}
        rows = (
            WorkflowAgentDelivery.objects.filter(status__in=list(terminal))
            .order_by()
            .values_list("status")
            .annotate(n=Count("pk"))
        )
        terminal.update(dict(rows))
    return Dashboard(
        now=now,
        pending=pending,
        claimed=claimed,
        lapsed_leases=lapsed,
        oldest_pending_age=oldest,
        terminal=terminal,
        terminal_estimated=estimated,
        communities=communities,
        minutes=[MinuteBucket(minute, counts) for minute, counts in sorted(buckets.items())],
    )
