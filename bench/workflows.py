"""Workflow engine throughput next to DBOS Transact (issue 12): ``python -m bench.workflows``.

(a) DBOS's shape: a 4-step workflow of no-op functions (step1; step2 and step3 after it; step4
after both), runs per second end to end (first start to last run succeeded; after 20 warm-up
runs and an ANALYZE, as DBOS's side warms up with 20), with K = 1 and 4
``run_workflow_worker`` processes; (b) the same with step4 a ``send_message`` to 2 targets whose
deliveries are settled by one ``run_delivery_worker`` process serving both targets (``--target``
given twice: what docs/inbox.md gives for several agents of a community served by one project's
handler, its handler threads and four connections shared; with ``--delivery-worker-per-target``,
by one process per target, as agents deployed apart would run). DBOS runs (a) in
the same run, on the same PostgreSQL, in its own process (``bench/dbos_diamond.py``, with the
interpreter of ``--dbos-python``, which must have ``dbos`` installed).

Printed per figure: runs/s, commits per run (``pg_stat_database.xact_commit`` of the database the
figure uses: it also counts each new connection's start and, for every committed transaction
that sent a NOTIFY, one transaction in every backend of the database that LISTENs, on any
channel, where PostgreSQL reads its notification queue; see ``bench/results/send-shape.md``),
client CPU per run (the orchestrator and delivery worker processes and the starting process;
split after the table: orchestrators / delivery workers / the rest, i.e. the starting and polling
process) and server CPU per run (the PostgreSQL backends of that database, from ``/proc``).
Figures, and two checks that fail the bench loudly (exit status 1, the reason printed): each
batch of runs must finish within ``DRIVE_TIMEOUT`` seconds, and no step may stay claimed
(``running``) longer than the poll interval plus ``LIVENESS_SLACK`` seconds (a liveness check:
the steps are no-ops, so a claim that old is held by an orchestrator that does not run it; the
``longest claim`` column prints the figure). Databases: ``bench_fwf`` (``BENCH_WF_DATABASE``
names another) and the same name + ``_dbos`` (created).

``--before-root DIR`` (or ``BENCH_BEFORE_ROOT``: e.g. a ``git archive`` of main extracted
there) adds, next to each of ours, the same figure with the orchestrator processes run from
that source tree (same database and schema), and ``--repeats N`` runs every figure N times,
interleaved round by round, printing the median (and the range) of each: an A/B on a shared
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
BASE = os.environ.get("BENCH_WF_SERVER", "postgres://postgres@127.0.0.1:5432")
# The databases (created): BENCH_WF_DATABASE names ours (its DBOS twin is that name + "_dbos").
OURS = f"{BASE}/{os.environ.get('BENCH_WF_DATABASE', 'bench_fwf')}"
DBOS_DB = f"{OURS}_dbos"
# Poll interval of the orchestrators; a step claimed longer than this plus LIVENESS_SLACK
# without having run (these steps are no-ops) is held by an orchestrator that does not run it.
POLL_INTERVAL = 0.5
LIVENESS_SLACK = 1.5
# Seconds a batch of runs may take before the bench stops and says so.
DRIVE_TIMEOUT = 120.0
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


HELD = """
SELECT s.claimed_by, s.key, round(extract(epoch FROM now() - s.claimed_at)::numeric, 2) AS held_s
FROM buzz_workflows_step AS s WHERE s.state = 'running' ORDER BY s.claimed_at LIMIT %s
"""


def held_steps(url: str, limit: int = 5) -> list[tuple[str, str, float]]:
    """The running steps claimed longest ago: (claimed_by, key, seconds)."""
    with psycopg.connect(url, autocommit=True) as conn:
        return [(r[0], r[1], float(r[2])) for r in conn.execute(HELD, [limit])]


class LivenessWatch(threading.Thread):
    """Every 0.1 s, how long the oldest running step has been claimed (database clock): with
    no-op steps a claim older than the poll interval and a little slack was held, not run."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.longest = 0.0
        self.worst: list[tuple[str, str, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            held = held_steps(self.url, 3)
            if held and held[0][2] > self.longest:
                self.longest, self.worst = held[0][2], held

    def stop(self) -> None:
        self.done.set()
        self.join()


def setup_django() -> None:
    os.environ["DATABASE_URL"] = OURS
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, check=True, env=os.environ)
    import django

    django.setup()


def ours(k: int, runs: int, send: bool, root: Path = ROOT, one_delivery_worker: bool = False) -> dict[str, float]:
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
    env = {**os.environ, "DATABASE_URL": OURS, "LOG_LEVEL": "WARNING", "PYTHONPATH": str(root)}
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
                str(POLL_INTERVAL),
                "-v",
                "0",
            ],
            cwd=root,
            env=env,
            stdout=(logs / f"orchestrator-{i}.json").open("w"),
            stderr=subprocess.DEVNULL,
        )
        for i in range(k)
    ]
    if send:
        # One worker serving both targets (the default: docs/inbox.md's run_delivery_worker for
        # several pairs in one process), or one per target (--delivery-worker-per-target).
        groups = [targets] if one_delivery_worker else [[t] for t in targets]
        procs += [
            subprocess.Popen(
                [
                    sys.executable,
                    "manage.py",
                    "run_delivery_worker",
                    "--community",
                    str(community.id),
                    *[arg for t in group for arg in ("--target", t.hex())],
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
            for group in groups
        ]
    time.sleep(4)  # processes up and listening

    def drive(n: int) -> None:
        ids = [start_run(community.id, workflow.id, {}, cause=Cause.event(os.urandom(32))).pk for _ in range(n)]
        deadline = time.monotonic() + DRIVE_TIMEOUT
        while Run.objects.filter(community_id=community.id, run_id__in=ids, state="succeeded").count() < n:
            if time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise SystemExit(
                    f"bench.workflows: K={k}: {n} runs not done within {DRIVE_TIMEOUT:.0f} s; "
                    f"steps held longest: {held_steps(OURS)}"
                )
            time.sleep(0.02)

    watch = LivenessWatch(OURS)
    watch.start()
    drive(20)  # warm up, as the DBOS side does
    with connection.cursor() as cursor:  # fresh tables have no statistics yet
        cursor.execute(
            "ANALYZE buzz_workflows_step, buzz_workflows_run, buzz_delivery_workflow_run, buzz_delivery_delivery_record"
            ", buzz_delivery_delivery_queue"
        )
    connection.close()
    c0, s0, b0 = commits(OURS), self_cpu(), backend_cpu(OURS)
    p0 = {p.pid: proc_cpu(p.pid) for p in procs}
    t0 = time.monotonic()
    drive(runs)
    t1 = time.monotonic()
    watch.stop()
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
    orchestrators = sum(p1[p.pid] - p0.get(p.pid, 0) for p in procs[:k])
    delivery_workers = sum(p1[p.pid] - p0.get(p.pid, 0) for p in procs[k:])
    server = sum(cpu - b0.get(pid, 0.0) for pid, cpu in b1.items())
    if watch.longest > POLL_INTERVAL + LIVENESS_SLACK:
        print(
            f"LIVENESS: K={k}: a step stayed claimed {watch.longest:.1f} s without finishing "
            f"(no-op steps; the bound is the poll interval {POLL_INTERVAL} s + {LIVENESS_SLACK} s): {watch.worst}",
            file=sys.stderr,
        )
    return {
        "longest_claim_s": watch.longest,
        "runs_per_s": runs / (t1 - t0),
        "commits_per_run": (c1 - c0) / runs,
        "client_cpu_ms_per_run": 1000 * client / runs,
        "orchestrator_cpu_ms_per_run": 1000 * orchestrators / runs,
        "delivery_worker_cpu_ms_per_run": 1000 * delivery_workers / runs,
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
        "orchestrator_cpu_ms_per_run": float("nan"),
        "delivery_worker_cpu_ms_per_run": float("nan"),
        "server_cpu_ms_per_run": float("nan"),
        "claims_per_run": float("nan"),
        "completes_per_run": float("nan"),
        "longest_claim_s": float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--k", default="1,4", help="orchestrator process counts (default 1,4)")
    parser.add_argument("--shapes", default="a,b", help="figures to run: a (DBOS's shape), b (send_message)")
    parser.add_argument("--dbos-python", default=os.environ.get("DBOS_PYTHON", sys.executable))
    parser.add_argument("--before-root", default=os.environ.get("BENCH_BEFORE_ROOT"))
    parser.add_argument("--repeats", type=int, default=1)
    workers = parser.add_mutually_exclusive_group()
    workers.add_argument(
        "--one-delivery-worker",
        action="store_true",
        default=True,
        help="shape b: one run_delivery_worker serving both targets (the default)",
    )
    workers.add_argument(
        "--delivery-worker-per-target",
        dest="one_delivery_worker",
        action="store_false",
        help="shape b: one run_delivery_worker process per target",
    )
    args = parser.parse_args()
    ensure_database(OURS)
    ensure_database(DBOS_DB)
    setup_django()
    shapes = args.shapes.split(",")
    ks = [int(x) for x in args.k.split(",")]
    roots = [("", ROOT)] + ([(" before", Path(args.before_root))] if args.before_root else [])
    plan: list[tuple[str, Any]] = [("(a) DBOS Transact, 1 process", lambda: dbos(args.dbos_python, args.runs))]
    for shape, send, label in (
        ("a", False, "(a) buzz workflows"),
        ("b", True, "(b) buzz workflows + send_message to 2"),
    ):
        if shape in shapes:
            for k in ks:
                for tag, root in roots:
                    plan.append(
                        (
                            f"{label}{tag}, K={k}",
                            lambda k=k, send=send, root=root: ours(k, args.runs, send, root, args.one_delivery_worker),
                        )
                    )
    figures: dict[str, list[dict[str, float]]] = {}
    loads = []
    for _ in range(args.repeats):
        for name, measure in plan:
            loads.append(os.getloadavg()[0])
            figure = measure()
            if figure:
                figures.setdefault(name, []).append(figure)
    rows = [(name, _median(found)) for name, found in figures.items()]
    figure = figures.get(plan[0][0])
    print(
        f"{'figure':48} {'runs/s':>8} {'x DBOS':>7} {'commits/run':>12} {'client ms/run':>14} {'server ms/run':>14} "
        f"{'claims/run':>11} {'completes/run':>14} {'longest claim s':>16}"
    )
    base = rows[0][1]["runs_per_s"] if figure else float("nan")
    for name, f in rows:
        print(
            f"{name:48} {f['runs_per_s']:8.1f} {f['runs_per_s'] / base:7.2f} {f['commits_per_run']:12.1f} "
            f"{f['client_cpu_ms_per_run']:14.1f} {f['server_cpu_ms_per_run']:14.1f} {f['claims_per_run']:11.2f} "
            f"{f['completes_per_run']:14.2f} {f['longest_claim_s']:16.2f}"
        )
    print(
        "client ms/run split: orchestrators / delivery workers (the bench's, settling shape b's deliveries) / the rest"
    )
    for name, f in rows:
        if name == plan[0][0]:
            continue
        rest = f["client_cpu_ms_per_run"] - f["orchestrator_cpu_ms_per_run"] - f["delivery_worker_cpu_ms_per_run"]
        print(
            f"  {name}: {f['orchestrator_cpu_ms_per_run']:.2f} / {f['delivery_worker_cpu_ms_per_run']:.2f} / {rest:.2f}"
        )
    if args.repeats > 1:
        for name, found in figures.items():
            rates = sorted(f["runs_per_s"] for f in found)
            print(f"  {name}: runs/s {', '.join(f'{r:.1f}' for r in rates)}")
    print(
        f"({args.runs} runs per figure, median of {args.repeats}; load average {min(loads):.2f}-{max(loads):.2f} "
        f"at the figures' starts, {os.getloadavg()[0]:.2f} at the end, on {os.cpu_count()} cores)"
    )
    if "b" in shapes:
        print(
            "(shape b's deliveries: "
            + (
                "one run_delivery_worker serving both targets, the configuration docs/inbox.md gives"
                if args.one_delivery_worker
                else "one run_delivery_worker per target (--delivery-worker-per-target)"
            )
            + ")"
        )
    held = [name for name, f in rows if f["longest_claim_s"] > POLL_INTERVAL + LIVENESS_SLACK]
    if held:
        raise SystemExit(f"bench.workflows: liveness check failed for {', '.join(held)} (see LIVENESS above)")


def _median(found: list[dict[str, float]]) -> dict[str, float]:
    """Each field's median over the repeats (runs/s too: the figure is the middle drain's)."""
    return {key: statistics.median(f[key] for f in found) for key in found[0]}


if __name__ == "__main__":
    main()
