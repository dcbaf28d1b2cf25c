"""Pydantic AI agent runs per second on the journal (issue 35): a ``FunctionModel`` agent that
makes 3 tool calls (4 model requests + 3 tool calls = 7 journal entries per run), run by one
``AgentWorker`` with 64 and 256 handler threads (runs in flight), next to plain agent runs in the
same run on the same database: a handler making 3 journaled no-op calls, and one making 7 (the
journal shape of the agent run), interleaved per concurrency. With ``--dbos``, Pydantic AI's own
DBOS integration (``DBOSAgent``) runs the same agent with the same numbers of runs in flight, in
its own process (``bench/dbos_pydantic_ai.py``; its system database is this one's name +
``_dbos``).

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_fpyd python -m bench.pydantic_agents [N] [--dbos]

Creates and migrates the database if needed (its name must start with ``bench_f``); prints a
Markdown table and writes ``bench/results/pydantic-ai.md``. Figures only, never asserted.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid

from bench.env import ROOT, database_url, ensure_database

URL = database_url()
os.environ["DATABASE_URL"] = URL
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from pydantic_ai import Agent  # noqa: E402
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart  # noqa: E402
from pydantic_ai.models.function import AgentInfo, FunctionModel  # noqa: E402

from buzz_delivery.agents.integrations.pydantic_ai import DurableAgent  # noqa: E402
from buzz_delivery.agents.services import intake_event  # noqa: E402
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig  # noqa: E402
from buzz_delivery.testing import CommunityFactory  # noqa: E402

CONCURRENCY = (64, 256)


def three_tools_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Asks for ``lookup`` three times, one at a time, then answers (the shape of the bench)."""
    answered = sum(1 for m in messages if m.kind == "request" for p in m.parts if p.part_kind == "tool-return")
    if answered < 3:
        return ModelResponse(parts=[ToolCallPart("lookup", {"n": answered + 1}, tool_call_id=f"t{answered + 1}")])
    return ModelResponse(parts=[TextPart(f"done {answered}")])


agent = Agent(FunctionModel(three_tools_model, model_name="bench"))


@agent.tool_plain
def lookup(n: int) -> dict:
    return {"n": n}


durable = DurableAgent(agent)


def plain(calls: int):
    def handler(ctx):
        for n in range(calls):
            ctx.call("noop", _noop, {"n": n})
        return {"ok": True}

    return handler


def _noop(args, key):
    return args


def runs_per_second(handler, n: int, k: int) -> float:
    community = CommunityFactory()
    key = os.urandom(32)
    for _ in range(n):
        intake_event(community.id, "bench", uuid.uuid4().hex, {"prompt": "go"}, key)
    worker = AgentWorker(
        WorkerConfig(
            handler=handler,
            agents=[key],
            communities=[community.id],
            concurrency=k,
            lease_seconds=60,
            poll_seconds=0.05,
            exit_when_idle=True,
            worker_id="bench",
            listen=False,
        )
    )
    started = time.perf_counter()
    counts = worker.run()
    elapsed = time.perf_counter() - started
    assert counts.get("completed") == n, counts
    return n / elapsed


def dbos(n: int, k: int) -> float | None:
    """Runs/s of Pydantic AI's DBOS integration on the same agent (None when it cannot run)."""
    url = f"{URL}_dbos"
    ensure_database(url)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dbos_pydantic_ai.py"), url, str(n), str(k)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        print(f"DBOS side failed: {proc.stderr.strip()[-2000:]}", file=sys.stderr)
        return None
    result = json.loads(proc.stdout.splitlines()[-1])
    return float(result["runs"] / result["seconds"])


def main() -> None:
    logging.getLogger("buzz_delivery.agents").setLevel(logging.WARNING)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(args[0]) if args else 1024
    with_dbos = "--dbos" in sys.argv
    ensure_database(URL)
    call_command("migrate", verbosity=0)
    runs_per_second(durable, 64, 8)  # warm up (imports, plans)
    rows = []
    for k in CONCURRENCY:
        figures = {
            "pydantic_ai": runs_per_second(durable, n, k),
            "plain3": runs_per_second(plain(3), n, k),
            "plain7": runs_per_second(plain(7), n, k),
        }
        figures["dbos"] = dbos(n, k) if with_dbos else None
        rows.append((k, figures))
        print(k, {name: None if v is None else round(v) for name, v in figures.items()}, flush=True)

    def cell(v: float | None) -> str:
        return "not run" if v is None else f"{v:.0f}"

    lines = [
        f"Pydantic AI agent runs on the journal ({n} runs per figure, {os.cpu_count()} cores): a FunctionModel agent"
        " making 3 tool calls (7 journal entries per run), next to plain agent runs of 3 and 7 journaled no-op"
        " calls, and Pydantic AI's DBOS integration on the same agent",
        "",
        "| runs in flight | Pydantic AI on the journal, runs/s | plain, 3 calls, runs/s | plain, 7 calls, runs/s"
        " | Pydantic AI on DBOS (DBOSDurability), runs/s | Pydantic AI / plain 7 |",
        "|---|---|---|---|---|---|",
        *[
            f"| {k} | {cell(f['pydantic_ai'])} | {cell(f['plain3'])} | {cell(f['plain7'])} | {cell(f['dbos'])}"
            f" | {f['pydantic_ai'] / f['plain7']:.2f} |"
            for k, f in rows
        ],
    ]
    lines += ["", f"Load average at the end (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}"]
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "bench" / "results" / "pydantic-ai.md").write_text(text)


if __name__ == "__main__":
    main()
