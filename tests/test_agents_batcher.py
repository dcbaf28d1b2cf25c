"""The event-loop worker's Batcher (issue 29): the runs a finished batch resumed queue their next
operation into the next batch, so a process's runs stay in phase and share statements (at K = 4
the no-op bench has one connection a process, and its runs went out of phase on it)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import pytest

from buzz_delivery.agents.batcher import Batcher, DbPool, Operation

COMMUNITY = uuid.uuid4()


def _ops(sizes: list[tuple[str, int]], gate: threading.Event, started: threading.Event) -> dict[str, Operation]:
    def many(name: str) -> Any:
        def run(community: uuid.UUID, items: list[Any]) -> list[Any]:
            sizes.append((name, len(items)))
            if len(sizes) == 1:  # the first batch holds the connection until the test lets it go
                started.set()
                gate.wait()
            return list(items)

        return run

    return {name: Operation(name, many(name), lambda item: item) for name in ("journal", "record")}


async def _scenario(coalesce_turns: int) -> list[tuple[str, int]]:
    """One connection. Runs 0-7 journal a call; while that batch holds the connection, runs 8-15
    queue their result. Then runs 0-7 get their entry, make their (no-op) call and record it."""
    sizes: list[tuple[str, int]] = []
    gate, started = threading.Event(), threading.Event()
    pool = DbPool(1)
    batcher = Batcher(pool, _ops(sizes, gate, started), coalesce_turns=coalesce_turns)
    batcher.start()
    runs = [uuid.uuid4() for _ in range(16)]

    async def first_half(run: uuid.UUID) -> None:
        await batcher.submit("journal", COMMUNITY, run, run)
        await asyncio.sleep(0)  # the call itself: a no-op coroutine
        await batcher.submit("record", COMMUNITY, run, run)

    try:
        early = [asyncio.create_task(first_half(run)) for run in runs[:8]]
        await asyncio.get_running_loop().run_in_executor(None, started.wait)
        late = [asyncio.create_task(batcher.submit("record", COMMUNITY, run, run)) for run in runs[8:]]
        await asyncio.sleep(0)  # queued behind the journal batch
        gate.set()
        await asyncio.gather(*early, *late)
        await batcher.close()
    finally:
        gate.set()
        await asyncio.get_running_loop().run_in_executor(None, pool.close)
    return sizes


def test_the_runs_a_batch_resumed_join_the_next_batch_of_their_next_operation():
    # The journal batch of 8, then ONE record batch of all 16 runs (in phase from here on).
    assert asyncio.run(_scenario(coalesce_turns=3)) == [("journal", 8), ("record", 16)]


def test_without_the_turns_the_runs_go_out_of_phase():
    # What the turns fix: the 8 queued results go alone, the 8 resumed runs' results after them.
    assert asyncio.run(_scenario(coalesce_turns=0)) == [("journal", 8), ("record", 8), ("record", 8)]


def test_coalesce_turns_must_not_be_negative():
    with pytest.raises(ValueError, match="coalesce_turns"):
        Batcher(DbPool(1), {}, coalesce_turns=-1)
