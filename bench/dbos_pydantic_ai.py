"""Pydantic AI's DBOS integration on the agent of ``bench.pydantic_agents`` (run by an interpreter that
has ``dbos``): ``python bench/dbos_pydantic_ai.py DATABASE_URL RUNS IN_FLIGHT`` runs RUNS DBOS
workflows, each running the FunctionModel agent (``DBOSDurability``: every model request a DBOS
step; its tool, 3 calls per run, a DBOS step too), at most IN_FLIGHT at a time, and prints one
JSON line: runs, seconds (first start to last result)."""

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


def three_tools_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    answered = sum(1 for m in messages if m.kind == "request" for p in m.parts if p.part_kind == "tool-return")
    if answered < 3:
        return ModelResponse(parts=[ToolCallPart("lookup", {"n": answered + 1}, tool_call_id=f"t{answered + 1}")])
    return ModelResponse(parts=[TextPart(f"done {answered}")])


async def main() -> None:
    url, runs, in_flight = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    config: DBOSConfig = {
        "name": "bench_pydantic_ai_dbos",
        "system_database_url": url,
        "log_level": "WARNING",
        "sys_db_pool_size": min(in_flight, 100),
    }
    DBOS(config=config)
    agent = Agent(
        FunctionModel(three_tools_model, model_name="bench"), name="bench_agent", capabilities=[DBOSDurability()]
    )

    @DBOS.step()
    async def lookup_step(n: int) -> dict:
        return {"n": n}

    @agent.tool_plain
    async def lookup(n: int) -> dict:
        return await lookup_step(n)

    @DBOS.workflow()
    async def run_agent(prompt: str) -> str:
        return (await agent.run(prompt)).output

    DBOS.launch()
    gate = asyncio.Semaphore(in_flight)

    async def one() -> str:
        async with gate:
            handle = await DBOS.start_workflow_async(run_agent, "go")
            return await handle.get_result()

    await asyncio.gather(*(one() for _ in range(min(runs, 32))))  # warm up
    t0 = time.monotonic()
    outputs = await asyncio.gather(*(one() for _ in range(runs)))
    t1 = time.monotonic()
    assert set(outputs) == {"done 3"}, set(outputs)
    print(json.dumps({"runs": runs, "seconds": t1 - t0}))
    DBOS.destroy()


if __name__ == "__main__":
    asyncio.run(main())
