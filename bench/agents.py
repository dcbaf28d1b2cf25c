"""Agent runs per second with a 3-call no-op handler (K = 1 and 4 handler threads of one
``AgentWorker``), next to the core's ``claim_delivery -> finish_delivery`` path with the same
thread counts, measured in the same run on the same database (SPEC 12 "What it must show").

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_fag .venv/bin/python -m bench.agents [N]

Creates and migrates the database if needed (its name must start with ``bench_f``); prints a
Markdown table and writes ``bench/results/agents.md``. Figures only, never asserted.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid

from bench.env import ROOT, database_url, ensure_database

URL = database_url()
os.environ["DATABASE_URL"] = URL
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402

from buzz_delivery import services as core  # noqa: E402
from buzz_delivery.agents.services import intake_event  # noqa: E402
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig  # noqa: E402
from buzz_delivery.testing import BindingFactory, CommunityFactory, EventFactory, WorkflowRunFactory  # noqa: E402


def noop_three(ctx):  # the handler measured: 3 journaled no-op calls
    for n in (1, 2, 3):
        ctx.call("noop", _noop, {"n": n})
    return {"ok": True}


def _noop(args, key):
    return args


def core_path(n: int, k: int) -> float:
    community = CommunityFactory()
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    target = os.urandom(32)
    bindings = [BindingFactory(run=run, message_event=event, target_pubkey=target, step_id=f"s{i}") for i in range(n)]
    for i in range(0, n, 500):
        core.commit_deliveries(community.id, event, bindings[i : i + 500])

    def drain() -> None:
        try:
            while (claim := core.claim_delivery(community.id, target, lease_seconds=60)) is not None:
                core.finish_delivery(claim.lease, "finished")
        finally:
            connections.close_all()

    started = time.perf_counter()
    threads = [threading.Thread(target=drain) for _ in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return n / (time.perf_counter() - started)


def agent_path(n: int, k: int) -> float:
    community = CommunityFactory()
    agent = os.urandom(32)
    for _ in range(n):
        intake_event(community.id, "bench", uuid.uuid4().hex, {}, agent)
    worker = AgentWorker(
        WorkerConfig(
            handler=noop_three,
            agents=[agent],
            communities=[community.id],
            concurrency=k,
            lease_seconds=60,
            poll_seconds=0.05,
            exit_when_idle=True,
            worker_id="bench",
        )
    )
    started = time.perf_counter()
    counts = worker.run()
    elapsed = time.perf_counter() - started
    assert counts.get("completed") == n, counts
    return n / elapsed


def main() -> None:
    logging.getLogger("buzz_delivery.agents").setLevel(logging.WARNING)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    ensure_database(URL)
    call_command("migrate", verbosity=0)
    rows = []
    for k in (1, 4):
        rows.append((k, core_path(n, k), agent_path(n, k)))
    lines = [
        f"Agent runs vs. the core's claim -> finish ({n} items per figure, {os.cpu_count()} cores)",
        "",
        "| threads | core claim->finish deliveries/s | agent runs/s (3 journaled no-op calls) |",
        "|---|---|---|",
        *[f"| {k} | {c:.0f} | {a:.0f} |" for k, c, a in rows],
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "bench" / "results" / "agents.md").write_text(text)


if __name__ == "__main__":
    main()
