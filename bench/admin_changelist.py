"""Benchmark: the delivery admin at a million rows (SPEC section 8: the changelist stays fast).

Not a test: it loads ``--rows`` deliveries (default 1,000,000) into a separate database, then
times admin pages through Django's test ``Client`` as a superuser and prints a table of
median timings and query counts. Figures from a shared 2-core machine are noisy: compare
runs on the same machine only.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_admin .venv/bin/python bench/admin_changelist.py

The database name must start with ``bench_admin`` (the script truncates its tables); it is
created and migrated when missing. Rows are loaded once with set-based
``INSERT ... SELECT generate_series`` statements in one transaction with
``session_replication_role = replica`` (no trigger or foreign-key check per row: the rows are
consistent by construction; every CHECK constraint still applies), then ``VACUUM ANALYZE``.
A later run reuses them unless ``--reload``. Status mix: 90% finished, 4% failed, 1% expired,
4% pending, 1% claimed (half of those with an expired lease), over 5 communities, 1,000 runs
each, one delivery every 2 seconds of ``created_at`` up to now.
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
    "buzz_delivery_delivery",
    "buzz_delivery_event",
    "buzz_delivery_workflow_run",
    "buzz_delivery_workflow",
    "buzz_delivery_community",
    "buzz_delivery_maintenance_lease",
)

LOAD = [
    """INSERT INTO buzz_delivery_community (id, name, deletion_state, fence_generation, created_at)
       SELECT md5('c' || c)::uuid, 'community-' || c, 'active', 0, now() FROM generate_series(0, %(c)s - 1) c""",
    """INSERT INTO buzz_delivery_workflow (id, community_id, name, created_at)
       SELECT md5('w' || c)::uuid, md5('c' || c)::uuid, 'workflow-' || c, now() FROM generate_series(0, %(c)s - 1) c""",
    """INSERT INTO buzz_delivery_workflow_run (id, community_id, workflow_id, created_at)
       SELECT md5('r' || c || '-' || r)::uuid, md5('c' || c)::uuid, md5('w' || c)::uuid, now()
       FROM generate_series(0, %(c)s - 1) c, generate_series(0, %(r)s - 1) r""",
    """INSERT INTO buzz_delivery_event (community_id, event_id, created_at, kind, pubkey, content, tags)
       SELECT md5('c' || c)::uuid, sha256(('e' || c || '-' || r)::bytea), now(), 1,
              sha256(('a' || c)::bytea), 'message ' || r, '[]'::jsonb
       FROM generate_series(0, %(c)s - 1) c, generate_series(0, %(r)s - 1) r""",
    """INSERT INTO buzz_delivery_delivery (
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
              s.status,
              CASE WHEN s.status = 'pending' THEN 0 ELSE 1 END,
              CASE WHEN s.status = 'claimed' THEN
                  CASE WHEN i %% 200 = 99 THEN now() - interval '5 minutes' ELSE now() + interval '1 day' END END,
              CASE WHEN s.status = 'claimed' THEN now() - interval '10 minutes' END,
              CASE WHEN s.status IN ('finished', 'failed', 'expired') THEN t.created + interval '30 seconds' END,
              t.created,
              CASE WHEN s.status = 'pending' THEN 0 ELSE 1 END,
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
]


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


def load(url: str, rows: int) -> None:
    started = time.perf_counter()
    with psycopg.connect(url) as conn:
        # CASCADE: the optional apps' tables (workflow engine, agents) point at these
        conn.execute("TRUNCATE " + ", ".join(TABLES) + " CASCADE")
        conn.execute("SET LOCAL session_replication_role = replica")
        for statement in LOAD:
            conn.execute(statement, {"c": COMMUNITIES, "r": RUNS_PER_COMMUNITY, "n": rows})
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    print(f"loaded {rows:,} deliveries in {time.perf_counter() - started:.1f} s (incl. VACUUM ANALYZE)")


def delivery_count(url: str) -> int:
    with psycopg.connect(url) as conn:
        exists = conn.execute("SELECT to_regclass('buzz_delivery_delivery')").fetchone()[0]
        return conn.execute("SELECT count(*) FROM buzz_delivery_delivery").fetchone()[0] if exists else 0


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="deliveries to load (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=7, help="timed requests per page (default: %(default)s)")
    parser.add_argument("--reload", action="store_true", help="reload the rows even if the count matches")
    args = parser.parse_args()

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
    if args.reload or delivery_count(url) != args.rows:
        load(url, args.rows)
    setup_test_environment()  # lets the test Client's host through ALLOWED_HOSTS
    user = User.objects.filter(username="bench").first() or User.objects.create_superuser("bench", "", "bench")
    client = Client()
    client.force_login(user)

    base = "/admin/buzz_delivery/workflowagentdelivery/"
    with psycopg.connect(url) as conn:
        target = conn.execute("SELECT encode(target_pubkey, 'hex') FROM buzz_delivery_delivery LIMIT 1").fetchone()[0]
        community = conn.execute("SELECT id FROM buzz_delivery_community ORDER BY name LIMIT 1").fetchone()[0]
    pages = [
        ("changelist", base),
        ("changelist page 50", base + "?p=50"),
        ("status=claimed", base + "?status__exact=claimed"),
        ("lease expired", base + "?lease_expired=yes"),
        ("claimed + lease expired", base + "?status__exact=claimed&lease_expired=yes"),
        ("status=pending, 1 community", base + f"?status__exact=pending&community={community}"),
        ("search target prefix (6 hex)", base + f"?q={target[:6]}"),
        ("detail page", None),
        ("failure code filter", base + "?failure_code=attempts_exhausted"),
        ("dashboard", base + "dashboard/"),
        ("live workers", "/admin/buzz_delivery/workerregistration/"),
        ("/metrics (Prometheus)", "/metrics"),
    ]
    with psycopg.connect(url) as conn:
        some_id = conn.execute("SELECT id FROM buzz_delivery_delivery ORDER BY created_at DESC LIMIT 1").fetchone()[0]
    print(f"\n{args.rows:,} deliveries; {args.repeat} timed requests per page after a warm-up; shared machine")
    print(f"{'page':<32} {'median ms':>10} {'min ms':>8} {'queries':>8} {'slowest SQL ms':>15} {'HTTP':>5}")
    for name, path in pages:
        path = path or f"{base}{some_id}/change/"
        median, fastest, queries, slowest, status = measure(client, path, args.repeat)
        print(f"{name:<32} {median:>10.1f} {fastest:>8.1f} {queries:>8} {slowest:>15.1f} {status:>5}")


if __name__ == "__main__":
    main()
