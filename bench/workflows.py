"""Workflow engine throughput next to DBOS Transact (issue 12): ``python -m bench.workflows``.

(a) DBOS's shape: a 4-step workflow of no-op functions (step1; step2 and step3 after it; step4
after both), runs per second end to end (first start to last run succeeded; after 20 warm-up
runs and an ANALYZE, as DBOS's side warms up with 20), with K = 1 and 4
``run_workflow_worker`` processes; (b) the same with step4 a ``send_message`` to 2 targets whose
deliveries are settled by 2 ``run_delivery_worker`` processes (one per target). DBOS runs (a) in
the same run, on the same PostgreSQL, in its own process (``bench/dbos_diamond.py``, with the
interpreter of ``--dbos-python``, which must have ``dbos`` installed).

Printed per figure: runs/s, commits per run (``pg_stat_database.xact_commit`` of the database the
figure uses), client CPU per run (the orchestrator and delivery worker processes and the starting
process) and server CPU per run (the PostgreSQL backends of that database, from ``/proc``).
Figures only; nothing is asserted. Databases: ``bench_fwf`` and ``bench_fwf_dbos`` (created).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
BASE = os.environ.get("BENCH_WF_SERVER", "postgres://postgres@127.0.0.1:5432")
OURS = f"{BASE}/bench_fwf"
DBOS_DB = f"{BASE}/bench_fwf_dbos"
TICK = os.sysconf("SC_CLK_TCK")


def ensure_database(url: str) -> None:
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(f"{BASE}/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def commits(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()[0]


def proc_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def backend_cpu(url: str) -> dict[int, float]:
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(url, autocommit=True) as conn:
        pids = [r[0] for r in conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", [name])]
    return {pid: proc_cpu(pid) for pid in pids}


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def setup_django() -> None:
    os.environ["DATABASE_URL"] = OURS
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, check=True, env=os.environ)
    import django

    django.setup()


def ours(k: int, runs: int, send: bool) -> dict[str, float]:
    from django.db import connection

    from buzz_delivery.services import Cause
    from buzz_delivery.testing import CommunityFactory, WorkflowFactory, random32
    from buzz_delivery.workflows.models import Run
    from buzz_delivery.workflows.services import publish_definition, start_run
    from buzz_delivery.workflows.testing import diamond

    community = CommunityFactory()
    workflow = WorkflowFactory(community=community)
    definition = diamond()
    targets = [random32(), random32()]
    if send:
        definition["steps"][3] = {
            "key": "step4",
            "kind": "send_message",
            "depends_on": ["step2", "step3"],
            "targets": [t.hex() for t in targets],
            "content": "bench",
        }
    publish_definition(community.id, workflow.id, definition)
    env = {**os.environ, "DATABASE_URL": OURS, "LOG_LEVEL": "WARNING"}
    logs = Path(tempfile.mkdtemp(prefix="bench_wf_"))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "run_workflow_worker",
                "--community",
                str(community.id),
                "--concurrency",
                "4",
                "--poll-interval",
                "0.5",
                "-v",
                "0",
            ],
            cwd=ROOT,
            env=env,
            stdout=(logs / f"orchestrator-{i}.json").open("w"),
            stderr=subprocess.DEVNULL,
        )
        for i in range(k)
    ]
    if send:
        procs += [
            subprocess.Popen(
                [
                    sys.executable,
                    "manage.py",
                    "run_delivery_worker",
                    "--community",
                    str(community.id),
                    "--target",
                    t.hex(),
                    "--handler",
                    "bench.handlers:noop",
                    "--concurrency",
                    "4",
                    "--poll-interval",
                    "0.5",
                    "-v",
                    "0",
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for t in targets
        ]
    time.sleep(4)  # processes up and listening

    def drive(n: int) -> None:
        ids = [start_run(community.id, workflow.id, {}, cause=Cause.event(os.urandom(32))).pk for _ in range(n)]
        while Run.objects.filter(community_id=community.id, run_id__in=ids, state="succeeded").count() < n:
            time.sleep(0.02)

    drive(20)  # warm up, as the DBOS side does
    with connection.cursor() as cursor:  # fresh tables have no statistics yet
        cursor.execute(
            "ANALYZE buzz_workflows_step, buzz_workflows_run, buzz_delivery_workflow_run, buzz_delivery_delivery"
        )
    connection.close()
    c0, s0, b0 = commits(OURS), self_cpu(), backend_cpu(OURS)
    p0 = {p.pid: proc_cpu(p.pid) for p in procs}
    t0 = time.monotonic()
    drive(runs)
    t1 = time.monotonic()
    s1, b1 = self_cpu(), backend_cpu(OURS)
    p1 = {p.pid: proc_cpu(p.pid) for p in procs}
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(60)
    connection.close()
    time.sleep(1.2)
    c1 = commits(OURS)
    summaries = [json.loads(f.read_text().strip().splitlines()[-1]) for f in sorted(logs.glob("orchestrator-*.json"))]
    client = (s1 - s0) + sum(p1[pid] - p0.get(pid, 0) for pid in p1)
    server = sum(cpu - b0.get(pid, 0.0) for pid, cpu in b1.items())
    return {
        "runs_per_s": runs / (t1 - t0),
        "commits_per_run": (c1 - c0) / runs,
        "client_cpu_ms_per_run": 1000 * client / runs,
        "server_cpu_ms_per_run": 1000 * server / runs,
        "claims_per_run": sum(x["claim_statements"] for x in summaries) / runs,
        "completes_per_run": sum(x["complete_statements"] for x in summaries) / runs,
    }


def dbos(python: str, runs: int) -> dict[str, float] | None:
    try:
        out = subprocess.run(
            [
                python,
                str(ROOT / "bench" / "dbos_diamond.py"),
                DBOS_DB.replace("postgres://", "postgresql://"),
                str(runs),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"DBOS skipped: {exc}", file=sys.stderr)
        return None
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        "runs_per_s": r["runs"] / r["seconds"],
        "commits_per_run": r["commits"] / r["runs"],
        "client_cpu_ms_per_run": 1000 * r["cpu_seconds"] / r["runs"],
        "server_cpu_ms_per_run": float("nan"),
        "claims_per_run": float("nan"),
        "completes_per_run": float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--k", default="1,4", help="orchestrator process counts (default 1,4)")
    parser.add_argument("--dbos-python", default=os.environ.get("DBOS_PYTHON", sys.executable))
    args = parser.parse_args()
    ensure_database(OURS)
    ensure_database(DBOS_DB)
    setup_django()
    rows = []
    figure = dbos(args.dbos_python, args.runs)
    if figure:
        rows.append(("(a) DBOS Transact, 1 process", figure))
    for k in [int(x) for x in args.k.split(",")]:
        rows.append((f"(a) buzz workflows, K={k}", ours(k, args.runs, send=False)))
    for k in [int(x) for x in args.k.split(",")]:
        rows.append((f"(b) buzz workflows + send_message to 2, K={k}", ours(k, args.runs, send=True)))
    print(
        f"{'figure':48} {'runs/s':>8} {'x DBOS':>7} {'commits/run':>12} {'client ms/run':>14} {'server ms/run':>14} "
        f"{'claims/run':>11} {'completes/run':>14}"
    )
    base = rows[0][1]["runs_per_s"] if figure else float("nan")
    for name, f in rows:
        print(
            f"{name:48} {f['runs_per_s']:8.1f} {f['runs_per_s'] / base:7.2f} {f['commits_per_run']:12.1f} "
            f"{f['client_cpu_ms_per_run']:14.1f} {f['server_cpu_ms_per_run']:14.1f} {f['claims_per_run']:11.2f} "
            f"{f['completes_per_run']:14.2f}"
        )
    print(f"({args.runs} runs per figure; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
