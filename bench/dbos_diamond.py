"""DBOS Transact side of ``bench.workflows`` (run by an interpreter that has ``dbos``):
``python bench/dbos_diamond.py DATABASE_URL RUNS`` starts RUNS workflows of DBOS's shape (step1;
step2 and step3 after it; step4 after both: four no-op steps, in code order), waits for all,
and prints one JSON line: runs, seconds (first start to last result), cpu_seconds of this
process over that span, and xact_commit of the system database over it."""

from __future__ import annotations

import json
import resource
import sys
import time

import psycopg
from dbos import DBOS, DBOSConfig


def commits(url: str) -> int:
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()[0]


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    url, runs = sys.argv[1], int(sys.argv[2])
    config: DBOSConfig = {"name": "bench_wf_dbos", "system_database_url": url, "log_level": "WARNING"}
    DBOS(config=config)

    @DBOS.step()
    def step(n: int) -> int:
        return n

    @DBOS.workflow()
    def diamond() -> int:
        step(1)
        step(2)
        step(3)
        return step(4)

    DBOS.launch()
    for h in [DBOS.start_workflow(diamond) for _ in range(20)]:  # warm up
        h.get_result()
    time.sleep(1.2)
    c0, cpu0, t0 = commits(url), cpu(), time.monotonic()
    handles = [DBOS.start_workflow(diamond) for _ in range(runs)]
    for h in handles:
        h.get_result()
    t1, cpu1 = time.monotonic(), cpu()
    time.sleep(1.2)  # statistics reach pg_stat_database within a second
    c1 = commits(url)
    print(json.dumps({"runs": runs, "seconds": t1 - t0, "cpu_seconds": cpu1 - cpu0, "commits": c1 - c0}))
    DBOS.destroy()


if __name__ == "__main__":
    main()
