"""OpenAI Agents SDK agent runs per second on the journal (issue 35): an agent whose model (a
``Model`` subclass, no network) makes 3 function tool calls (4 model requests + 3 tool calls = 7
journal entries per run), run by one ``AgentWorker`` with 64 and 256 handler threads (runs in
flight), next to the same agent written with Pydantic AI (``bench/pydantic_agents.py``) and plain
agent runs of 7 journaled no-op calls, in the same run on the same database, interleaved per
concurrency.

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_foai python -m bench.openai_agents [N]

Creates and migrates the database if needed (its name must start with ``bench_f``); prints a
Markdown table and writes ``bench/results/openai-agents.md``. Figures only, never asserted.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from agents import Agent, RunConfig, function_tool
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.testing import assistant_message, function_call
from agents.usage import Usage
from django.core.management import call_command

from bench.env import ROOT, ensure_database
from bench.pydantic_agents import URL, plain, runs_per_second
from bench.pydantic_agents import durable as pydantic_durable
from buzz_delivery.agents.integrations.openai_agents import DurableAgent

# BENCH_IN_FLIGHT="64" runs one of them (a shared database server: 256 handler threads hold ~2 connections each).
CONCURRENCY = tuple(int(k) for k in os.environ.get("BENCH_IN_FLIGHT", "64,256").split(","))


class ThreeTools(Model):
    """Asks for ``lookup`` three times, one at a time, then answers (the shape of the bench)."""

    model = "bench"

    async def get_response(self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any) -> ModelResponse:
        answered = sum(1 for i in input if isinstance(i, dict) and i.get("type") == "function_call_output")
        if answered < 3:
            output = function_call("lookup", {"n": answered + 1}, call_id=f"t{answered + 1}")
        else:
            output = assistant_message(f"done {answered}")
        return ModelResponse(output=[output], usage=Usage(requests=1), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


@function_tool
def lookup(n: int) -> dict:
    return {"n": n}


durable = DurableAgent(
    Agent(name="bench", model=ThreeTools(), tools=[lookup]), run_config=RunConfig(tracing_disabled=True)
)


def main() -> None:
    logging.getLogger("buzz_delivery.agents").setLevel(logging.WARNING)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(args[0]) if args else 1024
    ensure_database(URL)
    call_command("migrate", verbosity=0)
    runs_per_second(durable, 64, 8)  # warm up (imports, plans)
    runs_per_second(pydantic_durable, 64, 8)
    rows = []
    for k in CONCURRENCY:
        figures = {
            "openai_agents": runs_per_second(durable, n, k),
            "pydantic_ai": runs_per_second(pydantic_durable, n, k),
            "plain7": runs_per_second(plain(7), n, k),
        }
        rows.append((k, figures))
        print(k, {name: round(v) for name, v in figures.items()}, flush=True)
    lines = [
        f"OpenAI Agents SDK agent runs on the journal ({n} runs per figure, {os.cpu_count()} cores): a fake-Model"
        " agent making 3 function tool calls (7 journal entries per run), next to the same agent in Pydantic AI"
        " (FunctionModel) and plain agent runs of 7 journaled no-op calls",
        "",
        "| runs in flight | OpenAI Agents SDK, runs/s | Pydantic AI, runs/s | plain, 7 calls, runs/s"
        " | OpenAI Agents / plain 7 | OpenAI Agents / Pydantic AI |",
        "|---|---|---|---|---|---|",
        *[
            f"| {k} | {f['openai_agents']:.0f} | {f['pydantic_ai']:.0f} | {f['plain7']:.0f}"
            f" | {f['openai_agents'] / f['plain7']:.2f} | {f['openai_agents'] / f['pydantic_ai']:.2f} |"
            for k, f in rows
        ],
    ]
    lines += ["", f"Load average at the end (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}"]
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "bench" / "results" / "openai-agents.md").write_text(text)


if __name__ == "__main__":
    main()
