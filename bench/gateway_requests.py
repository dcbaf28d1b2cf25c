"""Signed requests and committed transactions per delivery and per run through the gateway, on
the paths ``python -m bench.gateway`` does not take (issue 29): deliveries whose handlers
outlive the renewal period (so ``work`` renews what it holds), deliveries whose handlers raise
(half settle ``failed``, half ``retry``), and agent runs whose handlers fail after three
journaled calls with compensations (so ``work-runs`` fails them, undoes the calls and fails them
again). ``--only renew|failing|runs`` runs one case.

Run: ``BENCH_GATEWAY_DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_gwreq python -m
bench.gateway_requests [--root DIR] [--only CASE]`` where ``--root`` is the checkout whose gateway server and
clients are measured (default: this one; give an older checkout to compare). Prints, per case,
the signed requests per item by route (counted from the clients' ``-v 2`` request lines) and the
transactions committed on the database per item (``pg_stat_database.xact_commit``, read after
the server's idle connections have flushed their statistics). Asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gateway import DEFAULT_URL, clear, clear_runs, commit, setup_django, start_gunicorn

HANDLERS = """
import time

from buzz_delivery.gateway.remote_runs import compensation


def slow(delivery):
    time.sleep(2.5)


class Poison(Exception):
    permanent = True  # settled failed


def failing(delivery):
    if int(delivery["id"][-1], 16) % 2:
        raise Poison("cannot parse")
    raise RuntimeError("try again")  # settled retry


def _noop_call(args, key):
    return {"ok": True}


@compensation
def undo(args, output, key):
    return None


def fail_after_three(ctx):
    for i in range(3):
        ctx.call("noop", _noop_call, {"i": i}, compensate=undo)
    raise RuntimeError("the fourth step is broken")
"""
# pgstat flushes an idle backend's counters after at most 10 s (PGSTAT_IDLE_INTERVAL).
STATS_FLUSH_SECONDS = 11.5
_ROUTE = re.compile(r"HTTP Request: POST \S+?/gateway/v1(\S*)")


def xact_commit(name: str) -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s", [name])
        return int(cursor.fetchone()[0])


def route_of(path: str) -> str:
    """``/communities/<c>/runs/<r>/fail`` -> ``runs/{r}/fail``; batch routes keep their name."""
    parts = path.strip("/").split("/")
    if parts[0] == "communities":
        parts = parts[2:]
    if len(parts) >= 2 and re.fullmatch(r"[0-9a-f-]{36}", parts[1]):
        parts[1] = "{id}"
    return "/".join(parts)


def measure(label: str, name: str, n: int, start, log: Path) -> None:
    time.sleep(STATS_FLUSH_SECONDS)
    before = xact_commit(name)
    began = time.monotonic()
    for proc in start():
        proc.wait(timeout=600)
    wall = time.monotonic() - began
    time.sleep(STATS_FLUSH_SECONDS)
    transactions = xact_commit(name) - before - 1  # the read itself
    routes = collections.Counter(route_of(m.group(1)) for m in _ROUTE.finditer(log.read_text()))
    total = sum(routes.values())
    detail = ", ".join(f"{r} {c / n:.2f}" for r, c in sorted(routes.items()))
    print(f"{label:44s} n={n} wall={wall:5.1f}s requests/item={total / n:5.2f} ({detail}) "
          f"transactions/item={transactions / n:5.2f}", flush=True)  # fmt: skip


def client(root: Path, extra: Path, log: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{extra}"}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return subprocess.Popen(
        [sys.executable, "-m", "buzz_delivery.gateway.client", *args, "-v", "2"],
        cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent), help="checkout to measure")
    parser.add_argument("--deliveries", type=int, default=200, help="deliveries of the renewal case (default 200)")
    parser.add_argument("--runs", type=int, default=100, help="runs of the failure case (default 100)")
    parser.add_argument("--failing", type=int, default=200, help="deliveries of the failing-handler case (default 200)")
    parser.add_argument("--only", choices=("renew", "runs", "failing"), help="run this case only")
    args = parser.parse_args()
    root = Path(args.root).resolve()
    url = os.environ.get("BENCH_GATEWAY_DATABASE_URL", DEFAULT_URL)
    name = url.rsplit("/", 1)[1]
    setup_django(url)
    from buzz_delivery.agents.services import intake_event
    from buzz_delivery.gateway import nip98, services
    from buzz_delivery.testing import CommunityFactory

    key = os.urandom(32)
    target = nip98.public_key_of(key)
    community = CommunityFactory()
    services.enroll(community.id, target, enrolled_by="bench")
    import bench.gateway as gw

    gw.ROOT = root  # the server under test is the checkout's
    with tempfile.TemporaryDirectory(prefix="bench_gwreq_") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "bench_req_handlers.py").write_text(HANDLERS)
        key_file = tmp / "agent.key"
        key_file.write_text(key.hex())
        port = 19000 + os.getpid() % 1000
        base = f"http://127.0.0.1:{port}/gateway/v1"
        common = ["--url", base, "--key-file", str(key_file), "--wait-seconds", "1", "--idle-exit", "3"]
        print(f"root {root}; load average {os.getloadavg()}", flush=True)
        with open(tmp / "gunicorn.log", "w") as glog:
            server = start_gunicorn(url, port, glog)
            try:
                if args.only in (None, "renew"):
                    clear(community.id)
                    commit(community, target, args.deliveries)
                    log = tmp / "work.log"
                    measure(
                        "work: 2.5 s handlers, 50 threads, renew 1 s", name, args.deliveries,
                        lambda: [client(root, tmp, log, "work", *common, "--handler", "bench_req_handlers:slow",
                                        "--concurrency", "50", "--renew-every", "1", "--claim-ahead", "0")],
                        log,
                    )  # fmt: skip
                if args.only in (None, "failing"):
                    # Every handler raises: half the deliveries settle failed, half retry (each
                    # claimed once: --max-deliveries stops the worker before a retry comes back).
                    clear(community.id)
                    commit(community, target, args.failing)
                    log = tmp / "failing.log"
                    measure(
                        "work: failing handlers, 50 threads", name, args.failing,
                        lambda: [client(root, tmp, log, "work", *common, "--handler", "bench_req_handlers:failing",
                                        "--concurrency", "50", "--max-deliveries", str(args.failing))],
                        log,
                    )  # fmt: skip
                clear(community.id)
                if args.only in (None, "runs"):
                    clear_runs(community.id)
                    for _ in range(args.runs):
                        intake_event(community.id, "bench", os.urandom(8).hex(), {}, target, timeout_seconds=3600)
                    log = tmp / "runs.log"
                    measure(
                        "work-runs: fail after 3 calls, 20 threads", name, args.runs,
                        lambda: [client(root, tmp, log, "work-runs", *common, "--handler",
                                        "bench_req_handlers:fail_after_three", "--concurrency", "20", "--no-accept")],
                        log,
                    )  # fmt: skip
                    clear_runs(community.id)
            finally:
                server.terminate()
                server.wait(timeout=30)
        print(f"load average {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
