"""The consumers of the ``wake`` scenario, one per process: ``python -m bench.wake_agents
ours|pgqueuer URL OUT [COMMUNITY TARGET_HEX]``.

Each appends ``<key> <time.time() at handler start>`` to ``OUT`` for every job it runs (``key``:
our delivery id, or the payload PgQueuer carries), so the controller, which wrote down when it
began each commit, can tell commit-to-handler-start latency on the one host clock. Both wait on
``LISTEN``/``NOTIFY`` and poll rarely, so what is measured is the wake path. Stopped by SIGTERM;
ours then writes its summary line (``claim_statements`` ...) to ``OUT.summary``
(``BENCH_HINT_STAGGER``, if set: its ``WorkerConfig.hint_stagger``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

POLL_SECONDS = 10.0  # a poll would hide a missed hint only after this long


class _Log:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (line-buffered, closed at exit)
        self._lock = threading.Lock()

    def write(self, key: str) -> None:
        line = f"{key} {time.time():.6f}\n"
        with self._lock:
            self._file.write(line)


def ours(url: str, out: str, community: str, target_hex: str) -> None:
    from bench import env

    env.setup_django(url)
    from buzz_delivery.worker import WorkerConfig, run_worker

    log = _Log(out)

    def handler(delivery: Any) -> None:
        log.write(str(delivery.id))

    summary = run_worker(
        WorkerConfig(
            community_id=uuid.UUID(community),
            target_pubkey=bytes.fromhex(target_hex),
            handler=handler,
            concurrency=4,
            poll_interval=POLL_SECONDS,
            **({"hint_stagger": float(os.environ["BENCH_HINT_STAGGER"])} if "BENCH_HINT_STAGGER" in os.environ else {}),
        )
    )
    from buzz_delivery.worker.runtime import summary_line

    with open(f"{out}.summary", "w") as file:  # the worker's JSON line (bench.wake_fanout reads it)
        file.write(summary_line(summary) + "\n")


def pgqueuer(url: str, out: str) -> None:
    import asyncio

    import psycopg
    from pgqueuer import QueueManager
    from pgqueuer.db import PsycopgDriver
    from pgqueuer.queries import Queries

    log = _Log(out)

    async def main() -> None:
        conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
        qm = QueueManager(Queries(PsycopgDriver(conn)))

        @qm.entrypoint("wake")
        async def wake(job: Any) -> None:
            log.write((job.payload or b"").decode())

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, qm.shutdown.set)
        try:
            await qm.run(batch_size=10, dequeue_timeout=timedelta(seconds=POLL_SECONDS))
        finally:
            await conn.close()

    asyncio.run(main())


if __name__ == "__main__":
    kind, url, out, *rest = sys.argv[1:]
    if kind == "ours":
        ours(url, out, *rest)
    else:
        pgqueuer(url, out)
    os._exit(0)
