"""Worker drain with OpenTelemetry installed but not configured, against without it (issue 34).

    python -m bench.tracing_overhead [--n 3000] [--repeats 3]

Each run is a fresh process that commits ``n`` deliveries, then times ``run_worker`` (one
process, 4 handler threads, the no-op handler) draining them; ``without`` blocks the
``opentelemetry`` import (as if the extra were not installed), ``installed`` imports the API with
no SDK provider. Runs alternate; the median client CPU and wall time per delivery are printed
with the ratio installed / without (the target: within 1.05x). Database: ``BENCH_DATABASE_URL``
(default ``postgres://postgres@127.0.0.1:5432/bench_f_tracing``), created and migrated here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, resource, sys, time
if sys.argv[1] == "without":
    sys.modules["opentelemetry"] = None  # the import fails as if the extra were not installed
import django
django.setup()
from buzz_delivery import tracing
from buzz_delivery.testing import BindingFactory, CommunityFactory, WorkflowRunFactory, random32
from buzz_delivery import models, services
from buzz_delivery.worker import WorkerConfig, run_worker
assert tracing.INSTALLED == (sys.argv[1] == "installed") and tracing.tracer() is None
n = int(sys.argv[2])
community = CommunityFactory()
run = WorkflowRunFactory(community=community)
target = random32()
first = BindingFactory(run=run, target_pubkey=target)
event = models.Event.objects.get(community_id=community.id, event_id=first.message_event_id)
bindings = [first] + [BindingFactory.build(run=run, target_pubkey=target, message_event_id=first.message_event_id,
                                           step_id=f"s{i}") for i in range(n - 1)]
for i in range(0, n, 1000):
    services.commit_deliveries(community.id, event, bindings[i:i + 1000])
config = WorkerConfig(community_id=community.id, target_pubkey=target, handler=lambda d: None, concurrency=4,
                      max_deliveries=n, idle_exit=5.0, poll_interval=0.05)
cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
summary = run_worker(config, handle_signals=False)
cpu1, wall1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
print(json.dumps({"finished": summary["finished"], "cpu_us": cpu / n * 1e6, "wall_us": (wall1 - wall0) / n * 1e6}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    url = os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/bench_f_tracing")
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "BUZZ_TENANT_ISOLATION": "off",
    }
    server, name = url.rsplit("/", 1)
    subprocess.run(
        ["psql", f"{server}/postgres", "-qc", f"DROP DATABASE IF EXISTS {name}", "-c", f"CREATE DATABASE {name}"],
        check=True,
    )
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], check=True, env=env)
    runs: dict[str, list[dict[str, float]]] = {"without": [], "installed": []}
    for _ in range(args.repeats):
        for variant in ("without", "installed"):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, variant, str(args.n)], check=True, env=env, capture_output=True, text=True
            ).stdout
            figures = json.loads(out.strip().splitlines()[-1])
            assert figures["finished"] == args.n, figures
            runs[variant].append(figures)
            print(variant, figures, flush=True)
    med = {v: {k: statistics.median(r[k] for r in rs) for k in ("cpu_us", "wall_us")} for v, rs in runs.items()}
    print(f"\nworker drain, {args.n} deliveries x {args.repeats} runs each, median per delivery:")
    for variant, figures in med.items():
        print(f"  {variant:10s} client CPU {figures['cpu_us']:7.1f} us   wall {figures['wall_us']:7.1f} us")
    print(
        f"  installed / without: CPU {med['installed']['cpu_us'] / med['without']['cpu_us']:.3f}x, "
        f"wall {med['installed']['wall_us'] / med['without']['wall_us']:.3f}x"
    )


if __name__ == "__main__":
    main()
