"""Server CPU of settling a ``send_message`` step's deliveries, fan-in included, without
workers (issue 31, ``bench/results/send-shape.md``): ``python -m bench.send_settle_cpu``.

One process, one connection, no threads, no polling: ``--runs`` one-step runs (a
``send_message`` to 2 targets) are started and sent (``claim_steps`` and ``send_messages``,
the statements the orchestrator runs), their deliveries claimed per target in batches of
``--batch`` (``claim_deliveries``), then settled in batches of ``--batch`` per target, the first
target's first (``finish_deliveries``, the statement the delivery worker's settler runs): the
first settle of a run counts a delivery, the second ends the send step (the fan-in) and its
run (Advance). Printed: the CPU of that connection's PostgreSQL backend (``/proc``) during the
settles only, per run, and the step rows the settles wrote per run (``pg_stat_get_xact_*``).
Run it from two trees, each on its own database, to compare a trigger change.
Database: ``BENCH_WF_SERVER`` + ``BENCH_SETTLE_DATABASE`` (default ``bench_fsettle``; created).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
BASE = os.environ.get("BENCH_WF_SERVER", "postgres://postgres@127.0.0.1:5432")
URL = f"{BASE}/{os.environ.get('BENCH_SETTLE_DATABASE', 'bench_fsettle')}"
TICK = os.sysconf("SC_CLK_TCK")
WRITES = """
SELECT pg_stat_get_xact_tuples_updated('buzz_workflows_step'::regclass),
       pg_stat_get_xact_tuples_hot_updated('buzz_workflows_step'::regclass)
"""


def backend_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=50, help="deliveries claimed, and settled, per statement")
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

    from buzz_delivery import services
    from buzz_delivery.services import Cause
    from buzz_delivery.testing import CommunityFactory, WorkflowFactory, random32
    from buzz_delivery.workflows.models import Run
    from buzz_delivery.workflows.sends import send_messages
    from buzz_delivery.workflows.services import claim_steps, publish_definition, start_run

    community = CommunityFactory()
    workflow = WorkflowFactory(community=community)
    targets = [random32(), random32()]
    step = {"key": "send", "kind": "send_message", "targets": [t.hex() for t in targets], "content": "c"}
    publish_definition(community.id, workflow.id, {"steps": [step]})

    def prepare(n: int) -> dict[bytes, list[services.Claim]]:
        for _ in range(n):
            start_run(community.id, workflow.id, {}, cause=Cause.event(os.urandom(32)))
        while claims := claim_steps(community.id, limit=args.batch, lease_seconds=300):
            assert all(o is not None for o in send_messages(community.id, claims))
        leases: dict[bytes, list[services.Claim]] = {}
        for target in targets:
            while batch := services.claim_deliveries(community.id, target, limit=args.batch, lease_seconds=300):
                leases.setdefault(target, []).extend(batch)
        return leases

    def settle(leases: dict[bytes, list[services.Claim]]) -> list[int]:
        written = [0, 0]
        for target in targets:
            found = leases[target]
            for first in range(0, len(found), args.batch):
                with transaction.atomic(), connection.cursor() as cursor:
                    cursor.execute(WRITES)
                    before = cursor.fetchone()
                    services.finish_deliveries([c.lease for c in found[first : first + args.batch]])
                    cursor.execute(WRITES)
                    after = cursor.fetchone()
                written = [w + a - b for w, a, b in zip(written, after, before, strict=True)]
        return written

    settle(prepare(2 * args.batch))  # warm up: caches, plans
    with connection.cursor() as cursor:
        cursor.execute(
            "ANALYZE buzz_workflows_step, buzz_workflows_run, buzz_delivery_delivery_record,"
            " buzz_delivery_delivery_queue"
        )
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    leases = prepare(args.runs)
    b0 = backend_cpu(pid)
    written = settle(leases)
    b1 = backend_cpu(pid)
    done = Run.objects.filter(community_id=community.id, state="succeeded").count()
    if done != args.runs + 2 * args.batch:
        raise SystemExit(f"bench.send_settle_cpu: {done} runs succeeded of {args.runs + 2 * args.batch}")
    n = args.runs
    print(
        json.dumps(
            {
                "runs": n,
                "settle_server_cpu_ms_per_run": round(1000 * (b1 - b0) / n, 3),
                "step_updates_per_run": round(written[0] / n, 2),
                "step_hot_updates_per_run": round(written[1] / n, 2),
                "load": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
