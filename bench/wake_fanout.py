"""Hint fan-out (issue 31): K idle worker processes listening on one (community, target), and
deliveries trickling in one commit at a time. Every process hears every hint, so each delivery
may cost up to K hinted claims, K-1 of them empty. Counts the claim statements of the K
processes (their summary lines, ``claim_statements``) against the deliveries, and the wake
latency (commit returned -> handler start, as in the ``wake`` scenario) over all of them.

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_fNAME PYTHONPATH=. \\
        python -m bench.wake_fanout --processes 4 --rate 100 -n 1000 [--repeats 3] [--root DIR ...]

``--root DIR`` (repeatable): run the consumers of that source tree too (e.g. ``git archive
main`` extracted), interleaved with this tree's, for an A/B. Each consumer is
:mod:`bench.wake_agents` ``ours`` (4 handler threads, polls every 10 s). The statements counted
include each process's polls (one per process at its start, then one every 10 s) and the
readiness probes' claims; ``per delivery`` divides them all by the measured deliveries.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import data, env

READY_SECONDS = 60.0
LISTENING = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %%'"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _started(outs: list[Path]) -> dict[str, float]:
    started: dict[str, float] = {}
    for out in outs:
        for line in out.read_text().splitlines():
            key, _, at = line.partition(" ")
            started[key] = min(float(at), started.get(key, float(at)))
    return started


def run_once(
    url: str, tenant: data.Tenant, root: Path, k: int, rate: float, n: int, tmp: Path, stagger: str = ""
) -> dict[str, float]:
    from buzz_delivery import services
    from buzz_delivery.models import Event

    conn = env.connect(url)
    data.clear_deliveries(conn)
    conn.close()
    target = data.target(0)
    event = Event.objects.get(pk=tenant.event_pk)
    outs = [tmp / f"c{i}.log" for i in range(k)]
    procs = []
    for out in outs:
        out.write_text("")
        environ = {**os.environ, "LOG_LEVEL": "WARNING", "PYTHONPATH": str(root)}
        if stagger:
            environ["BENCH_HINT_STAGGER"] = stagger
        pair = [str(tenant.community_id), target.hex()]
        command = [sys.executable, "-m", "bench.wake_agents", "ours", url, str(out), *pair]
        procs.append(subprocess.Popen(command, cwd=root, env=environ, stdout=subprocess.DEVNULL))
    counter = iter(range(10**9))

    def commit_one() -> str:
        binding = services.Binding(
            community_id=tenant.community_id,
            workflow_id=tenant.workflow_id,
            run_id=tenant.run_id,
            step_id=f"fanout-{next(counter)}-{os.urandom(4).hex()}",
            target_pubkey=target,
            definition_event_id=data.DEFINITION_EVENT_ID,
            message_event_id=tenant.event_id,
            cause=services.Cause.event(os.urandom(32)),
        )
        (delivery_id,) = services.commit_deliveries(tenant.community_id, event, [binding])
        return str(delivery_id)

    try:
        # Ready: every process LISTENs (a listener's last statement is its LISTEN), and a probe
        # committed since was handled.
        deadline = time.monotonic() + READY_SECONDS
        watch = env.connect(url)
        try:
            while True:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError("wake_fanout: the consumers did not all start")
                (listening,) = watch.execute(LISTENING).fetchone()  # type: ignore[misc]
                if listening >= k:
                    break
                time.sleep(0.2)
        finally:
            watch.close()
        probe = commit_one()
        while probe not in _started(outs):
            if time.monotonic() > deadline:
                raise RuntimeError("wake_fanout: the probe was not handled")
            time.sleep(0.05)
        time.sleep(0.5)
        committed: dict[str, float] = {}
        first = time.monotonic()
        for i in range(n):
            pause = first + i / rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            key = commit_one()
            committed[key] = time.time()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            started = _started(outs)
            if all(key in started for key in committed):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    missing = [key for key in committed if key not in started]
    if missing:
        raise RuntimeError(f"wake_fanout: {len(missing)} of {n} never started")
    statements = claimed = 0
    for out in outs:
        line = json.loads(Path(f"{out}.summary").read_text())
        statements += line["claim_statements"]
        claimed += line["claimed"]
    latencies = [(started[key] - committed[key]) * 1000 for key in committed]
    return {
        "claim_statements": statements,
        "claimed": claimed,
        "per_delivery": statements / n,
        "p50": _percentile(latencies, 0.5),
        "p99": _percentile(latencies, 0.99),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.wake_fanout", description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--rate", type=float, default=100.0, help="deliveries committed per second")
    parser.add_argument("-n", type=int, default=1000, help="deliveries per run")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--hint-stagger",
        type=lambda text: tuple(x for x in text.split(",") if x),
        default=("",),
        help="comma-separated WorkerConfig.hint_stagger values to run each (default: the worker's own)",
    )
    parser.add_argument("--root", type=Path, action="append", default=[], help="another source tree to run too")
    args = parser.parse_args(argv)
    url = env.database_url()
    env.ensure_database(url)
    env.setup_django(url)
    env.migrate()
    conn = env.connect(url)
    data.reset(conn)
    conn.close()
    (tenant,) = data.create_tenants(1)
    roots = [env.ROOT, *args.root]
    print(f"load average {os.getloadavg()[0]:.2f} / {os.getloadavg()[1]:.2f} / {os.getloadavg()[2]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_fanout_") as tmp:
        for repeat in range(args.repeats):
            systems = [(root, stagger) for root in roots for stagger in args.hint_stagger]
            order = systems[repeat % len(systems) :] + systems[: repeat % len(systems)]
            for root, stagger in order:
                r = run_once(url, tenant, root, args.processes, args.rate, args.n, Path(tmp), stagger)
                print(
                    f"fanout root={root} stagger={stagger or 'default'} K={args.processes} "
                    f"rate={args.rate:.0f}/s n={args.n}: "
                    f"claim statements {r['claim_statements']} ({r['per_delivery']:.2f} per delivery), "
                    f"claimed {r['claimed']}, p50 {r['p50']:.2f} ms p99 {r['p99']:.2f} ms",
                    flush=True,
                )
    print(f"load average {os.getloadavg()[0]:.2f} / {os.getloadavg()[1]:.2f} / {os.getloadavg()[2]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
