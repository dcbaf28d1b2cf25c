"""Worker drains with OpenTelemetry installed but not configured, against without it (issue 34).

    python -m bench.tracing_overhead [--n 3000] [--repeats 3] [--only delivery,agent,workflow]

Each run is a fresh process that makes ``n`` pieces of work, then times one drain of them:

- ``delivery``: ``run_worker`` (4 handler threads, the no-op handler) over ``n`` deliveries
  (hooks: ``buzz.claim``, ``buzz.handler``, ``buzz.settle``);
- ``agent``: ``AgentWorker`` (4 threads) over ``n`` agent runs whose handler makes 3 journaled
  no-op calls (hooks: ``buzz.agent.claim``, ``buzz.agent.run``, ``buzz.agent.call`` x 3);
- ``workflow``: ``run_orchestrator`` (4 step threads) over ``n`` one-step runs of the ``noop``
  function (hook: ``buzz.workflow.step``).

``without`` blocks the ``opentelemetry`` import (as if the extra were not installed: every hook
is the plain call), ``installed`` imports the API with no SDK provider (one check per hook).
Runs alternate; the median client CPU and wall time per item are printed with the ratio
installed / without (the target: within 1.05x). Database: ``BENCH_DATABASE_URL`` (default
``postgres://postgres@127.0.0.1:5432/bench_f_tracing``), created and migrated here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, resource, sys, time, uuid
if sys.argv[1] == "without":
    sys.modules["opentelemetry"] = None  # the import fails as if the extra were not installed
import django
django.setup()
from buzz_delivery import tracing
from buzz_delivery.testing import BindingFactory, CommunityFactory, WorkflowFactory, WorkflowRunFactory, random32
from buzz_delivery import models, services
assert tracing.INSTALLED == (sys.argv[1] == "installed") and tracing.tracer() is None
kind, n = sys.argv[3], int(sys.argv[2])
community = CommunityFactory()


def drain_delivery():
    from buzz_delivery.worker import WorkerConfig, run_worker

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
    return lambda: run_worker(config, handle_signals=False)["finished"]


def drain_agent():
    from buzz_delivery.agents.services import intake_event
    from buzz_delivery.agents.worker import AgentWorker, WorkerConfig

    agent = random32()
    for i in range(n):
        intake_event(community.id, "bench", uuid.uuid4().hex, {"n": i}, agent)

    def handler(ctx):
        for k in range(3):
            ctx.call("noop", lambda args, key: args, {"k": k})
        return {}

    config = WorkerConfig(handler, [agent], communities=[community.id], concurrency=4, exit_when_idle=True,
                          worker_id="bench", listen=False)
    return lambda: AgentWorker(config).run().get("completed", 0)


def drain_workflow():
    from buzz_delivery.services import Cause
    from buzz_delivery.workflows.orchestrator import OrchestratorConfig, run_orchestrator
    from buzz_delivery.workflows.services import publish_definition, start_run

    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, {"steps": [{"key": "a", "kind": "function", "function": "noop"}]})
    for _ in range(n):
        start_run(community.id, workflow.id, {}, cause=Cause.event(os.urandom(32)))
    config = OrchestratorConfig(community_id=community.id, concurrency=4, idle_exit=0.5,
                                poll_interval=0.05)

    def drain():
        summary = run_orchestrator(config, handle_signals=False)
        deadline = time.monotonic() + 10  # max_steps counts claims: wait for the last completions
        from buzz_delivery.workflows.models import Run

        def succeeded():
            return Run.objects.filter(community_id=community.id, state="succeeded").count()

        while succeeded() < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return succeeded()

    return drain


drain = {"delivery": drain_delivery, "agent": drain_agent, "workflow": drain_workflow}[kind]()
cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
done = drain()
cpu1, wall1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
print(json.dumps({"finished": done, "cpu_us": cpu / n * 1e6, "wall_us": (wall1 - wall0) / n * 1e6}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="delivery,agent,workflow", help="drains to run, comma-separated")
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
    kinds = [k for k in args.only.split(",") if k]
    for kind in kinds:
        runs: dict[str, list[dict[str, float]]] = {"without": [], "installed": []}
        for _ in range(args.repeats):
            for variant in ("without", "installed"):
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, variant, str(args.n), kind],
                    check=True,
                    env=env,
                    capture_output=True,
                    text=True,
                ).stdout
                figures = json.loads(out.strip().splitlines()[-1])
                assert figures["finished"] == args.n, figures
                runs[variant].append(figures)
                print(kind, variant, figures, flush=True)
        med = {v: {k: statistics.median(r[k] for r in rs) for k in ("cpu_us", "wall_us")} for v, rs in runs.items()}
        print(f"\n{kind} drain, {args.n} items x {args.repeats} runs each, median per item:")
        for variant, figures in med.items():
            print(f"  {variant:10s} client CPU {figures['cpu_us']:7.1f} us   wall {figures['wall_us']:7.1f} us")
        print(
            f"  installed / without: CPU {med['installed']['cpu_us'] / med['without']['cpu_us']:.3f}x, "
            f"wall {med['installed']['wall_us'] / med['without']['wall_us']:.3f}x\n",
            flush=True,
        )


if __name__ == "__main__":
    main()
