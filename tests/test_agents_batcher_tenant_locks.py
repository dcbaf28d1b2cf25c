"""The event-loop worker's Batcher under a lock-wait bound (a worker serving several communities,
docs/agents.md): a row held by another transaction costs its community bounded waits, never the
batches of another community, nor the other runs of its own.

Real rows locked by a real transaction (a second session), a real pool of connections and the
Batcher on an event loop of its own thread; waits poll for a condition, nothing is timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

import pytest

from buzz_delivery.agents.batcher import Batcher, DbPool, operations
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import batch
from buzz_delivery.agents.services.types import Finished
from buzz_delivery.lockwaits import Skipped
from buzz_delivery.testing import CommunityFactory
from tests.agents_support import claim, new_run
from tests.tenant_locks import backends_waiting_for_a_lock, rows_held
from tests.test_worker import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

LOCK_WAIT_MS = 200


class LoopBatcher:
    """A Batcher (one pool connection, the lock-wait bound) on an event loop in a thread of its
    own; :meth:`complete` submits run completions from the test's thread."""

    def __init__(self, skipped: Skipped) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.pool = DbPool(1)

        async def make() -> Batcher:
            batcher = Batcher(self.pool, operations(30), lock_wait_ms=LOCK_WAIT_MS, skipped=skipped)
            batcher.start()
            return batcher

        self.batcher = asyncio.run_coroutine_threadsafe(make(), self.loop).result(timeout=30)

    def complete(self, *leases: Any) -> list[Future]:
        """Each lease's completion, submitted in the same loop turn (so in one batch)."""
        futures: list[Future] = [Future() for _ in leases]

        def submit() -> None:
            for lease, future in zip(leases, futures, strict=True):
                item = batch.prepare_completion(lease, {"done": str(lease.run_id)})
                task = self.loop.create_task(self.batcher.submit("complete", lease.community_id, lease.run_id, item))
                task.add_done_callback(lambda t, f=future: _settle(f, t))

        self.loop.call_soon_threadsafe(submit)
        return futures

    def run(self, coro: Any, timeout: float = 60) -> Any:
        """Run ``coro`` on the batcher's loop; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)

    def idle(self) -> bool:
        """Whether nothing is queued or being written (read on the loop)."""

        async def look() -> bool:
            return not self.batcher._pending and not self.batcher._flushes

        return self.run(look())

    def __enter__(self) -> LoopBatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        async def stop() -> None:
            task = self.batcher._task
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.pool.close()
        self.loop.close()


def _settle(future: Future, task: asyncio.Task) -> None:
    if task.cancelled():
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())


def state(run_id: uuid.UUID) -> str:
    return AgentRun.objects.get(id=run_id).state


class ExpiringWhileAsked(Skipped):
    """Skipped, whose answer that a community is skipped comes back only once that skip is over:
    the instant between the dispatcher's finding every queued group's community skipped and its
    asking how long to wait, in which a skip can end, made as wide as the skip."""

    def waits(self, community: uuid.UUID) -> bool:
        until = self._until.get(community)
        if not super().waits(community):
            return False
        if until is not None:
            time.sleep(max(0.0, until - time.monotonic()) + 0.01)
        return True


def test_a_community_whose_skip_ends_while_the_dispatcher_looks_is_dispatched_again(community):
    """A run's completion waits past the bound (its row is held): its community is left a
    while. Its skip ends between the dispatcher's look at the queue (every group's community
    skipped) and its asking for the next try (none skipped by then): the completion goes again
    at once, with no other submit to wake the dispatcher (before, it waited for one)."""
    run = new_run(community.id)
    lease = claim(community.id, run, worker="w")
    skipped = ExpiringWhileAsked(0.5)
    with LoopBatcher(skipped) as loop, rows_held(AgentRun, community.id, run) as release:
        (done,) = loop.complete(lease)
        wait_until(lambda: bool(skipped._until), timeout=30, what="the completion to wait past the bound")
        release()
        assert isinstance(done.result(timeout=30), Finished)
    assert state(run) == "completed"


def test_one_held_run_row_keeps_only_its_run_waiting_not_the_others_of_its_batch(community):
    """Two runs of A complete in one batch; another transaction holds one run's row. The batch
    waits past the bound, then each run goes alone within the bound: the free run completes
    while the row is held (before, the whole batch waited turn after turn, the free run with
    it), the held one once it is let go."""
    held_run, free_run = new_run(community.id), new_run(community.id)
    held_lease, free_lease = claim(community.id, held_run, worker="w"), claim(community.id, free_run, worker="w")
    with LoopBatcher(Skipped(0.5)) as loop, rows_held(AgentRun, community.id, held_run) as release:
        waiting = backends_waiting_for_a_lock()
        (held,) = loop.complete(held_lease)
        wait_until(lambda: backends_waiting_for_a_lock() > waiting, timeout=30, what="the held run's batch to wait")
        (free,) = loop.complete(free_lease)  # queued behind it: the next batch of A has both
        assert isinstance(free.result(timeout=20), Finished)  # within its lease (30 s)
        assert not held.done()
        assert (state(held_run), state(free_run)) == ("running", "completed")
        release()
        assert isinstance(held.result(timeout=60), Finished)
    assert state(held_run) == "completed"
    assert loop.batcher.skipped.seconds == 0.5


def test_a_refused_batch_s_replay_waits_for_a_held_row_within_the_bound(community):
    """A batch of A is refused (its leases are two workers'), so each of its runs is replayed
    alone; one run's row is held by another transaction. The replay waits for that row at most
    the bound and gives the only connection back: B's completion goes meanwhile (before, the
    replay waited unbounded, holding the connection, and B's completion with it). The held run
    completes once its row is let go."""
    other = CommunityFactory()
    free_run, held_run, b_run = new_run(community.id), new_run(community.id), new_run(other.id)
    free_lease = claim(community.id, free_run, worker="w2")
    held_lease = claim(community.id, held_run, worker="w")
    b_lease = claim(other.id, b_run, worker="w")
    with LoopBatcher(Skipped(0.5)) as loop, rows_held(AgentRun, community.id, held_run) as release:
        waiting = backends_waiting_for_a_lock()
        free, held = loop.complete(free_lease, held_lease)  # one batch: refused, then replayed
        wait_until(lambda: backends_waiting_for_a_lock() > waiting, timeout=30, what="the replay to wait")
        assert isinstance(free.result(timeout=30), Finished)
        (b_done,) = loop.complete(b_lease)
        assert isinstance(b_done.result(timeout=60), Finished)
        assert not held.done() and state(held_run) == "running"
        release()
        assert isinstance(held.result(timeout=60), Finished)
    assert [state(r) for r in (free_run, held_run, b_run)] == ["completed"] * 3
    assert loop.batcher.replays >= 2


def test_a_run_whose_renewal_waited_alone_is_renewed_last_so_the_runs_after_it_are_renewed(community):
    """The event-loop worker renews its leases in its ``held`` order, one batch a community; a
    long transaction holds the row of A's first run. Each round the batch waits past the bound,
    then each run goes alone: the first waits alone, and the renewals after it are left untried.
    The run whose renewal waited alone is renewed last from then on, so A's other run is renewed
    every round after the first (before, it was never: tried after the held run each round, its
    lease lapsed, its row free all along)."""
    from buzz_delivery.agents import services as s
    from buzz_delivery.agents.aio_runtime import AsyncContext, Runtime
    from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig
    from tests.agents_support import AGENT

    other = CommunityFactory()
    locked_run, free_run = new_run(community.id), new_run(community.id)
    locked_claim, free_claim = s.claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30, limit=2)
    assert [c.lease.run_id for c in (locked_claim, free_claim)] == [locked_run, free_run]
    config = AsyncWorkerConfig(handler=lambda ctx: None, agents=[AGENT], communities=[community.id, other.id])
    worker = AsyncAgentWorker(config)
    with LoopBatcher(Skipped(0.5)) as loop, rows_held(AgentRun, community.id, locked_run):

        async def hold() -> tuple[Runtime, AsyncContext, AsyncContext]:
            runtime = Runtime(loop.pool, loop.batcher, None)  # type: ignore[arg-type]
            contexts = AsyncContext(locked_claim, [], runtime), AsyncContext(free_claim, [], runtime)
            for ctx in contexts:  # the locked run first: renewed first
                worker.held[ctx.lease.run_id] = ctx
            return runtime, *contexts

        runtime, locked_ctx, free_ctx = loop.run(hold())
        renewed = []
        for _ in range(3):
            before = free_ctx.lease.lease_until
            loop.run(worker._renew_round(runtime))
            renewed.append(free_ctx.lease.lease_until != before)
        assert renewed == [False, True, True]
        assert locked_ctx.lease == locked_claim.lease and not locked_ctx.lost.is_set()
        assert list(worker.held) == [free_run, locked_run]
    assert not free_ctx.lost.is_set()


def test_an_item_whose_submitter_gave_up_while_it_waited_for_its_community_is_not_written(community):
    """A run's call waits past the bound (its row is held) and waits for its community's turn;
    meanwhile its submitter gives up (the handler timed out, say: its task cancelled, its lease
    left to lapse). Its call is not journaled once the row is let go (before, it was: the run,
    resumed, found a call pending that was never made, and failed it uncertain)."""
    from buzz_delivery.agents.models import JournalEntry

    run = new_run(community.id)
    lease = claim(community.id, run, worker="w")
    skipped = Skipped(3.0)
    with LoopBatcher(skipped) as loop, rows_held(AgentRun, community.id, run) as release:

        async def submit() -> asyncio.Task:
            item = batch.prepare_call(lease, "echo", {"n": 1})
            return asyncio.get_running_loop().create_task(loop.batcher.submit("journal", community.id, run, item))

        task = loop.run(submit())

        async def back_in_queue() -> bool:
            return bool(loop.batcher._pending) and not loop.batcher._flushes

        wait_until(lambda: bool(skipped._until) and loop.run(back_in_queue()), timeout=30, what="the call to wait")
        loop.loop.call_soon_threadsafe(task.cancel)
        release()
        wait_until(loop.idle, timeout=30, what="the batcher to drop it")
        assert task.cancelled()
    assert not JournalEntry.objects.filter(run_id=run).exists()
    assert state(run) == "running"
