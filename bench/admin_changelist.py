"""Benchmark: the admin lists at a million rows (SPEC section 8, issue 17: every list stays fast).

Not a test: it loads ``--rows`` rows (default 1,000,000) per layer into a separate database,
then times admin pages through Django's test ``Client`` as a superuser and prints a table of
median timings and query counts. Figures from a shared 2-core machine are noisy: compare
runs on the same machine only.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_admin .venv/bin/python bench/admin_changelist.py
    ... bench/admin_changelist.py --layers deliveries          # only the delivery pages
    ... bench/admin_changelist.py --layers workflows --explain # with the run search's query plans

The database name must start with ``bench_admin`` (the script truncates its tables); it is
created and migrated when missing. Rows are loaded once with set-based
``INSERT ... SELECT generate_series`` statements in one transaction with
``session_replication_role = replica`` (no trigger or foreign-key check per row: the rows are
consistent by construction; every CHECK constraint still applies), then ``VACUUM ANALYZE``.
A later run reuses them unless ``--reload`` or a chosen layer's row count differs (then every
table is truncated and the chosen layers are loaded again). One row every 2 seconds of
``created_at`` up to now, over 5 communities, ids UUIDv7 as the application makes them.

- ``deliveries``: 90% finished, 4% failed, 1% expired, 4% pending, 1% claimed (half of those
  with an expired lease), 1,000 core runs per community; the delivery list, dashboard, /metrics.
- ``workflows``: engine runs (each with its core run): 90% succeeded, 4% failed, 2% canceled,
  4% running; every ``--step-every``-th run (default 4: as many steps as runs) has 4 chained
  steps whose states follow the run's, and one in five of those an approval step, approved.
  The runs, steps and approvals lists.
- ``agents``: agent runs: 88% completed, 4% failed, 2% cancelled, 1% timeout, 2% pending,
  1% running, 1% waiting_tool, 1% waiting_approval (each with a pending approval; 1% of the
  completed ones have an approved one), 0.5% shadow; no journal. The agent runs and approvals lists.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/bench_admin"
COMMUNITIES = 5
RUNS_PER_COMMUNITY = 1000
TABLES = (
    "buzz_delivery_delivery_queue",
    "buzz_delivery_delivery_record",
    "buzz_delivery_event",
    "buzz_delivery_workflow_run",
    "buzz_delivery_workflow",
    "buzz_delivery_community",
    "buzz_delivery_maintenance_lease",
)

# UUIDv7 of a row created at ``t`` (48-bit milliseconds, version 7, variant 10, the rest from an
# md5 of ``seed``): the ids sort like the application's new_uuid7 ones, by creation time.
UUID7 = """(lpad(to_hex((extract(epoch FROM {t}) * 1000)::bigint), 12, '0') || '7'
          || substr(md5({seed}), 1, 3) || '8' || substr(md5({seed}), 4, 15))::uuid"""

BASE = [
    """INSERT INTO buzz_delivery_community (id, name, deletion_state, fence_generation, created_at)
       SELECT md5('c' || c)::uuid, 'community-' || c, 'active', 0, now() FROM generate_series(0, %(c)s - 1) c""",
    """INSERT INTO buzz_delivery_workflow (id, community_id, name, created_at)
       SELECT md5('w' || c)::uuid, md5('c' || c)::uuid, 'workflow-' || c, now() FROM generate_series(0, %(c)s - 1) c""",
]

DELIVERIES = [
    """INSERT INTO buzz_delivery_workflow_run (id, community_id, workflow_id, created_at)
       SELECT md5('r' || c || '-' || r)::uuid, md5('c' || c)::uuid, md5('w' || c)::uuid, now()
       FROM generate_series(0, %(c)s - 1) c, generate_series(0, %(r)s - 1) r""",
    """INSERT INTO buzz_delivery_event (community_id, event_id, created_at, kind, pubkey, content, tags)
       SELECT md5('c' || c)::uuid, sha256(('e' || c || '-' || r)::bytea), now(), 1,
              sha256(('a' || c)::bytea), 'message ' || r, '[]'::jsonb
       FROM generate_series(0, %(c)s - 1) c, generate_series(0, %(r)s - 1) r""",
    """INSERT INTO buzz_delivery_delivery_record (
           id, community_id, workflow_id, run_id, step_id, target_pubkey, definition_event_id, message_event_id,
           cause_kind, cause_webhook_invocation_id, status, lease_generation, lease_until, claimed_at,
           finished_at, created_at, attempt, max_attempts, failure_code, failure_message,
           execution_trace, trigger_context)
       SELECT md5('d' || i)::uuid,
              md5('c' || (i %% %(c)s))::uuid,
              md5('w' || (i %% %(c)s))::uuid,
              md5('r' || (i %% %(c)s) || '-' || ((i / %(c)s) %% %(r)s))::uuid,
              'step_' || (i %% 7),
              sha256(('t' || i)::bytea),
              decode(repeat('00', 32), 'hex'),
              sha256(('e' || (i %% %(c)s) || '-' || ((i / %(c)s) %% %(r)s))::bytea),
              'webhook', md5('h' || i)::uuid,
              CASE WHEN s.status = 'claimed' THEN 'pending' ELSE s.status END,
              CASE WHEN s.status IN ('pending', 'claimed') THEN 0 ELSE 1 END,
              NULL,
              NULL,
              CASE WHEN s.status IN ('finished', 'failed', 'expired') THEN t.created + interval '30 seconds' END,
              t.created,
              CASE WHEN s.status IN ('pending', 'claimed') THEN 0 ELSE 1 END,
              3,
              CASE s.status WHEN 'failed' THEN 'handler_error' WHEN 'expired' THEN 'delivery_expired' END,
              CASE s.status WHEN 'failed' THEN 'bench failure' WHEN 'expired' THEN 'bench expiry' END,
              jsonb_build_object('steps', jsonb_build_array(repeat('x', 400), repeat('y', 400))),
              jsonb_build_object('source', 'bench', 'i', i)
       FROM generate_series(1, %(n)s) AS i,
            LATERAL (SELECT CASE WHEN i %% 100 < 90 THEN 'finished' WHEN i %% 100 < 94 THEN 'failed'
                                 WHEN i %% 100 < 95 THEN 'expired' WHEN i %% 100 < 99 THEN 'pending'
                                 ELSE 'claimed' END AS status) AS s,
            LATERAL (SELECT now() - (%(n)s - i) * interval '2 seconds' AS created) AS t""",
    # The live rows' queue rows (issue 31, stage 2: a live record says 'pending', its queue row
    # the live state): every 100th row from the 99th claimed, one in 200 with a lapsed lease.
    """INSERT INTO buzz_delivery_delivery_queue (
           id, community_id, target_pubkey, workflow_id, priority, created_at, max_attempts, history,
           status, lease_generation, attempt, lease_until, claimed_at, claimed_by)
       SELECT r.id, r.community_id, r.target_pubkey, r.workflow_id, r.priority, r.created_at, r.max_attempts,
              r.history, s.status,
              CASE WHEN s.status = 'claimed' THEN 1 ELSE 0 END,
              CASE WHEN s.status = 'claimed' THEN 1 ELSE 0 END,
              CASE WHEN s.status = 'claimed' THEN
                  CASE WHEN i %% 200 = 99 THEN now() - interval '5 minutes' ELSE now() + interval '1 day' END END,
              CASE WHEN s.status = 'claimed' THEN now() - interval '10 minutes' END,
              CASE WHEN s.status = 'claimed' THEN 'bench:1:worker' END
       FROM buzz_delivery_delivery_record AS r,
            LATERAL (SELECT (r.trigger_context ->> 'i')::bigint AS i) AS n(i),
            LATERAL (SELECT CASE WHEN i %% 100 = 99 THEN 'claimed' ELSE 'pending' END AS status) AS s
       WHERE r.status = 'pending'""",
]

_T = "now() - (%(n)s - i) * interval '2 seconds'"  # row i of n: one every 2 seconds up to now
_RUN_ID = UUID7.format(t="t.created", seed="'wr' || i")

# Workflow runs: 90% succeeded, 4% failed, 2% canceled, 4% running, each with its core
# WorkflowRun (same id), tags customer:<i mod 50,000> (20 runs each), batch:<i / 1000> (1,000 runs
# each) and, one run in 100, vip (10,000 runs), input {i, order: {id: i}, region: eu|us|apac};
# every --step-every-th run has 4 steps in a chain (the run's state
# decides theirs); one in five of those has an approval step (approved, as its run succeeded).
WORKFLOWS = [
    """INSERT INTO buzz_workflows_definition (id, community_id, workflow_id, version, content, content_hash,
           definition_event_id, created_at)
       SELECT md5('v' || c)::uuid, md5('c' || c)::uuid, md5('w' || c)::uuid, 1,
              jsonb_build_object('steps', jsonb_build_array('step_0', 'step_1', 'step_2', 'step_3')),
              sha256(('v' || c)::bytea), sha256(('ve' || c)::bytea), now()
       FROM generate_series(0, %(c)s - 1) c""",
    f"""INSERT INTO buzz_delivery_workflow_run (id, community_id, workflow_id, created_at)
       SELECT {_RUN_ID}, md5('c' || (i %% %(c)s))::uuid, md5('w' || (i %% %(c)s))::uuid, t.created
       FROM generate_series(1, %(n)s) AS i, LATERAL (SELECT {_T} AS created) AS t""",
    f"""INSERT INTO buzz_workflows_run (run_id, community_id, workflow_id, definition_id, state, input, output,
           failure_code, failure_message, cause_kind, cause_webhook_invocation_id, depth, steps_total, steps_left,
           deliveries_to_expire, created_at, finished_at, tags)
       SELECT {_RUN_ID}, md5('c' || (i %% %(c)s))::uuid, md5('w' || (i %% %(c)s))::uuid,
              md5('v' || (i %% %(c)s))::uuid, s.state,
              jsonb_build_object('i', i, 'order', jsonb_build_object('id', i),
                                 'region', (ARRAY['eu', 'us', 'apac'])[i %% 3 + 1]),
              CASE WHEN s.state = 'succeeded' THEN '{{"ok": true}}'::jsonb END,
              CASE WHEN s.state = 'failed' THEN 'step_failed' END,
              CASE WHEN s.state = 'failed' THEN 'bench failure' END,
              'webhook', md5('h' || i)::uuid, 0, 4, CASE WHEN s.state = 'succeeded' THEN 0 ELSE 2 END,
              false, t.created, CASE WHEN s.state <> 'running' THEN t.created + interval '40 seconds' END,
              ARRAY['customer:' || (i %% 50000), 'batch:' || (i / 1000)]
              || CASE WHEN i %% 100 = 0 THEN ARRAY['vip'] ELSE ARRAY[]::text[] END
       FROM generate_series(1, %(n)s) AS i,
            LATERAL (SELECT CASE WHEN i %% 100 < 90 THEN 'succeeded' WHEN i %% 100 < 94 THEN 'failed'
                                 WHEN i %% 100 < 96 THEN 'canceled' ELSE 'running' END AS state) AS s,
            LATERAL (SELECT {_T} AS created) AS t""",
    f"""INSERT INTO buzz_workflows_step (id, community_id, run_id, key, kind, state, position, depends_on, dependents,
           deps_total, deps_done, deps_blocked, on_error, max_attempts, attempts, backoff_base_seconds,
           backoff_cap_seconds, lease_generation, lease_until, claimed_at, delivered_terminal, delivered_failed,
           tolerate_failures, output, failure_code, failure_message, created_at, started_at, finished_at,
           claimed_by, renewals, history)
       SELECT {UUID7.format(t="t.created", seed="'ws' || i || '-' || k")}, md5('c' || (i %% %(c)s))::uuid, {_RUN_ID},
              'step_' || k, CASE WHEN k = 2 AND i %% (5 * %(every)s::int) = 0 THEN 'approval' ELSE 'function' END,
              st.state, k,
              CASE WHEN k = 0 THEN '{{}}'::varchar[] ELSE ARRAY['step_' || (k - 1)]::varchar[] END,
              CASE WHEN k = 3 THEN '{{}}'::varchar[] ELSE ARRAY['step_' || (k + 1)]::varchar[] END,
              (k > 0)::int, CASE WHEN st.started THEN (k > 0)::int ELSE 0 END, 0, 'fail_run', 3,
              st.started::int, 2, 300, CASE WHEN st.state = 'pending' THEN 0 ELSE 1 END,
              CASE WHEN st.state = 'running' THEN now() + interval '5 minutes' END,
              CASE WHEN st.state = 'running' THEN now() - interval '1 minute' END,
              0, 0, 0,
              CASE WHEN st.state = 'succeeded' THEN '{{"ok": true}}'::jsonb END,
              CASE WHEN st.state = 'failed' THEN 'handler_error' END,
              CASE WHEN st.state = 'failed' THEN 'bench failure' END,
              t.created, CASE WHEN st.started THEN t.created + k * interval '10 seconds' END,
              CASE WHEN st.state NOT IN ('pending', 'running')
                   THEN t.created + k * interval '10 seconds' + interval '5 seconds' END,
              CASE WHEN st.started THEN 'bench-host:' || (100 + i %% 8) || ':steps' END, 0, '[]'::jsonb
       FROM generate_series(%(every)s::int, %(n)s::int, %(every)s::int) AS i, generate_series(0, 3) AS k,
            LATERAL (SELECT CASE WHEN i %% 100 < 90 THEN 'succeeded' WHEN i %% 100 < 94 THEN 'failed'
                                 WHEN i %% 100 < 96 THEN 'canceled' ELSE 'running' END AS run_state) AS r,
            LATERAL (SELECT CASE WHEN r.run_state = 'succeeded' OR k = 0 THEN 'succeeded'
                                 WHEN r.run_state = 'failed' AND k = 1 THEN 'failed'
                                 WHEN r.run_state = 'running' AND k = 1 THEN 'running'
                                 WHEN r.run_state = 'running' THEN 'pending'
                                 ELSE 'canceled' END AS state) AS st0,
            LATERAL (SELECT st0.state, st0.state IN ('succeeded', 'failed', 'running') AS started) AS st,
            LATERAL (SELECT {_T} AS created) AS t""",
    f"""INSERT INTO buzz_workflows_approval (id, community_id, run_id, step_id, step_generation, state, prompt,
           requested_at, deadline_at, closed_at, decided_by)
       SELECT {UUID7.format(t="s.started_at", seed="'wa' || s.id")}, s.community_id, s.run_id, s.id, 1, 'approved',
              'Approve ' || s.key || ' of run ' || s.run_id, s.started_at, s.started_at + interval '1 day',
              s.started_at + interval '3 seconds', 'bench-operator'
       FROM buzz_workflows_step s WHERE s.kind = 'approval' AND s.state = 'succeeded'""",
]

_AGENT_RUN_ID = UUID7.format(t="t.created", seed="'ar' || i")

# Agent runs: 88% completed, 4% failed, 2% cancelled, 1% timeout, 2% pending, 1% running,
# 1% waiting_tool, 1% waiting_approval (each with a pending approval; 1% of the completed ones
# have an approved one); 0.5% shadow runs; no journal (no tool call counted).
AGENTS = [
    f"""INSERT INTO buzz_agents_run (id, community_id, agent_pubkey, state, unwinding, shadow, input, input_hash,
           output, output_hash, failure_code, failure_message, approval_id, lease_generation, lease_until, claimed_at,
           heartbeat_at, worker_id, attempts, max_attempts, next_attempt_at, timeout_at, max_tool_calls,
           tool_calls_used, max_cost, cost_used, created_at, finished_at, renewals, history)
       SELECT {_AGENT_RUN_ID}, md5('c' || (i %% %(c)s))::uuid, sha256(('agent' || (i %% 20))::bytea), s.state,
              false, i %% 200 = 3, jsonb_build_object('text', 'message ' || i), sha256(('in' || i)::bytea),
              CASE WHEN s.state = 'completed' THEN '{{"reply": "ok"}}'::jsonb END,
              CASE WHEN s.state = 'completed' THEN sha256(('out' || i)::bytea) END,
              CASE s.state WHEN 'failed' THEN 'tool_error' WHEN 'cancelled' THEN 'cancelled'
                           WHEN 'timeout' THEN 'run_timeout' END,
              CASE WHEN s.state IN ('failed', 'cancelled', 'timeout') THEN 'bench ' || s.state END,
              CASE WHEN s.state = 'waiting_approval' OR (s.state = 'completed' AND i %% 100 = 7)
                   THEN {UUID7.format(t="t.created", seed="'aa' || i")} END,
              CASE WHEN s.state = 'pending' THEN 0 ELSE 1 END,
              CASE WHEN s.state IN ('running', 'waiting_tool') THEN now() + interval '5 minutes' END,
              CASE WHEN s.state IN ('running', 'waiting_tool') THEN now() - interval '1 minute' END,
              CASE WHEN s.state IN ('running', 'waiting_tool') THEN now() - interval '10 seconds' END,
              CASE WHEN s.state <> 'pending' THEN 'bench-host:' || (100 + i %% 8) || ':agents' END,
              CASE WHEN s.state = 'pending' THEN 0 ELSE 1 END, 3,
              CASE WHEN s.state = 'pending' THEN t.created END,
              CASE WHEN s.state NOT IN ('completed', 'failed', 'cancelled', 'timeout')
                   THEN now() + interval '1 hour' END,
              100, 0, 1000000, 0, t.created,
              CASE WHEN s.state IN ('completed', 'failed', 'cancelled', 'timeout')
                   THEN t.created + interval '20 seconds' END,
              0, '[]'::jsonb
       FROM generate_series(1, %(n)s) AS i,
            LATERAL (SELECT CASE WHEN i %% 100 < 88 THEN 'completed' WHEN i %% 100 < 92 THEN 'failed'
                                 WHEN i %% 100 < 94 THEN 'cancelled' WHEN i %% 100 < 95 THEN 'timeout'
                                 WHEN i %% 100 < 97 THEN 'pending' WHEN i %% 100 < 98 THEN 'running'
                                 WHEN i %% 100 < 99 THEN 'waiting_tool' ELSE 'waiting_approval' END AS state) AS s,
            LATERAL (SELECT {_T} AS created) AS t""",
    """INSERT INTO buzz_workflows_approval (id, community_id, state, prompt, requested_at, deadline_at, closed_at,
           decided_by)
       SELECT r.approval_id, r.community_id, CASE WHEN r.state = 'waiting_approval' THEN 'pending' ELSE 'approved' END,
              'Allow the tool call of agent run ' || r.id, r.created_at + interval '1 second',
              greatest(r.created_at, now()) + interval '1 day',
              CASE WHEN r.state <> 'waiting_approval' THEN r.created_at + interval '5 seconds' END,
              CASE WHEN r.state <> 'waiting_approval' THEN 'bench-operator' END
       FROM buzz_agents_run r WHERE r.approval_id IS NOT NULL""",
]

# layer -> (statements, the table whose row count says it is loaded)
LAYERS = {
    "deliveries": (DELIVERIES, "buzz_delivery_delivery_record"),
    "workflows": (WORKFLOWS, "buzz_workflows_run"),
    "agents": (AGENTS, "buzz_agents_run"),
}


def database_url() -> str:
    url = os.environ.get("DATABASE_URL", DEFAULT_URL)
    name = urlsplit(url).path.lstrip("/")
    if not name.startswith("bench_admin"):
        raise SystemExit(f"refusing to load benchmark rows into {name!r}: its name must start with 'bench_admin'")
    return url


def ensure_database(url: str) -> None:
    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin_url = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin_url, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')
            print(f"created database {name}")


def load(url: str, rows: int, layers: list[str], step_every: int) -> None:
    """Truncate every benchmark table, then load the base rows and ``layers`` in one transaction."""
    params = {"c": COMMUNITIES, "r": RUNS_PER_COMMUNITY, "n": rows, "every": step_every}
    started = time.perf_counter()
    with psycopg.connect(url) as conn:
        # CASCADE: the optional apps' tables (workflow engine, agents) point at these
        conn.execute("TRUNCATE " + ", ".join(TABLES) + " CASCADE")
        conn.execute("SET LOCAL session_replication_role = replica")
        for statement in BASE:
            conn.execute(statement, params)
        for layer in layers:
            layer_started = time.perf_counter()
            for statement in LAYERS[layer][0]:
                conn.execute(statement, params)
            print(f"  {layer}: {time.perf_counter() - layer_started:.1f} s")
        committing = time.perf_counter()
    print(f"  commit: {time.perf_counter() - committing:.1f} s")
    vacuuming = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    print(f"  VACUUM ANALYZE: {time.perf_counter() - vacuuming:.1f} s")
    print(f"loaded {rows:,} rows per layer ({', '.join(layers)}) in {time.perf_counter() - started:.1f} s")


def loaded(url: str, layers: list[str]) -> dict[str, int]:
    """The row count of each layer's main table (0 when the table does not exist)."""
    counts = {}
    with psycopg.connect(url) as conn:
        for layer in layers:
            table = LAYERS[layer][1]
            exists = conn.execute("SELECT to_regclass(%s)", [table]).fetchone()[0]
            counts[layer] = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0] if exists else 0
    return counts


def measure(client, url: str, repeat: int) -> tuple[float, float, int, float, int]:
    """(median ms, min ms, queries, slowest query ms, status) over ``repeat`` requests after one warm-up."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client.get(url)
    timings, queries, slowest, status = [], 0, 0.0, 0
    for _ in range(repeat):
        with CaptureQueriesContext(connection) as ctx:
            started = time.perf_counter()
            response = client.get(url)
            timings.append((time.perf_counter() - started) * 1000)
        status = response.status_code
        queries = len(ctx.captured_queries)
        slowest = max(slowest, max((float(q["time"]) * 1000 for q in ctx.captured_queries), default=0.0))
    return statistics.median(timings), min(timings), queries, slowest, status


def delivery_pages(conn: psycopg.Connection) -> list[tuple[str, str]]:
    base = "/admin/buzz_delivery/workflowagentdelivery/"
    target = conn.execute("SELECT encode(target_pubkey, 'hex') FROM buzz_delivery_delivery_record LIMIT 1").fetchone()[
        0
    ]
    community = conn.execute("SELECT id FROM buzz_delivery_community ORDER BY name LIMIT 1").fetchone()[0]
    some_id = conn.execute("SELECT id FROM buzz_delivery_delivery_record ORDER BY created_at DESC LIMIT 1").fetchone()[
        0
    ]
    return [
        ("changelist", base),
        ("changelist page 50", base + "?p=50"),
        ("status=claimed", base + "?status__exact=claimed"),
        ("lease expired", base + "?lease_expired=yes"),
        ("claimed + lease expired", base + "?status__exact=claimed&lease_expired=yes"),
        ("status=pending, 1 community", base + f"?status__exact=pending&community={community}"),
        ("search target prefix (6 hex)", base + f"?q={target[:6]}"),
        ("detail page", f"{base}{some_id}/change/"),
        ("failure code filter", base + "?failure_code=attempts_exhausted"),
        ("dashboard", base + "dashboard/"),
        ("live workers", "/admin/buzz_delivery/workerregistration/"),
        ("/metrics (Prometheus)", "/metrics"),
    ]


def workflow_pages(conn: psycopg.Connection) -> list[tuple[str, str]]:
    runs, steps = "/admin/buzz_workflows/run/", "/admin/buzz_workflows/step/"
    run_id = conn.execute(
        "SELECT run_id FROM buzz_workflows_step WHERE state = 'running' ORDER BY created_at DESC LIMIT 1"
    ).fetchone()[0]
    return [
        ("runs: changelist", runs),
        ("runs: page 50", runs + "?p=50"),
        ("runs: state=failed", runs + "?state__exact=failed"),
        ("runs: state=running", runs + "?state__exact=running"),
        ("runs: detail (DAG, 4 steps)", f"{runs}{run_id}/change/"),
        *run_search_pages(conn),
        ("steps: changelist", steps),
        ("steps: state=running", steps + "?state__exact=running"),
        ("steps: state=failed", steps + "?state__exact=failed"),
        ("steps: kind=approval", steps + "?kind__exact=approval"),
    ]


def run_search_pages(conn: psycopg.Connection) -> list[tuple[str, str]]:
    """The run search box (issue 33): by tag, input field, id prefix, state and workflow."""
    runs = "/admin/buzz_workflows/run/?q="
    some = str(
        conn.execute("SELECT run_id FROM buzz_workflows_run ORDER BY run_id LIMIT 1 OFFSET 500000").fetchone()[0]
    )
    return [
        ("runs: search tag (20 runs)", runs + "tag:customer:4242"),
        ("runs: search tag (1,000 runs)", runs + "tag:batch:321"),
        ("runs: search tag (10,000 runs)", runs + "tag:vip"),
        ("runs: search input field (1 run)", runs + "input.order.id=654321"),
        ("runs: search input field (1/3)", runs + "input.region=apac"),
        ("runs: search id prefix (8 hex)", runs + some[:8]),
        ("runs: search id prefix (13 chars)", runs + some[:13]),
        ("runs: search workflow + state", runs + "workflow:workflow-1+state:failed"),
        ("runs: search tag + input field", runs + "tag:batch:321+input.region=eu"),
    ]


def explain_searches(client, pages: list[tuple[str, str]]) -> None:
    """EXPLAIN (ANALYZE, BUFFERS) of the run list's queries behind each search page."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    for name, path in pages:
        if "search" not in name:
            continue
        with CaptureQueriesContext(connection) as ctx:
            client.get(path)
        print(f"\n--- {name}: {path}")
        for query in ctx.captured_queries:
            sql = query["sql"]
            if 'FROM "buzz_workflows_run"' not in sql or not sql.startswith("SELECT"):
                continue
            with connection.cursor() as cursor:
                cursor.execute("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + sql)
                plan = [row[0] for row in cursor.fetchall()]
            print("\n".join(plan[:12]))


def approval_pages() -> list[tuple[str, str]]:
    base = "/admin/buzz_workflows/approval/"
    return [("approvals: changelist", base), ("approvals: state=pending", base + "?state__exact=pending")]


def agent_pages(conn: psycopg.Connection) -> list[tuple[str, str]]:
    base = "/admin/buzz_agents/agentrun/"
    some_id = conn.execute("SELECT id FROM buzz_agents_run ORDER BY created_at DESC LIMIT 1").fetchone()[0]
    return [
        ("agent runs: changelist", base),
        ("agent runs: page 50", base + "?p=50"),
        ("agent runs: state=failed", base + "?state__exact=failed"),
        ("agent runs: state=waiting_approval", base + "?state__exact=waiting_approval"),
        ("agent runs: shadow=yes", base + "?shadow__exact=1"),
        ("agent runs: detail", f"{base}{some_id}/change/"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per layer (default: %(default)s)")
    parser.add_argument(
        "--layers",
        default=",".join(LAYERS),
        help="comma-separated layers to load and time, of %(default)s (default: all)",
    )
    parser.add_argument(
        "--step-every",
        type=int,
        default=4,
        help="every N-th workflow run has 4 steps (default: %(default)s, i.e. as many steps as runs)",
    )
    parser.add_argument("--repeat", type=int, default=7, help="timed requests per page (default: %(default)s)")
    parser.add_argument("--reload", action="store_true", help="reload the rows even if the counts match")
    parser.add_argument("--explain", action="store_true", help="print the plans of the run search's queries")
    args = parser.parse_args()
    layers = [name.strip() for name in args.layers.split(",") if name.strip()]
    if unknown := set(layers) - set(LAYERS):
        parser.error(f"unknown layers {sorted(unknown)}; choose from {', '.join(LAYERS)}")

    url = database_url()
    ensure_database(url)
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client
    from django.test.utils import setup_test_environment

    call_command("migrate", verbosity=0)
    counts = loaded(url, layers)
    if args.reload or any(count != args.rows for count in counts.values()):
        load(url, args.rows, layers, args.step_every)
    setup_test_environment()  # lets the test Client's host through ALLOWED_HOSTS
    user = User.objects.filter(username="bench").first() or User.objects.create_superuser("bench", "", "bench")
    client = Client()
    client.force_login(user)

    pages: list[tuple[str, str]] = []
    with psycopg.connect(url) as conn:
        if "deliveries" in layers:
            pages += delivery_pages(conn)
        if "workflows" in layers:
            pages += workflow_pages(conn)
        if "agents" in layers:
            pages += agent_pages(conn)
        if {"workflows", "agents"} & set(layers):
            pages += approval_pages()
        sizes = {
            table: conn.execute(
                "SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass(%s)", [table]
            ).fetchone()
            for table in (
                "buzz_delivery_delivery_record",
                "buzz_workflows_run",
                "buzz_workflows_step",
                "buzz_agents_run",
                "buzz_workflows_approval",
            )
        }
    print("\nrows (planner estimate): " + ", ".join(f"{t} {r[0]:,}" for t, r in sizes.items() if r and r[0] > 0))
    print(f"{args.repeat} timed requests per page after a warm-up; shared machine")
    print(f"{'page':<36} {'median ms':>10} {'min ms':>8} {'queries':>8} {'slowest SQL ms':>15} {'HTTP':>5}")
    for name, path in pages:
        median, fastest, queries, slowest, status = measure(client, path, args.repeat)
        print(f"{name:<36} {median:>10.1f} {fastest:>8.1f} {queries:>8} {slowest:>15.1f} {status:>5}", flush=True)
    if args.explain:
        explain_searches(client, pages)


if __name__ == "__main__":
    main()
