"""Server CPU of the engine's statements per run of DBOS's diamond, without orchestrators
(issue 31, ``bench/results/engine-server-cpu.md``): ``python -m bench.engine_cpu``.

One process, one connection, no threads, no polling: ``--runs`` runs are started, then their
steps are claimed and completed in batches (``claim_steps`` and ``complete_steps``, the
statements the orchestrator's claim and completer run) until every run succeeded. Printed: the
CPU of that connection's PostgreSQL backend (``/proc``) and of this process, per run, and the
backend's rows written per run (``pg_stat_get_xact_*`` of the step and run tables, read inside
one transaction per batch). The backend's CPU of the same statements is what the orchestrator
bench (``bench.workflows``) spends per run on the server, less its polling and wake-ups, and
moves far less than throughput with the load of a shared machine: run it from two trees (each
migrating its own database) to compare a database-side change, e.g. a trigger, which
``bench.workflows --before-root`` does not (its two sides share one schema). Database:
``BENCH_WF_SERVER`` + ``BENCH_ENGINE_DATABASE`` (default ``bench_fengine``; created).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
BASE = os.environ.get("BENCH_WF_SERVER", "postgres://postgres@127.0.0.1:5432")
URL = f"{BASE}/{os.environ.get('BENCH_ENGINE_DATABASE', 'bench_fengine')}"
TICK = os.sysconf("SC_CLK_TCK")
WRITES = """
SELECT pg_stat_get_xact_tuples_updated('buzz_workflows_step'::regclass),
       pg_stat_get_xact_tuples_hot_updated('buzz_workflows_step'::regclass),
       pg_stat_get_xact_tuples_updated('buzz_workflows_run'::regclass),
       pg_stat_get_xact_tuples_hot_updated('buzz_workflows_run'::regclass)
"""


def backend_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=50, help="runs started, and steps claimed, per batch")
    args = parser.parse_args()
    name = URL.rsplit("/", 1)[1]
    with psycopg.connect(f"{BASE}/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')
    os.environ["DATABASE_URL"] = URL
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, check=True, env=os.environ)
    import django

    django.setup()
    from django.db import connection, transaction

    from buzz_delivery.services import Cause
    from buzz_delivery.testing import CommunityFactory, WorkflowFactory
    from buzz_delivery.workflows.models import Run
    from buzz_delivery.workflows.services import claim_steps, complete_steps, publish_definition, start_run
    from buzz_delivery.workflows.testing import diamond

    community = CommunityFactory()
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, diamond())

    def drive(n: int) -> list[int]:
        written = [0, 0, 0, 0]
        for first in range(0, n, args.batch):
            for _ in range(min(args.batch, n - first)):
                start_run(community.id, workflow.id, {}, cause=Cause.event(os.urandom(32)))
            while True:
                with transaction.atomic(), connection.cursor() as cursor:
                    # (The counters hold what is not yet reported, not only this transaction's:
                    # the difference inside one transaction is its own.)
                    cursor.execute(WRITES)
                    before = cursor.fetchone()
                    claims = claim_steps(community.id, limit=2 * args.batch, lease_seconds=60)
                    if not claims:
                        break
                    complete_steps(community.id, [(c.lease, None) for c in claims])
                    cursor.execute(WRITES)
                    after = cursor.fetchone()
                    written = [w + a - b for w, a, b in zip(written, after, before, strict=True)]
        return written

    drive(2 * args.batch)  # warm up: caches, plans, statistics
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE buzz_workflows_step, buzz_workflows_run")
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    b0, s0, t0 = backend_cpu(pid), resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    written = drive(args.runs)
    b1, s1, t1 = backend_cpu(pid), resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    done = Run.objects.filter(community_id=community.id, state="succeeded").count()
    if done != args.runs + 2 * args.batch:
        raise SystemExit(f"bench.engine_cpu: {done} runs succeeded of {args.runs + 2 * args.batch}")
    n = args.runs
    print(
        json.dumps(
            {
                "runs": n,
                "server_cpu_ms_per_run": round(1000 * (b1 - b0) / n, 3),
                "client_cpu_ms_per_run": round(1000 * (s1.ru_utime + s1.ru_stime - s0.ru_utime - s0.ru_stime) / n, 3),
                "seconds": round(t1 - t0, 2),
                "step_updates_per_run": round(written[0] / n, 2),
                "step_hot_updates_per_run": round(written[1] / n, 2),
                "run_updates_per_run": round(written[2] / n, 2),
                "run_hot_updates_per_run": round(written[3] / n, 2),
                "load": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
