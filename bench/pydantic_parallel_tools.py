"""Parallel tool calls of a Pydantic AI agent on the threaded worker: what journal replay by scope
buys (``docs/agents.md`` "Parallel calls"). A ``FunctionModel`` agent (no network) whose first
response asks for 3 tool calls at once, each tool waiting ``--call-seconds`` (0.5 s, an async
sleep standing in for an API call), then answers: 2 model requests + 3 tool calls, 5 journal
entries per run. Run by ``DurableAgent`` in one ``AgentWorker`` (``run_agent_worker``'s threaded
path) with 1 and 64 handler threads (runs in flight), two ways in the same run, interleaved (the
order rotates per repetition):

- ``parallel``: the integration as it is: the 3 calls run at once, each journaled in the scope
  ``tool:<tool_call_id>``;
- ``sequential``: the integration's fallback for a runtime without replay scopes (``Journal.parallel``
  False: every tool's definition made ``sequential=True``, calls in the root scope), which is
  what the integration did for every runtime before replay by scope: the baseline.

With ``--runtime loop``, the same on the event-loop worker (``AsyncAgentWorker``, ``run_agent_worker
--async``: ``--in-flight`` runs held as tasks on one loop, 2 pool connections), the handler
``await DurableAgent.run(ctx)``; ``sequential`` there is the same fallback over its ``AsyncJournal``.

With ``--dbos``, Pydantic AI's own DBOS integration (``DBOSDurability``, its default
``parallel_ordered_events``: the tools at once, each a DBOS step) runs the same agent with the
same runs in flight in its own process (``bench/dbos_pydantic_ai_parallel.py``, by
``--dbos-python``, which needs ``dbos``; system database: this one's name + ``_dbos``).

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5433/bench_fptbench \\
        python -m bench.pydantic_parallel_tools [--in-flight 1,64] [--repeats 3] [--dbos]

Per figure: runs/s (runs drained / the worker's wall time; runs created before, ``exit_when_idle``)
and per-run latency p50 / p95 (the handler's wall time: the agent run from its first journal call
to its output, not the queueing before the claim; pooled over the repetitions). Runs/s is the
median of the repetitions (min-max beside it). Replay correctness of the parallel calls is covered
by ``tests/test_agents_journal_scopes.py``, not here. Creates and migrates the database (its name
must start with ``bench_f``); prints a Markdown table and writes
``bench/results/pydantic-ai-parallel-tools.md``. Figures only, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from bench.env import ROOT, database_url, ensure_database, facts

URL = database_url()
os.environ["DATABASE_URL"] = URL
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402
from pydantic_ai import Agent  # noqa: E402
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart  # noqa: E402
from pydantic_ai.models.function import AgentInfo, FunctionModel  # noqa: E402

from buzz_delivery.agents.integrations.journal import Journal, journal_for  # noqa: E402
from buzz_delivery.agents.integrations.pydantic_ai import DurableAgent  # noqa: E402
from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig  # noqa: E402
from buzz_delivery.agents.services import intake_event  # noqa: E402
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig  # noqa: E402
from buzz_delivery.testing import CommunityFactory  # noqa: E402

CALL_SECONDS = 0.5
TOOLS = 3
MACHINE = ("cores", "PostgreSQL", "synchronous_commit", "fsync", "max_connections", "commit")


def parallel_tools_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Asks for ``lookup`` 3 times in one response, then answers once the 3 results are in."""
    answered = sum(1 for m in messages if m.kind == "request" for p in m.parts if p.part_kind == "tool-return")
    if answered < TOOLS:
        return ModelResponse(
            parts=[ToolCallPart("lookup", {"n": n}, tool_call_id=f"t{n}") for n in range(1, TOOLS + 1)]
        )
    return ModelResponse(parts=[TextPart(f"done {answered}")])


agent = Agent(FunctionModel(parallel_tools_model, model_name="bench"))


@agent.tool_plain
async def lookup(n: int) -> dict[str, int]:
    await asyncio.sleep(CALL_SECONDS)  # an API call
    return {"n": n}


class SequentialDurableAgent(DurableAgent):
    """The baseline: the integration's path for a runtime without replay scopes (every tool
    ``sequential=True``, calls in the root scope), as it ran on every runtime before."""

    async def run(self, ctx: Any, journal: Journal | None = None) -> Any:
        journal = journal or journal_for(ctx)
        journal.parallel = False
        return await super().run(ctx, journal)


VARIANTS = {"parallel": DurableAgent(agent), "sequential": SequentialDurableAgent(agent)}


def timed(handler: Any, latencies: list[float]) -> Any:
    def run(ctx: Any) -> Any:
        started = time.perf_counter()
        output = handler(ctx)
        latencies.append(time.perf_counter() - started)  # list.append: atomic across threads
        return output

    return run


def timed_async(durable: DurableAgent, latencies: list[float]) -> Any:
    async def run(ctx: Any) -> Any:
        started = time.perf_counter()
        output = await durable.run(ctx)
        latencies.append(time.perf_counter() - started)
        return output

    return run


RUNTIME = "thread"


def measure(handler: Any, n: int, k: int) -> tuple[float, list[float], float]:
    """``n`` runs drained by one ``AgentWorker`` with ``k`` handler threads (or, ``--runtime
    loop``, one ``AsyncAgentWorker`` holding ``k`` runs): runs/s, latencies, this process's CPU
    seconds per run (user + system, every thread)."""
    community = CommunityFactory()
    key = os.urandom(32)
    for _ in range(n):
        intake_event(community.id, "bench", uuid.uuid4().hex, {"prompt": "go"}, key, timeout_seconds=3600)
    connections.close_all()
    latencies: list[float] = []
    worker: Any
    if RUNTIME == "loop":
        worker = AsyncAgentWorker(
            AsyncWorkerConfig(
                handler=timed_async(handler, latencies),
                agents=[key],
                communities=[community.id],
                in_flight=k,
                connections=2,
                lease_seconds=60,
                poll_seconds=0.05,
                exit_when_idle=True,
                worker_id=f"bench-ptools-loop-{threading.get_ident()}",
                listen=False,
            )
        )
        started, cpu = time.perf_counter(), time.process_time()
        counts = worker.run()
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        assert counts.get("completed") == n, counts
        return n / elapsed, latencies, cpu / n
    worker = AgentWorker(
        WorkerConfig(
            handler=timed(handler, latencies),
            agents=[key],
            communities=[community.id],
            concurrency=k,
            lease_seconds=60,
            poll_seconds=0.05,
            exit_when_idle=True,
            worker_id=f"bench-ptools-{threading.get_ident()}",
            listen=False,
        )
    )
    started, cpu = time.perf_counter(), time.process_time()
    counts = worker.run()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    assert counts.get("completed") == n, counts
    return n / elapsed, latencies, cpu / n


def _with_db(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


def dbos(python: str, n: int, k: int) -> tuple[float, list[float], float] | None:
    """Pydantic AI's DBOS integration on the same agent, in its own process (None: cannot run)."""
    url = _with_db(URL, urlsplit(URL).path.lstrip("/") + "_dbos").replace("postgres://", "postgresql://")
    ensure_database(url)
    proc = subprocess.run(
        [python, str(ROOT / "bench" / "dbos_pydantic_ai_parallel.py"), url, str(n), str(k), str(CALL_SECONDS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        print(f"DBOS side failed: {proc.stderr.strip()[-2000:]}", file=sys.stderr)
        return None
    result = json.loads(proc.stdout.splitlines()[-1])
    latencies = [float(x) for x in result["latencies"]]
    return result["runs"] / result["seconds"], latencies, result["cpu_seconds"] / result["runs"]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> None:
    global CALL_SECONDS, RUNTIME
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-flight", default="1,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs-per-slot", type=int, default=4, help="runs per figure: this x in-flight (at least 12)")
    parser.add_argument("--call-seconds", type=float, default=CALL_SECONDS)
    parser.add_argument("--runtime", choices=("thread", "loop"), default="thread", help="the worker measured")
    parser.add_argument("--dbos", action="store_true", help="also Pydantic AI's DBOS integration")
    parser.add_argument("--dbos-python", default=os.environ.get("DBOS_PYTHON", sys.executable))
    parser.add_argument("--output", default=None, help="default: bench/results/pydantic-ai-parallel-tools[-loop].md")
    args = parser.parse_args()
    CALL_SECONDS = args.call_seconds
    RUNTIME = args.runtime
    suffix = "-loop" if RUNTIME == "loop" else ""
    output = args.output or str(ROOT / "bench" / "results" / f"pydantic-ai-parallel-tools{suffix}.md")
    logging.getLogger("buzz_delivery.agents").setLevel(logging.WARNING)
    ensure_database(URL)
    call_command("migrate", verbosity=0)
    before = facts(URL)
    measure(VARIANTS["parallel"], 16, 8)  # warm up (imports, plans)
    measure(VARIANTS["sequential"], 16, 8)
    names = [*VARIANTS, *(["dbos"] if args.dbos else [])]
    levels = [int(x) for x in args.in_flight.split(",")]
    rates: dict[tuple[str, int], list[float]] = {}
    lats: dict[tuple[str, int], list[float]] = {}
    cpus: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for k in levels:
            n = max(12, args.runs_per_slot * k)
            for name in order:
                got = dbos(args.dbos_python, n, k) if name == "dbos" else measure(VARIANTS[name], n, k)
                if got is None:
                    continue
                rates.setdefault((name, k), []).append(got[0])
                lats.setdefault((name, k), []).extend(got[1])
                cpus.setdefault((name, k), []).append(got[2])
                print(
                    f"rep {rep + 1} in_flight={k} {name}: {got[0]:.1f} runs/s, p50 {pct(got[1], 0.5) * 1000:.0f} ms,"
                    f" p95 {pct(got[1], 0.95) * 1000:.0f} ms, CPU {got[2] * 1000:.1f} ms/run ({n} runs)",
                    flush=True,
                )
    after = os.getloadavg()

    def rate(name: str, k: int) -> str:
        got = rates.get((name, k))
        if not got:
            return "not run"
        return f"{statistics.median(got):.1f} ({min(got):.1f}-{max(got):.1f})"

    def lat(name: str, k: int) -> str:
        got = lats.get((name, k))
        return "not run" if not got else f"{pct(got, 0.5) * 1000:.0f} / {pct(got, 0.95) * 1000:.0f}"

    def cpu(name: str, k: int) -> str:
        got = cpus.get((name, k))
        return "not run" if not got else f"{statistics.median(got) * 1000:.0f}"

    def ratio(a: str, b: str, k: int) -> str:
        ra, rb = rates.get((a, k)), rates.get((b, k))
        if not ra or not rb:
            return "—"
        return f"{statistics.median(ra) / statistics.median(rb):.2f}"

    def lat_ratio(a: str, b: str, k: int) -> str:
        la, lb = lats.get((a, k)), lats.get((b, k))
        return "—" if not la or not lb else f"{pct(lb, 0.5) / pct(la, 0.5):.2f}"

    header = "| runs in flight | runs per figure | " + " | ".join(
        f"{name} runs/s | {name} latency p50 / p95 (ms) | {name} CPU ms/run" for name in names
    )
    header += " | parallel / sequential runs/s | sequential / parallel p50 latency |"
    if args.dbos:
        header += " parallel / DBOS runs/s |"
    command = " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        f"Pydantic AI agent, {TOOLS} tool calls at once ({CALL_SECONDS} s each, an async sleep), on the"
        + (" event-loop worker (2 pool connections)" if RUNTIME == "loop" else " threaded worker")
        + ": the tool calls run at once (journal replay by scope) vs. one at a time (the integration's"
        " no-scope fallback, as before)"
        + (", and Pydantic AI's DBOS integration on the same agent" if args.dbos else "")
        + f"; {args.repeats} repetitions, interleaved.",
        "",
        f"Command: `BENCH_DATABASE_URL={URL} python -m bench.pydantic_parallel_tools {command}`",
        "",
        "Machine: " + ", ".join(f"{k}: {v}" for k, v in before.items() if k in MACHINE),
        f"Load average (1/5/15 min) at the start: {before['load average (1/5/15 min)']}; at the end: "
        + " / ".join(f"{x:.2f}" for x in after),
        "",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    for k in levels:
        row = f"| {k} | {max(12, args.runs_per_slot * k)} | " + " | ".join(
            f"{rate(name, k)} | {lat(name, k)} | {cpu(name, k)}" for name in names
        )
        row += f" | {ratio('parallel', 'sequential', k)} | {lat_ratio('parallel', 'sequential', k)} |"
        if args.dbos:
            row += f" {ratio('parallel', 'dbos', k)} |"
        lines.append(row)
    lines += [
        "",
        "Runs/s: median of the repetitions (min-max); latency: the handler's wall time per run (the agent run,"
        " not the queueing before its claim), p50 / p95 over all repetitions' runs. Replay correctness of the"
        " parallel calls: `tests/test_agents_journal_scopes.py`. CPU ms/run: the measuring process's CPU (user +"
        " system, all its threads; for DBOS its own process's) over the figure / runs, median of the repetitions;"
        " the database server's CPU is not in it.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(output, "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
