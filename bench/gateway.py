"""The gateway benchmark: deliveries per second through the HTTP gateway with K = 1 and 4 remote
workers (``python -m buzz_delivery.gateway.client work``), next to the in-process worker
(``manage.py run_delivery_worker``) in the same run, and the long-poll wake latency.

Run: ``BENCH_GATEWAY_DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_gw .venv/bin/python -m bench.gateway``
(the database is created and migrated if missing; its deliveries are deleted). Prints figures;
asserts nothing. Everything talks to 127.0.0.1 only, and every loop is bounded.

- Throughput: N deliveries committed for one agent in one community, then drained; the rate is
  the deliveries settled divided by the span of their ``finished_at`` (database clock).
- Wake latency: a long-poll claim waits on an empty inbox; the bench commits one delivery and
  times commit-returned -> claim-response-received, ``LATENCY_SAMPLES`` times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/bench_gw"
LATENCY_SAMPLES = 20


def setup_django(url: str) -> None:
    name = url.rsplit("/", 1)[1]
    subprocess.run(["createdb", "-h", "127.0.0.1", "-U", "postgres", name], capture_output=True)
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def commit(community, target: bytes, n: int) -> None:
    from buzz_delivery import services
    from buzz_delivery.testing import BindingFactory, EventFactory, WorkflowRunFactory

    run, event = WorkflowRunFactory(community=community), EventFactory(community=community)
    for start in range(0, n, 500):
        bindings = [
            BindingFactory.build(run=run, message_event=event, target_pubkey=target) for _ in range(min(500, n - start))
        ]
        services.commit_deliveries(community.id, event, bindings)


def rate(community_id) -> tuple[int, float]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*), extract(epoch FROM max(finished_at) - min(finished_at)) FROM buzz_delivery_delivery"
            " WHERE community_id = %s AND status = 'finished'",
            [community_id],
        )
        count, span = cursor.fetchone()
    return count, count / float(span or 1e-9)


def left_over(community_id) -> str:
    """The deliveries a drain left unsettled, by status (``claimed=100``: leased to a worker
    that never settled them; ``pending=62``: not claimed, or a lapsed lease the reaper took
    back), "" when none."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT status, count(*) FROM buzz_delivery_delivery WHERE community_id = %s AND status <> 'finished'"
            " GROUP BY status ORDER BY status",
            [community_id],
        )
        return " ".join(f"{status}={n}" for status, n in cursor.fetchall())


def transactions() -> int:
    """Transactions the benchmark's database has ended so far (``pg_stat_database``): every
    connection's, once flushed. Backends flush their counts at most every second while busy and
    within ``STATS_FLUSH_WAIT`` seconds of going idle (PostgreSQL's PGSTAT_IDLE_INTERVAL, 10 s)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()")
        return int(cursor.fetchone()[0])


STATS_FLUSH_WAIT = 11.0


def clear(community_id) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM buzz_delivery_delivery_record WHERE community_id = %s", [community_id])


def start_gunicorn(url: str, port: int, log, root: Path = ROOT) -> subprocess.Popen:
    # Persistent connections (Django's CONN_MAX_AGE, from the URL): each gthread thread keeps its
    # own instead of opening one per request. ``root``: the tree served (--before-root: main's).
    env = {**os.environ, "DATABASE_URL": f"{url}?conn_max_age=60", "PYTHONPATH": str(root), "LOG_LEVEL": "WARNING"}
    # One agent drains the queue with K workers of 8 handler threads: its requests in flight may
    # exceed the per-key bound the server keeps for a fleet of agents (docs/gateway.md).
    env["BUZZ_GATEWAY_MAX_REQUESTS_PER_KEY"] = "64"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "project.wsgi:application", "--worker-class", "gthread",
         "--workers", "2", "--threads", "32", "--bind", f"127.0.0.1:{port}", "--chdir", str(root),
         "--no-control-socket"],
        env=env, stdout=log, stderr=log, cwd=str(root),  # -m puts the cwd first on sys.path
    )  # fmt: skip
    import httpx

    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/gateway/v1/openapi.json", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("gunicorn did not start")


def drain(procs: list[subprocess.Popen], timeout: float = 600) -> float:
    started = time.monotonic()
    for proc in procs:
        proc.wait(timeout=max(1.0, timeout - (time.monotonic() - started)))
    return time.monotonic() - started


def remote_workers(
    base: str, key_file: Path, k: int, concurrency: int, tmp: Path, claim_ahead: int | None = None, root: Path = ROOT
) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "buzz_delivery.gateway.client",
                "work",
                "--url",
                base,
                "--key-file",
                str(key_file),
                "--handler",
                "bench.handlers:noop",
                "--concurrency",
                str(concurrency),
                "--idle-exit",
                "2",
                "--wait-seconds",
                "1",
                *([] if claim_ahead is None else ["--claim-ahead", str(claim_ahead)]),
            ],
            env=env,
            stdout=open(tmp / f"runs-{root.name}-{k}-{i}.out", "w"),
            stderr=open(tmp / f"runs-{root.name}-{k}-{i}.err", "w"),  # kept: a short drain says why
            cwd=str(root),  # -m puts the cwd first on sys.path: import this tree
        )
        for i in range(k)
    ]


# The in-process worker's --batch-size: what ``work`` claims and settles per request at most
# (its CLAIM_LIMIT and SETTLE_BATCH, the gateway's MAX_CLAIM_LIMIT), so both run alike.
LOCAL_BATCH = 100


def local_worker(url: str, community_id, target: bytes, concurrency: int) -> subprocess.Popen:
    env = {**os.environ, "DATABASE_URL": url, "LOG_LEVEL": "WARNING"}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "run_delivery_worker", "--community", str(community_id),
         "--target", target.hex(), "--handler", "bench.handlers:noop", "--concurrency", str(concurrency),
         "--batch-size", str(LOCAL_BATCH), "--poll-interval", "0.5", "--idle-exit", "2", "-v", "0"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def commit_runs(community, agent: bytes, n: int) -> None:
    import uuid

    from buzz_delivery.agents.services import intake_event

    for _ in range(n):
        intake_event(community.id, "bench", uuid.uuid4().hex, {}, agent, timeout_seconds=3600)


def run_rate(community_id) -> tuple[int, float]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*), extract(epoch FROM max(finished_at) - min(finished_at)) FROM buzz_agents_run"
            " WHERE community_id = %s AND state = 'completed'",
            [community_id],
        )
        count, span = cursor.fetchone()
    return count, count / float(span or 1e-9)


def signed_requests(agent: bytes) -> int:
    """The signed requests of ``agent`` the gateway accepted so far (its replay store's rows)."""
    from buzz_delivery.gateway.models import SeenEvent

    return SeenEvent.objects.filter(pubkey=agent).count()


def clear_runs(community_id) -> None:
    from buzz_delivery.agents.models import AgentRun

    AgentRun.objects.filter(community_id=community_id).delete()


def remote_run_workers(
    base: str, key_file: Path, k: int, concurrency: int, tmp: Path, root: Path = ROOT
) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "buzz_delivery.gateway.client",
                "work-runs",
                "--url",
                base,
                "--key-file",
                str(key_file),
                "--handler",
                "bench.handlers:three_calls",
                "--concurrency",
                str(concurrency),
                "--idle-exit",
                "2",
                "--wait-seconds",
                "1",
                "--no-accept",
            ],
            env=env,
            stdout=open(tmp / f"runs-{root.name}-{k}-{i}.out", "w"),
            stderr=open(tmp / f"runs-{root.name}-{k}-{i}.err", "w"),  # kept: a short row says why
            cwd=str(root),  # -m puts the cwd first on sys.path: import this tree
        )
        for i in range(k)
    ]


def client_logs(tmp: Path, log_dir: Path | None, label: str) -> str:
    """The clients' (work-runs or work) stderr and summaries of the case just run: moved to ``log_dir``
    (when given) under ``label``; returns the warnings' count by kind (``run_error=2``), "" for none."""
    kinds: dict[str, int] = {}
    for path in sorted(tmp.glob("runs-*.err")) + sorted(tmp.glob("runs-*.out")):
        text = path.read_text()
        for line in text.splitlines() if path.suffix == ".err" else []:
            words = line.split()  # "date time LEVEL logger message...": count by the message's first word
            if len(words) > 4 and words[2] in ("WARNING", "ERROR", "CRITICAL"):
                key = words[4].split("=")[0].rstrip(":")
                kinds[key] = kinds.get(key, 0) + 1
            elif line.startswith("Traceback"):
                kinds["traceback"] = kinds.get("traceback", 0) + 1
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            (log_dir / f"{label.replace(' ', '_').replace(':', '').replace('=', '')}-{path.name}").write_text(text)
        path.unlink()
    return " ".join(f"{k}={v}" for k, v in sorted(kinds.items()))


def client_summaries(log_dir: Path | None, label: str) -> str:
    """The nonzero counts of the case's ``work`` clients' JSON summaries, added up, with their
    exit reasons (``abandoned=62 settle_errors=100 reason=idle_exit``): a short drain's cause."""
    if log_dir is None:
        return ""
    import json

    totals: dict[str, int] = {}
    reasons: set[str] = set()
    prefix = label.replace(" ", "_").replace(":", "").replace("=", "")
    for path in sorted(log_dir.glob(f"{prefix}-runs-*.out")):
        for line in path.read_text().splitlines():
            try:
                data = json.loads(line)
            except ValueError:
                continue
            for key in ("settle_errors", "abandoned", "lease_lost", "errors", "retried", "failed"):
                totals[key] = totals.get(key, 0) + int(data.get(key) or 0)
            reasons.add(str(data.get("reason")))
    if not reasons:
        return ""
    return " ".join([f"{k}={v}" for k, v in sorted(totals.items()) if v] + [f"reason={','.join(sorted(reasons))}"])


def local_run_worker(url: str, community_id, agent: bytes, concurrency: int) -> subprocess.Popen:
    env = {**os.environ, "DATABASE_URL": url, "LOG_LEVEL": "WARNING"}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "run_agent_worker", "--community", str(community_id),
         "--agent", agent.hex(), "--handler", "bench.handlers:three_calls", "--concurrency", str(concurrency),
         "--poll-seconds", "0.5", "--exit-when-idle", "--no-listen", "-v", "0"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def runs_mode(
    args, url: str, base: str, key_file: Path, community, target: bytes, tmp: Path, before_base: str | None = None
) -> None:
    """Agent runs of three no-op journaled calls: in-process ``run_agent_worker`` vs remote
    ``work-runs`` (K = 1 and 4), interleaved ``--rounds`` times; with ``--before-root``, each
    remote case also against the gunicorn and client of that tree (A/B in the same round). Each
    rate is also printed as a ratio of the in-process rate of its round."""
    n = args.concurrency
    log_dir = Path(args.log_dir).resolve() if args.log_dir else None
    before = Path(args.before_root).resolve() if args.before_root else None
    cases = [("in-process run_agent_worker x1", lambda: [local_run_worker(url, community.id, target, n)])]
    for k in (1, 4):
        cases.append((f"gateway work-runs K={k}", lambda k=k: remote_run_workers(base, key_file, k, n, tmp)))
        if before is not None and before_base is not None:
            cases.append(
                (
                    f"before: work-runs K={k}",
                    lambda k=k: remote_run_workers(before_base, key_file, k, n, tmp, root=before),
                )
            )
    rates: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    for round_no in range(1, args.rounds + 1):
        baseline = 0.0
        for label, start in cases:
            clear_runs(community.id)
            commit_runs(community, target, args.count)
            signed = signed_requests(target)
            wall = drain(start())
            settled, per_second = run_rate(community.id)
            per_run = (signed_requests(target) - signed) / max(settled, 1)
            logged = client_logs(tmp, log_dir, f"round{round_no}-{label}")
            baseline = baseline or per_second
            rates.setdefault(label, []).append(per_second)
            ratios.setdefault(label, []).append(per_second / baseline)
            print(
                f"round {round_no} {label:32s} completed={settled:6d} rate={per_second:8.1f}/s "
                f"ratio={per_second / baseline:5.2f} wall={wall:6.1f}s requests/run={per_run:5.2f} "
                f"load={os.getloadavg()[0]:.2f}" + (f" stderr: {logged}" if logged else ""),
                flush=True,
            )
    for label, values in rates.items():
        r = ratios[label]
        print(
            f"median {label:32s} {statistics.median(values):8.1f}/s  ratio median {statistics.median(r):.2f}"
            f" range {min(r):.2f}-{max(r):.2f}"
        )
    print(f"load average {os.getloadavg()}", flush=True)
    clear_runs(community.id)


def wake_latency(base: str, key: bytes, community, target: bytes) -> list[float]:
    from buzz_delivery.gateway.client import GatewayClient

    client = GatewayClient(base, key)
    samples = []
    for _ in range(LATENCY_SAMPLES):
        got: dict[str, float] = {}

        def wait(got: dict[str, float] = got) -> None:
            client.claim(wait_seconds=10)
            got["t"] = time.monotonic()

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.3)  # let the claim find the inbox empty and start waiting
        commit(community, target, 1)
        committed = time.monotonic()
        waiter.join(15)
        samples.append(got["t"] - committed)
    client.close()
    return samples


def deliveries_mode(
    args, url: str, base: str, key_file: Path, community, target: bytes, tmp: Path, before_base: str | None = None
) -> None:
    """The in-process worker, then ``work`` K = 1 and 4 (and with ``--claim-ahead 0``), interleaved
    ``--rounds`` times; each rate also as a ratio of the in-process rate of its round. With
    ``--before-root``, each ``work`` case also against the gunicorn and client of that tree."""
    n = args.concurrency
    log_dir = Path(args.log_dir).resolve() if args.log_dir else None
    before = Path(args.before_root).resolve() if args.before_root else None
    cases = [("in-process run_delivery_worker x1", lambda: [local_worker(url, community.id, target, n)])]
    for k in (1, 4):
        cases.append((f"gateway remote workers K={k}", lambda k=k: remote_workers(base, key_file, k, n, tmp)))
        if before is not None and before_base is not None:
            cases.append(
                (
                    f"before: remote workers K={k}",
                    lambda k=k: remote_workers(before_base, key_file, k, n, tmp, root=before),
                )
            )
    ratios: dict[str, list[float]] = {}
    if args.no_ahead:
        cases += [
            ("remote K=1 --claim-ahead 0", lambda: remote_workers(base, key_file, 1, n, tmp, 0)),
            ("remote K=4 --claim-ahead 0", lambda: remote_workers(base, key_file, 4, n, tmp, 0)),
        ]
    for round_no in range(1, args.rounds + 1):
        baseline = 0.0
        for label, start in cases:
            clear(community.id)
            commit(community, target, args.count)
            time.sleep(STATS_FLUSH_WAIT)  # the gunicorn threads' counts of the case before
            signed, xacts = signed_requests(target), transactions()
            wall = drain(start())
            settled, per_second = rate(community.id)
            left = left_over(community.id)
            per_delivery = (signed_requests(target) - signed) / max(settled, 1)
            time.sleep(STATS_FLUSH_WAIT)  # every connection's counts flushed (the workers exited)
            xact_per = (transactions() - xacts) / max(settled, 1)
            logged = client_logs(tmp, log_dir, f"round{round_no}-{label}")
            summary = client_summaries(log_dir, f"round{round_no}-{label}")
            baseline = baseline or per_second
            ratios.setdefault(label, []).append(per_second / baseline)
            print(
                f"round {round_no} {label:36s} settled={settled:6d} rate={per_second:8.0f}/s "
                f"ratio={per_second / baseline:5.2f} wall={wall:6.1f}s requests/delivery={per_delivery:6.3f} "
                f"xacts/delivery={xact_per:6.3f} load={os.getloadavg()[0]:.2f}"
                + (f" left: {left}" if left else "")
                + (f" clients: {summary}" if summary else "")
                + (f" stderr: {logged}" if logged else ""),
                flush=True,
            )
    for label, r in ratios.items():
        print(f"median {label:36s} ratio median {statistics.median(r):.2f} range {min(r):.2f}-{max(r):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--count",
        type=int,
        default=3000,
        help="deliveries (or runs) per case (default 3000; deliveries: 50000 or more drain for 10 s or more)",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="handler threads per worker process")
    parser.add_argument("--runs", action="store_true", help="agent runs (work-runs) instead of deliveries")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (default 1)")
    parser.add_argument(
        "--before-root",
        default=os.environ.get("BENCH_BEFORE_ROOT"),
        help="also serve and run the remote workers from this tree (e.g. main's), A/B in each round",
    )
    parser.add_argument(
        "--log-dir",
        help="keep each remote client's (work-runs, work) stderr and summary there (a short row's cause)",
    )
    parser.add_argument(
        "--no-ahead",
        action="store_true",
        help="also run the remote workers with work --claim-ahead 0 (claims for free threads only)",
    )
    args = parser.parse_args()
    url = os.environ.get("BENCH_GATEWAY_DATABASE_URL", DEFAULT_URL)
    setup_django(url)
    from buzz_delivery.gateway import nip98, services
    from buzz_delivery.testing import CommunityFactory

    key = os.urandom(32)
    target = nip98.public_key_of(key)
    community = CommunityFactory()
    services.enroll(community.id, target, enrolled_by="bench")
    with tempfile.TemporaryDirectory(prefix="bench_gw_") as tmp_name:
        tmp = Path(tmp_name)
        key_file = tmp / "agent.key"
        key_file.write_text(key.hex())
        port = 18000 + os.getpid() % 1000
        base = f"http://127.0.0.1:{port}/gateway/v1"
        with open(tmp / "gunicorn.log", "w") as log:
            server = start_gunicorn(url, port, log)
            try:
                mode = runs_mode if args.runs else deliveries_mode
                if args.before_root:
                    before_base = f"http://127.0.0.1:{port + 1}/gateway/v1"
                    root = Path(args.before_root).resolve()
                    with open(tmp / "gunicorn-before.log", "w") as before_log:
                        before_server = start_gunicorn(url, port + 1, before_log, root=root)
                        try:
                            mode(args, url, base, key_file, community, target, tmp, before_base)
                        finally:
                            before_server.terminate()
                            before_server.wait(15)
                    if args.runs:
                        return
                elif args.runs:
                    runs_mode(args, url, base, key_file, community, target, tmp)
                    return
                else:
                    deliveries_mode(args, url, base, key_file, community, target, tmp)
                clear(community.id)
                samples = wake_latency(base, key, community, target)
                ms = sorted(s * 1000 for s in samples)
                print(
                    f"long-poll wake latency (commit -> claim response), n={len(ms)}: "
                    f"median={statistics.median(ms):.1f} ms p95={ms[int(0.95 * (len(ms) - 1))]:.1f} ms "
                    f"max={ms[-1]:.1f} ms",
                    flush=True,
                )
            finally:
                server.terminate()
                server.wait(15)
    clear(community.id)


if __name__ == "__main__":
    main()
