"""The worker's drain with priorities, with a concurrency limit on and off, in one run (issue 32):

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5433/bench_flow python -m bench.flow_control \\
        [--deliveries 5000] [--processes 2] [--rounds 4] [--limits '{"community": 100, "target": 100}']

Each round loads ``--deliveries`` pending deliveries of one community and target with priorities
spread over -10..10, then drains them with ``--processes`` ``run_worker`` processes (16 handler
threads, the default batch, a no-op handler) once without a limit and once under ``--limits``
(the order alternates). Per delivery it measures the CPU of the worker processes (``getrusage``)
and of their database backends (``/proc/<pid>/stat``, sampled every 50 ms), and prints the
medians and the ratio on/off (target: at most 1.15).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from bench import baseline, data, env

TICK = 100.0  # clock ticks per second of /proc/<pid>/stat (Linux's USER_HZ)
START_DELAY = 0.5


def _proc_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def _child(url: str, community_id: uuid.UUID, target: bytes, limits: dict[str, int], start_at: float, out: Any) -> None:
    import resource

    env.setup_django(url)
    from django.conf import settings

    from bench.handlers import noop
    from buzz_delivery.worker import WorkerConfig, run_worker

    settings.BUZZ_DELIVERY = {**getattr(settings, "BUZZ_DELIVERY", {}), "CONCURRENCY_LIMITS": limits}
    while time.monotonic() < start_at:
        time.sleep(0.001)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    before = usage.ru_utime + usage.ru_stime
    summary = dict(
        run_worker(
            WorkerConfig(
                community_id=community_id,
                target_pubkey=target,
                handler=noop,
                concurrency=16,
                poll_interval=0.5,
                idle_exit=1.0,
            ),
            handle_signals=False,
        )
    )
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.put((usage.ru_utime + usage.ru_stime - before, summary.get("finished", 0)))


class BackendCpu(threading.Thread):
    """The CPU seconds of the bench database's backends other than ``skip``, sampled every 50 ms
    (the last reading of each backend is kept: it only grows)."""

    def __init__(self, url: str, skip: set[int]) -> None:
        super().__init__(daemon=True)
        self.url, self.skip, self.seen = url, skip, {}
        self.done = threading.Event()

    def run(self) -> None:
        name = self.url.rsplit("/", 1)[1]
        with env.connect(self.url) as conn:
            self.skip.add(conn.execute("SELECT pg_backend_pid()").fetchone()[0])
            while not self.done.wait(0.05):
                pids = [r[0] for r in conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", [name])]
                for pid in pids:
                    if pid not in self.skip:
                        self.seen[pid] = max(self.seen.get(pid, 0.0), _proc_cpu(pid))

    def total(self) -> float:
        self.done.set()
        self.join()
        return sum(self.seen.values())


def drain(url: str, conn: Any, tenant: data.Tenant, args: argparse.Namespace, limits: dict[str, int]) -> float:
    """CPU seconds (workers + their backends) per delivery of one drain."""
    data.clear_deliveries(conn)
    data.load(conn, tenant, args.deliveries)
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")
        for table in (data.OURS, data.QUEUE):  # the record and its copy the claim walks (issue 31)
            conn.execute(
                f"UPDATE {table} SET priority = (abs(hashtext(id::text) %% 21) - 10)::int WHERE community_id = %s",
                [tenant.community_id],
            )
    data.analyze(conn)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.monotonic() + START_DELAY + 3.0  # Django start-up is not timed
    procs = [
        ctx.Process(target=_child, args=(url, tenant.community_id, data.target(0), limits, start_at, out))
        for _ in range(args.processes)
    ]
    watch = BackendCpu(url, {conn.info.backend_pid})
    watch.start()
    for proc in procs:
        proc.start()
    results = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    server = watch.total()
    finished = sum(n for _, n in results)
    if finished != args.deliveries:
        raise RuntimeError(f"drained {finished} of {args.deliveries}")
    return (sum(cpu for cpu, _ in results) + server) / finished


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.flow_control", description=__doc__.splitlines()[0])
    parser.add_argument("--deliveries", type=int, default=5000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--limits", type=json.loads, default={"community": 100, "target": 100})
    args = parser.parse_args(argv)
    url = env.database_url()
    env.ensure_database(url)
    env.setup_django(url)
    env.migrate()
    from buzz_delivery.services.flow import parse_limits

    limits = parse_limits(args.limits)
    conn = env.connect(url)
    baseline.create_table(conn)  # (data.reset empties it too)
    data.reset(conn)
    (tenant,) = data.create_tenants(1)
    runs: dict[str, list[float]] = {"off": [], "on": []}
    for round_ in range(args.rounds):
        for name in ["off", "on"] if round_ % 2 == 0 else ["on", "off"]:
            runs[name].append(drain(url, conn, tenant, args, limits if name == "on" else {}) * 1e6)
            print(f"round {round_ + 1} limit {name}: {runs[name][-1]:.0f} us CPU/delivery", flush=True)
    off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
    print(
        f"\nworker drain, {args.deliveries} deliveries with priorities -10..10, {args.processes} processes:"
        f" limit off {off:.0f} us CPU/delivery, limit on {limits} {on:.0f} us CPU/delivery,"
        f" on/off {on / off:.3f} (medians of {args.rounds}; target <= 1.15)"
    )
    conn.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
