"""Pydantic AI's DBOS integration on the agent of ``bench.pydantic_parallel_tools`` (run by an
interpreter that has ``dbos``): ``python bench/dbos_pydantic_ai_parallel.py DATABASE_URL RUNS
IN_FLIGHT CALL_SECONDS`` runs RUNS DBOS workflows, each running the FunctionModel agent whose first
response asks for 3 tool calls at once (``DBOSDurability``, its default
``parallel_ordered_events``: the tools run at once; every model request a DBOS step, the tool a
DBOS step that sleeps CALL_SECONDS), at most IN_FLIGHT at a time, and prints one JSON line: runs,
seconds (first start to last result), cpu_seconds (this process's, user + system, over that
span) and each workflow's latency (its start to its result)."""

from __future__ import annotations

import asyncio
import json
import sys
import time

from dbos import DBOS, DBOSConfig
from pydantic_ai import Agent
from pydantic_ai.durable_exec.dbos import DBOSDurability
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

TOOLS = 3


def parallel_tools_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    answered = sum(1 for m in messages if m.kind == "request" for p in m.parts if p.part_kind == "tool-return")
    if answered < TOOLS:
        return ModelResponse(
            parts=[ToolCallPart("lookup", {"n": n}, tool_call_id=f"t{n}") for n in range(1, TOOLS + 1)]
        )
    return ModelResponse(parts=[TextPart(f"done {answered}")])


async def main() -> None:
    url, runs, in_flight, call_seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    config: DBOSConfig = {
        "name": "bench_pydantic_ai_parallel_dbos",
        "system_database_url": url,
        "log_level": "WARNING",
        "sys_db_pool_size": min(max(in_flight * 2, 4), 100),
    }
    DBOS(config=config)
    agent = Agent(
        FunctionModel(parallel_tools_model, model_name="bench"),
        name="bench_parallel_agent",
        capabilities=[DBOSDurability()],
    )

    @DBOS.step()
    async def lookup_step(n: int) -> dict[str, int]:
        await asyncio.sleep(call_seconds)  # an API call
        return {"n": n}

    @agent.tool_plain
    async def lookup(n: int) -> dict[str, int]:
        return await lookup_step(n)

    @DBOS.workflow()
    async def run_agent(prompt: str) -> str:
        return (await agent.run(prompt)).output

    DBOS.launch()
    gate = asyncio.Semaphore(in_flight)
    latencies: list[float] = []

    async def one() -> str:
        async with gate:
            started = time.monotonic()
            handle = await DBOS.start_workflow_async(run_agent, "go")
            output = await handle.get_result()
            latencies.append(time.monotonic() - started)
            return output

    await asyncio.gather(*(one() for _ in range(min(runs, 8))))  # warm up
    latencies.clear()
    t0, cpu = time.monotonic(), time.process_time()
    outputs = await asyncio.gather(*(one() for _ in range(runs)))
    t1, cpu = time.monotonic(), time.process_time() - cpu
    assert set(outputs) == {f"done {TOOLS}"}, set(outputs)
    print(json.dumps({"runs": runs, "seconds": t1 - t0, "latencies": latencies, "cpu_seconds": cpu}))
    DBOS.destroy()


if __name__ == "__main__":
    asyncio.run(main())
