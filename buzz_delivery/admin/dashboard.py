"""The operators' dashboard (SPEC section 8): a few cheap figures about the delivery table.

Every query is served by a partial index and reads only the rows that matter now:

- ``pending`` / ``claimed`` counts: exact up to :data:`EXACT_CAP`, read from the live queue
  (``buzz_delivery_delivery_queue``, one row per live delivery: issue 31, stage 2); terminal
  counts are the record's, the planner's estimates (marked ``≈``) once the record holds more
  than :data:`EXACT_CAP` rows, exact below that;
- active work per community: pending (capped, the queue's polling index per community) and
  claimed / expired-lease rows (the queue's live rows, bounded by the live deliveries);
- the oldest pending delivery's age, among active communities (the rows a fenced community left
  pending are never claimed: :data:`buzz_delivery.metrics.OLDEST_ACTIVE_PENDING`); leases
  expired but not yet reaped;
- settled deliveries per minute over the last hour (terminal-age index, last hour only);
- workflow runs and agent runs per state (when those apps are installed): exact for a table of
  at most :data:`EXACT_CAP` rows, the planner's estimates above
  (:func:`buzz_delivery.services.stats.counts_by`);
- runs and agent runs started per minute over the last hour: their ids are UUIDv7, so the rows
  of the last hour are one range of the primary key;
- the throughput chart (:mod:`buzz_delivery.admin.chart`): those per-minute series as an SVG
  drawn on the server, no script, no CDN.

All times come from the database clock.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass, field

from django.apps import apps
from django.db import connection
from django.db.models import Count, Model
from django.utils.safestring import SafeString

from buzz_delivery.admin.chart import Series, line_chart
from buzz_delivery.admin.paginators import capped_count, planner_row_estimate, table_row_estimate
from buzz_delivery.metrics import FENCED_WALK, OLDEST_ACTIVE_PENDING
from buzz_delivery.models import TERMINAL_STATUSES, Community, DeliveryRecord
from buzz_delivery.services.sql import (
    COUNT_LAPSED_LEASES,
    COUNT_LIVE_BY_STATUS,
    DB_NOW,
    LIVE_DELIVERIES,
    SETTLE_TALLY,
)
from buzz_delivery.services.stats import counts_by

COMMUNITY = Community._meta.db_table
EXACT_CAP = 100_000
COMMUNITY_ROWS = 50

STATUS_COUNTS = f"""
SELECT
    ({COUNT_LIVE_BY_STATUS["pending"]}),
    ({COUNT_LIVE_BY_STATUS["claimed"]}),
    ({COUNT_LAPSED_LEASES}),
    -- the queue's age index, walked past the rows fenced communities left pending
    (SELECT timezone('UTC', {DB_NOW}) - o.at FROM ({OLDEST_ACTIVE_PENDING}) AS o),
    {DB_NOW}
"""

PER_COMMUNITY = f"""
SELECT c.id, c.name, c.deletion_state,
       (SELECT count(*) FROM (
            SELECT 1 FROM {LIVE_DELIVERIES} AS d
            WHERE d.community_id = c.id AND d.status = 'pending' LIMIT %(cap)s) AS p) AS pending,
       coalesce(l.claimed, 0), coalesce(l.lapsed, 0)
FROM {COMMUNITY} AS c
LEFT JOIN (
    SELECT d.community_id, count(*) AS claimed, count(*) FILTER (WHERE d.lease_until < {DB_NOW}) AS lapsed
    FROM {LIVE_DELIVERIES} AS d WHERE d.status = 'claimed' GROUP BY d.community_id
) AS l ON l.community_id = c.id
ORDER BY c.name, c.id
LIMIT %(rows)s
"""

# Deliveries that reached each terminal status, per minute of the last hour (database clock): the
# settle tally's rows (one per settling statement and status, n its deliveries; core migration
# 0039), one probe of its key (community, at) per community.
SETTLED_PER_MINUTE = f"""
SELECT date_trunc('minute', t.at) AS minute, t.status, sum(t.n)::bigint
FROM {COMMUNITY} AS c
CROSS JOIN LATERAL (
    SELECT s.at, s.status, s.n FROM {SETTLE_TALLY} AS s
    WHERE s.community_id = c.id AND s.at >= {DB_NOW} - interval '1 hour' AND s.at <= {DB_NOW}
) AS t
GROUP BY 1, 2
ORDER BY 1
"""


# Rows of a UUIDv7-keyed table created since %(since)s, per minute: the id range bounds the scan
# to the last hour's rows (primary key, id first); created_at keeps a non-v7 id out.
STARTED_PER_MINUTE = """
SELECT date_trunc('minute', created_at), count(*)
FROM {table}
WHERE {pk} >= %(floor)s AND created_at >= %(since)s
GROUP BY 1
"""


def uuid7_floor(instant: dt.datetime) -> uuid.UUID:
    """The smallest UUIDv7 of ``instant``'s millisecond: every v7 id made from then on sorts after it."""
    return uuid.UUID(int=int(instant.timestamp() * 1000) << 80)


@dataclass
class StateCounts:
    """Rows of one table per state (estimates when ``estimated``)."""

    title: str
    counts: dict[str, int]
    estimated: bool
    changelist_url: str = ""


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
    # Workflow runs and agent runs per state (installed apps only).
    states: list[StateCounts] = field(default_factory=list)
    # Per minute of the last hour, oldest first: series name -> counts (60 values).
    throughput: dict[str, list[int]] = field(default_factory=dict)

    def chart(self) -> SafeString:
        """The throughput of the last hour as an inline SVG line chart."""
        end = self.now.replace(second=0, microsecond=0)
        return line_chart(
            [Series(name, values) for name, values in self.throughput.items()],
            first_minute=end - dt.timedelta(minutes=HOUR_MINUTES - 1),
            title="Throughput per minute, last hour",
        )

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


HOUR_MINUTES = 60


def _per_minute(rows: list[tuple[dt.datetime, int]], first_minute: dt.datetime) -> list[int]:
    """60 counts, one per minute from ``first_minute`` on (0 where no row)."""
    values = [0] * HOUR_MINUTES
    for minute, n in rows:
        index = int((minute - first_minute).total_seconds() // 60)
        if 0 <= index < HOUR_MINUTES:
            values[index] += n
    return values


def _started_per_minute(model: type[Model], pk_column: str, now: dt.datetime) -> list[tuple[dt.datetime, int]]:
    since = now - dt.timedelta(hours=1)
    statement = STARTED_PER_MINUTE.format(table=connection.ops.quote_name(model._meta.db_table), pk=pk_column)
    with connection.cursor() as cursor:
        cursor.execute(statement, {"floor": uuid7_floor(since), "since": since})
        return cursor.fetchall()


def _other_layers(now: dt.datetime, first_minute: dt.datetime) -> tuple[list[StateCounts], dict[str, list[int]]]:
    """Workflow runs and agent runs per state, and started per minute (installed apps only)."""
    from django.urls import reverse

    states: list[StateCounts] = []
    throughput: dict[str, list[int]] = {}
    layers: list[tuple[str, str, str, str, str]] = []
    if apps.is_installed("buzz_delivery.workflows"):
        layers.append(("buzz_workflows", "Run", "Workflow runs", "run_id", "workflow runs started"))
    if apps.is_installed("buzz_delivery.agents"):
        layers.append(("buzz_agents", "AgentRun", "Agent runs", "id", "agent runs started"))
    for app_label, model_name, title, pk_column, series in layers:
        model = apps.get_model(app_label, model_name)
        values = [value for value, _ in model._meta.get_field("state").choices]
        counts, estimated = counts_by(model, "state", values, cap=EXACT_CAP)
        url = reverse(f"admin:{app_label}_{model._meta.model_name}_changelist")
        states.append(StateCounts(title, counts, estimated, url))
        throughput[series] = _per_minute(_started_per_minute(model, pk_column, now), first_minute)
    return states, throughput


def load_dashboard() -> Dashboard:
    """Read the figures: five or six statements for the deliveries (an ``EXPLAIN`` per terminal
    status on a big table), three or four more per installed layer (workflow runs, agent runs)."""
    with connection.cursor() as cursor:
        cursor.execute(STATUS_COUNTS, {"cap": EXACT_CAP + 1, "walk": FENCED_WALK})
        pending, claimed, lapsed, oldest, now = cursor.fetchone()
        cursor.execute(PER_COMMUNITY, {"cap": EXACT_CAP + 1, "rows": COMMUNITY_ROWS})
        communities = [CommunityLoad(str(row[0]), row[1], *row[2:]) for row in cursor.fetchall()]
        cursor.execute(SETTLED_PER_MINUTE)
        buckets: dict[dt.datetime, dict[str, int]] = {}
        for minute, status, count in cursor.fetchall():
            buckets.setdefault(minute, {})[status] = count
    # Terminal counts are the record's (issue 31, stage 2: a live delivery's record says
    # 'pending', its queue row the truth, counted above): its own size and statistics.
    size = table_row_estimate(DeliveryRecord)
    if size is None:  # never analysed: count, but stop past the cap
        size = capped_count(DeliveryRecord.objects.all(), EXACT_CAP)
    estimated = size > EXACT_CAP
    if estimated:
        terminal = {
            status.value: planner_row_estimate(DeliveryRecord.objects.filter(status=status.value))
            for status in TERMINAL_STATUSES
        }
    else:  # a small table: exact counts are cheap
        terminal = {status.value: 0 for status in TERMINAL_STATUSES}
        rows = (
            DeliveryRecord.objects.filter(status__in=list(terminal))
            .order_by()
            .values_list("status")
            .annotate(n=Count("pk"))
        )
        terminal.update(dict(rows))
    first_minute = now.replace(second=0, microsecond=0) - dt.timedelta(minutes=HOUR_MINUTES - 1)
    settled = _per_minute([(minute, sum(counts.values())) for minute, counts in buckets.items()], first_minute)
    states, throughput = _other_layers(now, first_minute)
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
        states=states,
        throughput={"deliveries settled": settled, **throughput},
    )
