"""DBOS Transact side of ``bench.agents_io`` (run by an interpreter that has ``dbos``):
``python bench/dbos_agents_io.py DATABASE_URL RUNS IN_FLIGHT CALL_SECONDS`` runs RUNS async
workflows of 3 async steps that each ``await asyncio.sleep(CALL_SECONDS)`` (an agent run's
model/tool calls), at most IN_FLIGHT at once, and prints one JSON line: runs, seconds (first
start to last result), start and end (wall clock, epoch seconds) and cpu_seconds of this process.
With a fifth argument ``--wait`` it prints ``ready`` after launch and warm-up and starts the
timed runs when a line arrives on stdin (``bench.agents_io`` starts K processes together)."""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time

from dbos import DBOS, DBOSConfig


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    url, runs, in_flight, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    wait = sys.argv[5:6] == ["--wait"]
    config: DBOSConfig = {"name": "bench_agents_io_dbos", "system_database_url": url, "log_level": "WARNING"}
    DBOS(config=config)

    @DBOS.step()
    async def call(n: int) -> int:
        await asyncio.sleep(seconds)
        return n

    @DBOS.workflow()
    async def agent_run() -> int:
        total = 0
        for n in (1, 2, 3):
            total += await call(n)
        return total

    DBOS.launch()

    async def drive() -> tuple[float, float, float, float]:
        gate = asyncio.Semaphore(in_flight)

        async def one() -> None:
            async with gate:
                handle = await DBOS.start_workflow_async(agent_run)
                assert await handle.get_result() == 6

        await asyncio.gather(*(one() for _ in range(min(in_flight, 20))))  # warm up
        if wait:
            print("ready", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        start, started, cpu0 = time.time(), time.perf_counter(), cpu()
        await asyncio.gather(*(one() for _ in range(runs)))
        return time.perf_counter() - started, cpu() - cpu0, start, time.time()

    elapsed, used, start, end = asyncio.run(drive())
    print(json.dumps({"runs": runs, "seconds": elapsed, "cpu_seconds": used, "start": start, "end": end}))
    DBOS.destroy()


if __name__ == "__main__":
    main()
