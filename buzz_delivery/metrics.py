"""Prometheus metrics of the whole system (issue 17), for the monitoring people already run.

:func:`metrics_view` serves the text exposition format (the ``prometheus-client`` library);
mount it where your scraper looks, e.g. ``path("metrics", metrics_view)`` (the example project
serves it at ``/metrics``). Each scrape runs :class:`BuzzCollector`, a custom collector that
reads the database at that moment, cheaply at millions of rows:

- ``buzz_deliveries{status}``, ``buzz_workflow_runs{state}``, ``buzz_workflow_steps{state}``,
  ``buzz_agent_runs{state}``: rows per status. Exact while the table holds at most
  :data:`EXACT_CAP` rows (by ``pg_class.reltuples``, or a count that stops past the cap when
  the table was never analysed); above that the planner's estimate of each status (an
  ``EXPLAIN``, nothing read), flagged by ``buzz_counts_estimated{table} 1``. The deliveries'
  ``pending`` and ``claimed`` are always exact up to the cap, read from the live queue
  (``buzz_delivery_delivery_queue``: issue 31, stage 2); the terminal ones are the record's.
- ``buzz_delivery_oldest_pending_age_seconds``: the oldest pending delivery of an *active*
  community (a walk of the queue's ``delivery_queue_created_idx`` from its oldest end that passes over the rows a
  fenced community left pending, :data:`OLDEST_ACTIVE_PENDING`), so an alert on it clears once the
  active communities' backlog does; ``buzz_delivery_fenced_pending``: the rows left pending in
  communities that are not active (no worker may claim them; the purge removes them), exact up to
  :data:`EXACT_CAP`.
- ``buzz_delivery_lapsed_leases``: claimed deliveries whose lease ran out, not yet reaped
  (bounded by the live deliveries: the queue's rows).
- ``buzz_deliveries_settled_last_minute{status}``: the settle rate, deliveries that reached
  each terminal status in the last 60 s, counted per settle (one probe of the settle tally's key per community: core
  migration 0039, the record's terminal UPDATE counts itself there).
- ``buzz_maintenance_run_active{job}``: 1 while a maintenance run (``reap_deliveries``,
  ``prune_deliveries``, the engine's and agents' reapers) holds its overlap guard;
  ``buzz_maintenance_runs_total{job}``, ``buzz_maintenance_last_run_timestamp_seconds{job}`` and
  ``buzz_maintenance_last_run_ok{job}``: the reaper runs (every pass of those commands, one row
  per job in ``buzz_delivery_maintenance_run``); every job of an installed app has a
  ``buzz_maintenance_runs_total`` (and a reaper a ``buzz_leases_reclaimed_total``) sample, 0
  before its first pass. ``buzz_leases_reclaimed_total{job,outcome}``:
  the lease losses the database saw, the lapsed leases each reaper took back (``retried`` or
  ``exhausted``), and ``buzz_maintenance_items_total{job,item}``: every count of the jobs'
  summaries, both summed over the passes in that row's ``totals`` (migration 0012).
- ``buzz_workers{kind,state}`` and ``buzz_worker_heartbeat_age_seconds{kind,host,pid,name}``:
  the live workers registry (:mod:`buzz_delivery.services.workers`), ``state`` ``live`` or
  ``stale`` (no heartbeat for three intervals); a process silent for longer than
  ``PRUNE_AFTER_SECONDS`` is gone and left out, whether or not the reaper deleted its row yet.

- ``buzz_rate_limit_used{key}``, ``buzz_rate_limit_used_max{key}``,
  ``buzz_rate_limit_communities_at_limit{key}``, ``buzz_rate_limit_limit{key}`` and
  ``buzz_rate_limit_period_seconds{key}``: each declared rate limit key (issue 32,
  docs/flow-control.md): the units used in the current windows of all communities, of the one
  that used the most, how many communities have used theirs up, and the key's declared limit
  and period (the limit holds per community).
- ``buzz_concurrency_limit{kind}``, ``buzz_concurrency_slots_held{kind}``,
  ``buzz_concurrency_slots_held_max{kind}`` and ``buzz_concurrency_keys_at_limit{kind}``: each
  declared concurrency limit (``CONCURRENCY_LIMITS``, docs/flow-control.md): its maximum per key,
  the claimed deliveries holding a slot of that kind (all keys), the most one key holds, and how
  many keys hold every slot (their next deliveries wait).
- ``buzz_agent_concurrency_*{kind}`` and ``buzz_step_concurrency_*{kind}`` (the same four
  families): each declared ``AGENT_CONCURRENCY_LIMITS`` kind over the leased agent runs, and
  each ``STEP_CONCURRENCY_LIMITS`` kind over the running workflow steps.

The optional apps' families appear when those apps are installed. Every figure comes from the
database clock.

Access: open by default, as Prometheus exporters are (the figures are counts, job names and
worker host names: no tenant's data), so a scraper needs no setup; protect it with
``BUZZ_DELIVERY["METRICS_TOKEN"]``: then a request must carry ``Authorization: Bearer <token>``
(Prometheus: ``authorization: {credentials_file: ...}``) or come from a logged-in staff user,
and anything else gets 401. ``manage.py check --deploy`` warns while the token is unset
(``buzz_delivery.W030``).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Iterator
from typing import Any

from django.apps import apps
from django.db import connection
from django.db.models import Model
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from buzz_delivery.conf import raw_settings
from buzz_delivery.models import (
    CREATED_FLOOR_SQL,
    LIVE_STATUSES,
    TERMINAL_STATUSES,
    Community,
    DeliveryQueue,
    DeliveryRecord,
    MaintenanceLease,
    MaintenanceRun,
    WorkerRegistration,
)
from buzz_delivery.services import flow, stats, tenancy
from buzz_delivery.services.ratelimits import declared_rate_limits
from buzz_delivery.services.sql import (
    COUNT_LAPSED_LEASES,
    COUNT_LIVE_BY_STATUS,
    DB_NOW,
    DELIVERY_VIEW,
    LIVE_DELIVERIES,
    SETTLE_TALLY,
)
from buzz_delivery.services.workers import PRUNE_AFTER_SECONDS, STALE_AFTER_SECONDS

# Up to this many rows a table's statuses are counted exactly; above it they are estimated.
EXACT_CAP = stats.EXACT_CAP

DELIVERY = DELIVERY_VIEW
COMMUNITY = Community._meta.db_table

# The UTC creation time of the oldest pending delivery of an active community: the live queue's
# age index (``delivery_queue_created_idx``, on (created_at, id): issue 31, stage 2) walked from its
# oldest end, the claimed rows passed over, each row's community looked up by its
# primary key, the first active one taken. The rows a fenced community left pending (no worker
# may claim them until the purge removes them) are passed over, at most %(walk)s of them; past
# that the oldest walked row stands for the answer (an over-estimate: say so in an alert's
# runbook). Shared by the metrics and the dashboard. The walk orders by ``created_at`` itself
# (the index's order; its UTC wall time sorts the same). The community is looked up by a join on
# its primary key (one row per walked row, as the EXISTS it replaces): Citus refuses a
# correlated subquery whose FROM holds a subquery (issue 30), and plans this join.
_WALK = f"""
    SELECT d.community_id, timezone('UTC', d.created_at) AS at FROM {LIVE_DELIVERIES} AS d
    WHERE d.status = 'pending' AND d.{CREATED_FLOOR_SQL}
    ORDER BY d.created_at LIMIT %(walk)s
"""
OLDEST_ACTIVE_PENDING = f"""
SELECT coalesce(
    (SELECT w.at FROM ({_WALK}) AS w JOIN {COMMUNITY} AS c ON c.id = w.community_id
     WHERE c.deletion_state = 'active'
     ORDER BY w.at LIMIT 1),
    (SELECT CASE WHEN count(*) = %(walk)s THEN max(w.at) END FROM ({_WALK}) AS w)
) AS at
"""
FENCED_WALK = 100_000

# Exact up to the cap, from the live queue; the oldest pending row of an active
# community; lapsed leases; rows pending in fenced communities (the polling index, per community).
DELIVERY_LIVE = f"""
SELECT
    ({COUNT_LIVE_BY_STATUS["pending"]}),
    ({COUNT_LIVE_BY_STATUS["claimed"]}),
    ({COUNT_LAPSED_LEASES}),
    (SELECT greatest(extract(epoch FROM timezone('UTC', statement_timestamp()) - o.at), 0)
     FROM ({OLDEST_ACTIVE_PENDING}) AS o),
    (SELECT count(*) FROM (
        SELECT 1 FROM {COMMUNITY} AS c
        CROSS JOIN LATERAL (
            SELECT 1 FROM {LIVE_DELIVERIES} AS d WHERE d.community_id = c.id AND d.status = 'pending' LIMIT %(cap)s
        ) AS p
        WHERE c.deletion_state <> 'active' LIMIT %(cap)s) AS f)
"""

# Deliveries settled in the last %(seconds)s seconds, per terminal status: one probe of the settle
# tally's primary key (community, at) per community, so it stays bounded by the recent rows
# whatever the tables hold (the tally has a row per settling statement and status, its n the
# deliveries; the record has no index naming its terminal columns: core migration 0039). Bounded
# above too: a row dated ahead (a tenant role may write its community's rows) never stays counted.
SETTLED_RECENTLY = f"""
SELECT d.status, sum(d.n)::bigint
FROM {Community._meta.db_table} AS c
CROSS JOIN LATERAL (
    SELECT t.status, t.n FROM {SETTLE_TALLY} AS t
    WHERE t.community_id = c.id AND t.at >= {DB_NOW} - make_interval(secs => %(seconds)s) AND t.at <= {DB_NOW}
) AS d
GROUP BY d.status
"""
SETTLE_WINDOW_SECONDS = 60

MAINTENANCE = f"SELECT name, lease_until >= {DB_NOW} FROM {MaintenanceLease._meta.db_table}"
MAINTENANCE_RUNS = f"""
SELECT name, runs, last_outcome, extract(epoch FROM last_finished_at), totals FROM {MaintenanceRun._meta.db_table}
"""
# The maintenance jobs each installed app runs (the ``job`` of its command), so each has samples,
# 0, before its first pass; the reapers (True) also take leases back (buzz_leases_reclaimed_total).
JOBS = {
    "buzz_delivery": {"reap_deliveries": True, "prune_deliveries": False},
    "buzz_delivery.workflows": {"reap_workflow_steps": True},
    "buzz_delivery.agents": {"reap_agent_runs": True},
}


def known_jobs() -> dict[str, bool]:
    """The maintenance jobs of the installed apps: name -> whether it is a reaper."""
    jobs: dict[str, bool] = {}
    for app, names in JOBS.items():
        if apps.is_installed(app):
            jobs.update(names)
    return jobs


# Outcomes of a pass that did its job (another run being active counts: the job was done).
GOOD_OUTCOMES = ("ok", "busy", "stopped")

# Processes silent for longer than the prune age are gone, deleted by the reaper or not yet.
WORKERS = f"""
SELECT kind, host, pid, name, extract(epoch FROM {DB_NOW} - last_heartbeat)
FROM {WorkerRegistration._meta.db_table}
WHERE last_heartbeat >= {DB_NOW} - make_interval(secs => %(gone_after)s)
ORDER BY kind, host, pid
"""


class BuzzCollector(Collector):
    """Reads the figures listed in this module's docstring at every scrape."""

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        estimated = GaugeMetricFamily(
            "buzz_counts_estimated",
            "1 when the rows-per-status figures of a table are planner estimates (the table is big), 0 when exact",
            labels=["table"],
        )
        yield from self._deliveries(estimated)
        if apps.is_installed("buzz_delivery.workflows"):
            from buzz_delivery.workflows.models import Run, Step
            from buzz_delivery.workflows.states import RunState, StepState

            yield self._by_state("buzz_workflow_runs", "Workflow runs by state", Run, RunState.values, estimated)
            yield self._by_state("buzz_workflow_steps", "Workflow steps by state", Step, StepState.values, estimated)
        if apps.is_installed("buzz_delivery.agents"):
            from buzz_delivery.agents.models import AgentRun
            from buzz_delivery.agents.states import RunState as AgentRunState

            yield self._by_state("buzz_agent_runs", "Agent runs by state", AgentRun, AgentRunState.values, estimated)
        yield estimated
        yield from self._maintenance()
        yield from self._workers()
        yield from self._rate_limits()
        yield from self._concurrency_limits()

    def _deliveries(self, estimated: GaugeMetricFamily) -> Iterator[GaugeMetricFamily]:
        with connection.cursor() as cursor:
            cursor.execute(DELIVERY_LIVE, {"cap": EXACT_CAP + 1, "walk": FENCED_WALK})
            pending, claimed, lapsed, oldest, fenced = cursor.fetchone()
        # Live counts from the queue, terminal ones from the record (issue 31, stage 2: a live
        # delivery's record says 'pending'); each table's own size and statistics.
        terminal, is_estimate = stats.counts_by(
            DeliveryRecord, "status", [s.value for s in TERMINAL_STATUSES], cap=EXACT_CAP
        )
        counts = {"pending": pending, "claimed": claimed}
        if pending > EXACT_CAP or claimed > EXACT_CAP:
            live, _ = stats.counts_by(DeliveryQueue, "status", [s.value for s in LIVE_STATUSES], cap=EXACT_CAP)
            counts = {status: n if n <= EXACT_CAP else live[status] for status, n in counts.items()}
            is_estimate = True
        counts.update({s.value: terminal[s.value] for s in TERMINAL_STATUSES})
        family = GaugeMetricFamily("buzz_deliveries", "Deliveries by status", labels=["status"])
        for status, n in counts.items():
            family.add_metric([status], n)
        estimated.add_metric([DELIVERY], int(is_estimate))
        yield family
        yield GaugeMetricFamily(
            "buzz_delivery_oldest_pending_age_seconds",
            "Age of the oldest pending delivery of an active community (database clock); 0 when none is pending",
            value=float(oldest or 0),
        )
        yield GaugeMetricFamily(
            "buzz_delivery_fenced_pending",
            "Deliveries left pending in communities that are not active (never claimed; the purge removes them)",
            value=fenced,
        )
        yield GaugeMetricFamily(
            "buzz_delivery_lapsed_leases", "Claimed deliveries whose lease ran out, not yet reaped", value=lapsed
        )
        with connection.cursor() as cursor:
            cursor.execute(SETTLED_RECENTLY, {"seconds": SETTLE_WINDOW_SECONDS})
            settled = dict(cursor.fetchall())
        recent = GaugeMetricFamily(
            "buzz_deliveries_settled_last_minute",
            f"Deliveries that reached each terminal status in the last {SETTLE_WINDOW_SECONDS} s (database clock)",
            labels=["status"],
        )
        for status in ("finished", "failed", "expired"):
            recent.add_metric([status], settled.get(status, 0))
        yield recent

    @staticmethod
    def _by_state(
        name: str, documentation: str, model: type[Model], values: list[Any], estimated: GaugeMetricFamily
    ) -> GaugeMetricFamily:
        counts, is_estimate = stats.counts_by(model, "state", values, cap=EXACT_CAP)
        family = GaugeMetricFamily(name, documentation, labels=["state"])
        for state, n in counts.items():
            family.add_metric([state], n)
        estimated.add_metric([model._meta.db_table], int(is_estimate))
        return family

    @staticmethod
    def _maintenance() -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        family = GaugeMetricFamily(
            "buzz_maintenance_run_active", "1 while a maintenance run holds its overlap guard", labels=["job"]
        )
        with connection.cursor() as cursor:
            cursor.execute(MAINTENANCE)
            for job, active in cursor.fetchall():
                family.add_metric([job], int(active))
            cursor.execute(MAINTENANCE_RUNS)
            runs = cursor.fetchall()
        yield family
        total = CounterMetricFamily(
            "buzz_maintenance_runs", "Passes of each maintenance job (dry runs excepted)", labels=["job"]
        )
        last = GaugeMetricFamily(
            "buzz_maintenance_last_run_timestamp_seconds",
            "When the last pass of each maintenance job ended (Unix time, database clock)",
            labels=["job"],
        )
        good = GaugeMetricFamily(
            "buzz_maintenance_last_run_ok",
            "1 when the last pass of the job ended ok, busy (another run did it) or stopped; 0 on an error",
            labels=["job"],
        )
        lost = CounterMetricFamily(
            "buzz_leases_reclaimed",
            "Lapsed leases each reaper took back from a holder that stopped renewing (lease losses seen by the "
            "database), by what became of the work: retried (back to pending/ready) or exhausted (failed)",
            labels=["job", "outcome"],
        )
        items = CounterMetricFamily(
            "buzz_maintenance_items",
            "Each count of the maintenance jobs' summaries (reclaimed, expired, deleted...), summed over their passes",
            labels=["job", "item"],
        )
        jobs = known_jobs()
        for job in sorted(set(jobs) - {row[0] for row in runs}):  # no pass yet: zero samples
            total.add_metric([job], 0)
            if jobs[job]:
                lost.add_metric([job, "retried"], 0)
                lost.add_metric([job, "exhausted"], 0)
        for job, count, outcome, finished, totals in runs:
            total.add_metric([job], count)
            last.add_metric([job], float(finished))
            good.add_metric([job], int(outcome in GOOD_OUTCOMES))
            totals = json.loads(totals) if isinstance(totals, str) else totals  # Django leaves jsonb unparsed
            totals = totals if isinstance(totals, dict) else {}
            # A reaper's lease losses: the lapsed leases it took back, ``reclaimed`` (another
            # attempt) or ``exhausted`` (no attempt left: failed).
            if "reclaimed" in totals or jobs.get(job):
                lost.add_metric([job, "retried"], int(totals.get("reclaimed", 0)))
                lost.add_metric([job, "exhausted"], int(totals.get("exhausted", 0)))
            for item, n in sorted(totals.items()):
                items.add_metric([job, item], int(n))
        yield total
        yield last
        yield good
        yield lost
        yield items

    @staticmethod
    def _workers() -> Iterator[GaugeMetricFamily]:
        with connection.cursor() as cursor:
            cursor.execute(WORKERS, {"gone_after": PRUNE_AFTER_SECONDS})
            rows = cursor.fetchall()
        ages = GaugeMetricFamily(
            "buzz_worker_heartbeat_age_seconds",
            "Seconds since each registered worker process last beat (database clock)",
            labels=["kind", "host", "pid", "name"],
        )
        by_state: dict[tuple[str, str], int] = {}
        for kind, host, pid, name, age in rows:
            ages.add_metric([kind, host, str(pid), name], float(age))
            state = "stale" if age > STALE_AFTER_SECONDS else "live"
            by_state[(kind, state)] = by_state.get((kind, state), 0) + 1
        workers = GaugeMetricFamily(
            "buzz_workers",
            f"Registered worker processes; stale = no heartbeat for {STALE_AFTER_SECONDS:g} s",
            labels=["kind", "state"],
        )
        for (kind, state), n in sorted(by_state.items()):
            workers.add_metric([kind, state], n)
        yield workers
        yield ages

    @staticmethod
    def _rate_limits() -> Iterator[GaugeMetricFamily]:
        declared = declared_rate_limits()
        limit = GaugeMetricFamily(
            "buzz_rate_limit_limit", "Units a rate limit key grants per period in each community", labels=["key"]
        )
        period = GaugeMetricFamily("buzz_rate_limit_period_seconds", "The period of a rate limit key", labels=["key"])
        busiest = GaugeMetricFamily(
            "buzz_rate_limit_used_max",
            "Units used in the current window by the community that used the most of a rate limit key",
            labels=["key"],
        )
        total = GaugeMetricFamily(
            "buzz_rate_limit_used",
            "Units used in the current windows of a rate limit key, all communities",
            labels=["key"],
        )
        full = GaugeMetricFamily(
            "buzz_rate_limit_communities_at_limit",
            "Communities whose current window of a rate limit key is used up (their calls wait)",
            labels=["key"],
        )
        if declared:
            with connection.cursor() as cursor:
                cursor.execute(
                    RATE_LIMIT_USE,
                    {
                        "keys": list(declared),
                        "periods": [spec.period for spec in declared.values()],
                        "limits": [spec.limit for spec in declared.values()],
                    },
                )
                rows = cursor.fetchall()
            found = {key: (most, used, at_limit) for key, most, used, at_limit in rows}
            for key, spec in declared.items():
                most, used, at_limit = found.get(key, (0, 0, 0))
                limit.add_metric([key], spec.limit)
                period.add_metric([key], spec.period)
                busiest.add_metric([key], most)
                total.add_metric([key], used)
                full.add_metric([key], at_limit)
        yield from (limit, period, busiest, total, full)

    @staticmethod
    def _concurrency_limits() -> Iterator[GaugeMetricFamily]:
        yield from _slot_families("buzz_concurrency", "deliveries claimed", flow.declared_limits(), concurrency_use)
        if apps.is_installed("buzz_delivery.agents"):
            yield from _slot_families(
                "buzz_agent_concurrency", "agent runs leased", flow.declared_agent_limits(), agent_concurrency_use
            )
        if apps.is_installed("buzz_delivery.workflows"):
            yield from _slot_families(
                "buzz_step_concurrency", "workflow steps running", flow.declared_step_limits(), step_concurrency_use
            )


def _slot_families(
    prefix: str, what: str, limits: dict[str, int], statement: Callable[[str], str]
) -> Iterator[GaugeMetricFamily]:
    """The four families of one concurrency-limit setting (``<prefix>_limit``, ``_slots_held``,
    ``_slots_held_max``, ``_keys_at_limit``, labelled by kind), one grouped read per declared kind."""
    limit = GaugeMetricFamily(f"{prefix}_limit", f"Most {what} at once per key of a kind", labels=["kind"])
    held = GaugeMetricFamily(
        f"{prefix}_slots_held", f"{what[0].upper()}{what[1:]} holding a slot of a kind, all keys", labels=["kind"]
    )
    most = GaugeMetricFamily(
        f"{prefix}_slots_held_max", "Slots of a kind held by the key that holds the most", labels=["kind"]
    )
    full = GaugeMetricFamily(
        f"{prefix}_keys_at_limit", "Keys of a kind holding every slot (their next claims wait for one)", labels=["kind"]
    )
    for kind, cap in limits.items():
        with connection.cursor() as cursor:
            cursor.execute(statement(kind), {"cap": cap})
            total, busiest, at_limit = cursor.fetchone()
        limit.add_metric([kind], cap)
        held.add_metric([kind], total)
        most.add_metric([kind], busiest)
        full.add_metric([kind], at_limit)
    yield from (limit, held, most, full)


# Per kind of concurrency key: the claimed deliveries holding a slot, grouped by key (the
# community first: on Citus each shard groups its own), then folded: held in all, the most one
# key holds, the keys at the limit. The kind's partial UNIQUE index over claimed rows serves it.
def concurrency_use(kind: str) -> str:
    column, key = flow.KINDS[kind]
    return _slots_use(LIVE_DELIVERIES, "d.status = 'claimed'", column, key)


# The same for agent runs (leased: running, waiting_tool) and workflow steps (running).
_AGENT_SLOTS = {"agent": ("slot_agent", ("agent_pubkey",)), "community": ("slot_community", ())}
_STEP_SLOTS = {
    "community": ("slot_community", ()),
    "workflow": ("slot_workflow", ("slot_workflow_id",)),
    "step": ("slot_step", ("slot_workflow_id", "key")),
}


def agent_concurrency_use(kind: str) -> str:
    column, key = _AGENT_SLOTS[kind]
    return _slots_use("buzz_agents_run", "d.state IN ('running', 'waiting_tool')", column, key)


def step_concurrency_use(kind: str) -> str:
    column, key = _STEP_SLOTS[kind]
    return _slots_use("buzz_workflows_step", "d.state = 'running'", column, key)


def _slots_use(table: str, held: str, column: str, key: tuple[str, ...]) -> str:
    group = ", ".join(["d.community_id", *(f"d.{c}" for c in key)])
    return f"""
SELECT coalesce(sum(k.n), 0), coalesce(max(k.n), 0), count(*) FILTER (WHERE k.n >= %(cap)s)
FROM (
    SELECT count(*) AS n FROM {table} AS d
    WHERE {held} AND d.{column} IS NOT NULL
    GROUP BY {group}
) AS k
"""


# Each declared key's use of its current windows (database clock; a window that ended counts 0):
# one aggregate over the communities (on Citus, per shard, merged by the coordinator).
RATE_LIMIT_USE = """
SELECT r.key, max(r.used), sum(r.used),
       count(*) FILTER (WHERE r.used >= (%(limits)s::bigint[])[array_position(%(keys)s::text[], r.key::text)])
FROM buzz_delivery_rate_limit AS r
WHERE r.key = ANY (%(keys)s::text[])
  AND r.window_start
      + make_interval(secs => (%(periods)s::float8[])[array_position(%(keys)s::text[], r.key::text)])
      > buzz_delivery_now()
GROUP BY r.key
"""


REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(BuzzCollector())


def metrics_token() -> str | None:
    """``BUZZ_DELIVERY["METRICS_TOKEN"]``: the bearer token ``/metrics`` asks for, or None (open)."""
    token = raw_settings().get("METRICS_TOKEN")
    return token or None


def allowed(request: HttpRequest) -> bool:
    """Open without a token; with one: the right ``Authorization: Bearer`` header (compared in
    constant time) or a logged-in staff user."""
    token = metrics_token()
    if token is None:
        return True
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), token.encode()):
        return True
    user = getattr(request, "user", None)
    return bool(user is not None and user.is_active and user.is_staff)


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """The Prometheus text exposition of :class:`BuzzCollector` (GET; read-only); 401 when
    ``METRICS_TOKEN`` is set and the request carries neither it nor a staff login."""
    if not allowed(request):
        response = HttpResponse("401 Unauthorized: a bearer token (METRICS_TOKEN) is required\n", status=401)
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    with tenancy.fleet():  # fleet-wide reads (SPEC 13)
        body = generate_latest(REGISTRY)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
