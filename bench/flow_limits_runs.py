"""What a concurrency limit costs the claims of agent runs and workflow steps (issue 32), on and
off in the same run:

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5433/bench_flow python -m bench.flow_limits_runs \\
        [--items 600] [--rounds 4] [--batch 10]

Each round creates ``--items`` pending agent runs of one agent (``intake_event``) and as many
ready steps (runs of one workflow with 10 parallel function steps each), then drains each in one
process: ``claim_agent_runs(limit=--batch)`` then ``complete_run`` per run; ``claim_steps`` then
``complete_steps`` of the batch. It measures the CPU of this process and of its database backend
(``/proc/<pid>/stat``) per item, once without a limit and once under one that does not bind
(``{"agent": 1000, "community": 1000}``, ``{"workflow": 1000, "community": 1000}``: what taking
the slots costs), the order alternating, and prints the medians and the ratio on/off.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
import uuid
from pathlib import Path

from bench import env

TICK = 100.0  # clock ticks per second of /proc/<pid>/stat (Linux's USER_HZ)
AGENT_LIMITS = {"agent": 1000, "community": 1000}
STEP_LIMITS = {"workflow": 1000, "community": 1000}


def _backend_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _cpu(backend: int) -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime + _backend_cpu(backend)


def _analyze() -> None:
    """Fresh statistics after a load, as autovacuum would give a table that grew (stale ones
    make both claims read every pending row: not what this measures)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE buzz_agents_run, buzz_workflows_step, buzz_workflows_run")


def _drain_runs(community_id: uuid.UUID, items: int, batch: int, backend: int) -> float:
    from buzz_delivery.agents.services import claim_agent_runs, complete_run, intake_event

    agent = uuid.uuid4().bytes * 2
    for i in range(items):
        intake_event(community_id, "bench", uuid.uuid4().hex, {"n": i}, agent)
    _analyze()
    done, before = 0, _cpu(backend)
    while done < items:
        claims = claim_agent_runs(community_id, [agent], worker_id="bench", limit=batch, lease_seconds=60)
        if not claims:
            raise RuntimeError(f"drained {done} of {items} runs")
        for claim in claims:
            complete_run(claim.lease, {})
        done += len(claims)
    return (_cpu(backend) - before) / items


def _drain_steps(community_id: uuid.UUID, items: int, batch: int, backend: int) -> float:
    from buzz_delivery.services.types import Cause
    from buzz_delivery.testing import WorkflowFactory
    from buzz_delivery.workflows.services import claim_steps, complete_steps, publish_definition, start_run
    from buzz_delivery.workflows.testing import function_step

    workflow = WorkflowFactory(community_id=community_id)
    version = publish_definition(community_id, workflow.id, {"steps": [function_step(f"s{i}") for i in range(10)]})
    for _ in range(items // 10):
        start_run(community_id, workflow.id, {}, cause=Cause.event(uuid.uuid4().bytes * 2), version=version.version)
    _analyze()
    done, before = 0, _cpu(backend)
    while done < items // 10 * 10:
        claims = claim_steps(community_id, limit=batch, lease_seconds=60)
        if not claims:
            raise RuntimeError(f"drained {done} of {items} steps")
        complete_steps(community_id, [(claim.lease, None) for claim in claims])
        done += len(claims)
    return (_cpu(backend) - before) / done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.flow_limits_runs", description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=10)
    args = parser.parse_args(argv)
    url = env.database_url()
    env.ensure_database(url)
    env.setup_django(url)
    env.migrate()
    from django.db import connection
    from django.test import override_settings

    from buzz_delivery.testing import CommunityFactory

    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = cursor.fetchone()[0]
    results: dict[tuple[str, bool], list[float]] = {}
    for round_ in range(args.rounds):
        for on in (round_ % 2 == 0, round_ % 2 == 1):
            community = CommunityFactory()
            settings = {"AGENT_CONCURRENCY_LIMITS": AGENT_LIMITS, "STEP_CONCURRENCY_LIMITS": STEP_LIMITS} if on else {}
            with override_settings(BUZZ_DELIVERY=settings):
                results.setdefault(("runs", on), []).append(_drain_runs(community.id, args.items, args.batch, backend))
                results.setdefault(("steps", on), []).append(
                    _drain_steps(community.id, args.items, args.batch, backend)
                )
            time.sleep(0.2)
    for what, limits in (("agent runs", AGENT_LIMITS), ("steps", STEP_LIMITS)):
        key = "runs" if what == "agent runs" else "steps"
        off, on = statistics.median(results[(key, False)]), statistics.median(results[(key, True)])
        print(
            f"claim + settle of {what}, batches of {args.batch}, {args.items} a round: limit off "
            f"{off * 1e6:.0f} us CPU/item, limit on {limits} {on * 1e6:.0f} us CPU/item, on/off {on / off:.3f} "
            f"(medians of {args.rounds}; process and its backend)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
