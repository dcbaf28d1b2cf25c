"""The event-loop worker's database side: a fixed number of connections, and batches.

:class:`DbPool` runs blocking database work on exactly ``connections`` threads, each with its
own Django connection (so the services' SQL, tenancy scopes and validation are the ones every
other caller uses): however many runs are in flight, the runtime holds at most that many
connections. :class:`Batcher` gathers the holder operations that coroutines submit (journal a
call, record a result, renew a lease, complete or fail a run, begin or finish a compensation),
groups them by operation and community,
and sends each group as one batched statement
(:mod:`~buzz_delivery.agents.services.batch`) when a connection is free: the busier the pool,
the bigger the batches. Each submitter awaits its own typed outcome. A batch the database
refuses is replayed one item at a time with the single forms, so one bad run fails alone; an
item whose single form raises gets that exception, and the others are untouched.

Before it sends a group, the dispatcher lets the loop take :data:`COALESCE_TURNS` turns (no
timer: each turn runs what is already ready), so that the coroutines the last batch resumed
queue their next operation into this one instead of the one after. Without them a process's
runs drift out of phase on a busy connection (the bench's K = 4 gives each process one): each
batch carries the runs of one phase and the others wait for the
next. With the runs created while the worker drains (bench.agents_io, no-op calls, 16 runs in
flight a process at K = 4, load 7 to 10) the batched statements a run fell from 0.86 to 0.70
(medians of 4; bench/results/agents_io_noop.md).

A worker serving several communities gives the batcher a lock-wait bound: each batch waits for
a lock at most that long (:func:`~buzz_delivery.services.db.lock_waits_bounded`). A batch that
waited longer (its community's rows are locked: a lifecycle move of it waiting behind a long
transaction of its own code, say) changed nothing and gives its connection back; its community
is left for a while (``skipped``) and the other communities' batches go on. Its items wait,
holding no connection, and go again once the community's turn is back (a renewal is answered
at once with the lock wait's error instead: the renewal task tries it again next round). A
batch of several runs that waited is first tried one run at a time, each within the bound: one
run's row held by another transaction keeps only that run waiting (it waits alone, its
community is left, and it is tried last from then on), not the other runs of its batch turn
after turn. A refused batch's replay is bounded the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection
from django.db import connections as db_connections

from buzz_delivery.agents.services import batch
from buzz_delivery.lockwaits import Skipped
from buzz_delivery.services.db import lock_wait_timed_out, lock_waits_bounded

logger = logging.getLogger("buzz_delivery.agents")

T = TypeVar("T")

# Loop turns the dispatcher yields before it takes a group (module docstring). A coroutine whose
# batch came back takes about two to queue its next operation (it resumes, then awaits its call).
COALESCE_TURNS = 3


class DbPool:
    """``connections`` threads, each holding at most one Django connection; :meth:`run` awaits a
    blocking callable on one of them. :meth:`close` closes every thread's connection."""

    def __init__(self, connections: int) -> None:
        if connections < 1:
            raise ValueError("connections must be >= 1")
        self.size = connections
        self._executor = ThreadPoolExecutor(max_workers=connections, thread_name_prefix="agent-db")
        self.used = UsedConnections()

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self.used.note()
        try:
            return fn(*args, **kwargs)
        except DatabaseError:
            if connection.connection is not None and not connection.is_usable():
                connection.close()  # the next call on this thread connects again
            raise

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on a pool thread and return (or raise) its result."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: self._call(fn, *args, **kwargs))

    def close(self) -> None:
        """Stop the threads, then close each thread's connection."""
        self._executor.shutdown(wait=True)
        self.used.close_all()


class UsedConnections:
    """The Django connections that threads of an executor opened (:meth:`note` on the thread),
    to close from the thread that shuts the executor down (:meth:`close_all`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wrappers: dict[int, Any] = {}

    def note(self) -> None:
        wrapper = db_connections[DEFAULT_DB_ALIAS]
        with self._lock:
            self._wrappers[id(wrapper)] = wrapper

    def close_all(self) -> None:
        with self._lock:
            wrappers, self._wrappers = list(self._wrappers.values()), {}
        for wrapper in wrappers:
            try:
                wrapper.inc_thread_sharing()
                try:
                    wrapper.close()
                finally:
                    wrapper.dec_thread_sharing()
            except Exception as exc:  # best effort: the process is ending
                logger.warning("connection_close_failed error=%s", exc)


@dataclass(frozen=True)
class Operation:
    """A batched operation: ``many(community, items) -> outcomes`` and ``one(item) -> outcome``
    (the single form, for replays)."""

    name: str
    many: Callable[[uuid.UUID, list[Any]], Sequence[Any]]
    one: Callable[[Any], Any]


def _heartbeat_many(lease_seconds: float) -> Callable[[uuid.UUID, list[Any]], Sequence[Any]]:
    return lambda community, leases: batch.heartbeat_runs(community, leases, lease_seconds)


def operations(lease_seconds: float) -> dict[str, Operation]:
    """The holder operations the runtime batches."""
    from buzz_delivery.agents import services as s

    return {
        "journal": Operation("journal", batch.journal_calls, batch.replay_call),
        "record": Operation("record", batch.record_results, batch.replay_result),
        "complete": Operation("complete", batch.complete_runs, batch.replay_completion),
        # A run's end when its handler raised, and each step of its unwinding (issue 29): each
        # item's outcome typed as the single form's (begin's None as batch.NotNext).
        "fail": Operation("fail", batch.fail_runs, batch.replay_failure),
        "begin_compensation": Operation(
            "begin_compensation", batch.begin_compensations, batch.replay_compensation_begin
        ),
        "finish_compensation": Operation(
            "finish_compensation", batch.finish_compensations, batch.replay_compensation_finish
        ),
        "heartbeat": Operation(
            "heartbeat", _heartbeat_many(lease_seconds), lambda lease: s.heartbeat(lease, lease_seconds)
        ),
    }


class Batcher:
    """Submit holder operations from coroutines; they go to PostgreSQL in batches of at most
    ``max_batch`` items of one operation and one community, one batch per free connection.
    ``linger``: seconds to wait for more items once the first arrives (0: go at once);
    ``coalesce_turns``: loop turns to yield before each group goes (0: at once)."""

    def __init__(
        self,
        pool: DbPool,
        ops: dict[str, Operation],
        *,
        max_batch: int = 200,
        linger: float = 0.0,
        coalesce_turns: int = COALESCE_TURNS,
        lock_wait_ms: int | None = None,
        skipped: Skipped | None = None,
    ) -> None:
        if coalesce_turns < 0:
            raise ValueError("coalesce_turns must be >= 0")
        # A worker serving several communities: the bound of each batch's lock waits, and the
        # communities left for a while after a batch of theirs waited past it.
        self.lock_wait_ms = lock_wait_ms
        self.skipped = Skipped(0.0) if skipped is None else skipped
        self.pool = pool
        self.coalesce_turns = coalesce_turns
        self.ops = ops
        self.max_batch = min(max_batch, batch.MAX_BATCH)
        self.linger = linger
        self._pending: dict[tuple[str, uuid.UUID], list[tuple[Any, uuid.UUID, asyncio.Future[Any]]]] = {}
        # Items asked back (withdraw) while their batch was out: dropped if it comes back unwritten.
        self._withdrawing: set[asyncio.Future[Any]] = set()
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(pool.size)
        self._task: asyncio.Task[None] | None = None
        self._flushes: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.items = 0
        self.replays = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._dispatch(), name="agent-batcher")

    async def submit(self, op: str, community: uuid.UUID, run_id: uuid.UUID, item: Any) -> Any:
        """Queue ``item`` (of run ``run_id``) for operation ``op``; returns its outcome. Its
        awaiter cancelled, the item is dropped if its batch was not taken yet."""
        return await self.queue(op, community, run_id, item)

    def queue(self, op: str, community: uuid.UUID, run_id: uuid.UUID, item: Any) -> asyncio.Future[Any]:
        """Queue ``item`` (of run ``run_id``) for operation ``op``: the future of its outcome
        (:meth:`withdraw` takes it back while it is queued)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.setdefault((op, community), []).append((item, run_id, future))
        self._wake.set()
        return future

    def withdraw(self, future: asyncio.Future[Any]) -> bool:
        """Take back the queued item of ``future`` (:meth:`queue`): True, nothing is written for
        it (its future cancelled); False once its batch was taken (sent, or about to be: its
        outcome comes) or it has its outcome. A batch that comes back unwritten (a lock wait past
        the bound) drops the items asked back while it was out, their futures cancelled, instead
        of queueing them again for their community's turn (their awaiters would wait for it)."""
        for key, queued in self._pending.items():
            for position, entry in enumerate(queued):
                if entry[2] is future:
                    del queued[position]
                    if not queued:
                        del self._pending[key]
                    future.cancel()
                    return True
        if not future.done():
            self._withdrawing.add(future)
        return False

    def _next_key(self) -> tuple[str, uuid.UUID] | None:
        """The first queued group whose community is not left for a lock wait."""
        if not self.skipped:
            return next(iter(self._pending), None)
        return next((key for key in self._pending if not self.skipped.waits(key[1])), None)

    def _take(self, key: tuple[str, uuid.UUID]) -> list[tuple[Any, uuid.UUID, asyncio.Future[Any]]]:
        queued = self._pending.pop(key)
        taken: list[tuple[Any, uuid.UUID, asyncio.Future[Any]]] = []
        later: list[tuple[Any, uuid.UUID, asyncio.Future[Any]]] = []
        seen: set[uuid.UUID] = set()
        for entry in queued:  # each run at most once a batch, at most max_batch items
            if entry[2].done():
                # Its submitter gave up meanwhile (its task cancelled: the handler timed out, the
                # shutdown grace ended, its lease was lost): nothing is written for it. A call
                # journaled now would be found pending when the run resumes, never made.
                continue
            if len(taken) < self.max_batch and entry[1] not in seen:
                seen.add(entry[1])
                taken.append(entry)
            else:
                later.append(entry)
        if later:
            self._pending[key] = later  # goes to the back: other groups get their turn
        return taken

    async def _dispatch(self) -> None:
        while True:
            if not self._pending:
                await self._wake.wait()
            else:  # every queued group's community was left for a lock wait: until the first is back
                left = self.skipped.next_try()
                # None (or 0): that skip ended since _next_key found it (a skip's expiry wakes
                # nobody): go at once. Before, it waited for the next submit or renewal.
                if left:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), left)
            self._wake.clear()
            if self.linger:
                await asyncio.sleep(self.linger)
            while self._pending:
                await self._slots.acquire()
                for _ in range(self.coalesce_turns):  # the runs the last batch resumed queue theirs first
                    await asyncio.sleep(0)
                key = self._next_key() if self._pending else None
                if key is None:
                    self._slots.release()
                    break
                entries = self._take(key)
                if not entries:  # every submitter of the group gave up
                    self._slots.release()
                    continue
                task = asyncio.get_running_loop().create_task(self._flush(key, entries))
                self._flushes.add(task)
                task.add_done_callback(self._flushes.discard)

    async def _flush(
        self, key: tuple[str, uuid.UUID], entries: list[tuple[Any, uuid.UUID, asyncio.Future[Any]]]
    ) -> None:
        op = self.ops[key[0]]
        items = [e[0] for e in entries]
        try:
            results = await self.pool.run(self._many_or_replay, op, key[1], items)
        except Exception as exc:  # the pool itself failed (closing): every submitter hears it
            results = [_Raised(exc)] * len(items)
        finally:
            self._slots.release()
        untried: list[tuple[Any, uuid.UUID, asyncio.Future[Any]]] = []
        held: list[tuple[Any, uuid.UUID, asyncio.Future[Any]]] = []
        for entry, result in zip(entries, results, strict=True):
            if entry[2] in self._withdrawing:
                self._withdrawing.discard(entry[2])
                if result is HELD or result is UNTRIED:  # not written: dropped (_wait_again)
                    entry[2].cancel()
            if result is HELD:
                held.append(entry)
            elif result is UNTRIED:
                untried.append(entry)
            elif not entry[2].done():
                if isinstance(result, _Raised):
                    entry[2].set_exception(result.exc)
                else:
                    entry[2].set_result(result)
        if len(held) + len(untried) < len(entries):
            self.batches += 1
            self.items += len(entries) - len(held) - len(untried)
        if held or untried:
            self._wait_again(key, untried, held)

    def _wait_again(
        self,
        key: tuple[str, uuid.UUID],
        untried: list[tuple[Any, uuid.UUID, asyncio.Future[Any]]],
        held: list[tuple[Any, uuid.UUID, asyncio.Future[Any]]],
    ) -> None:
        """Items of ``key`` not written for a lock wait past the bound: they wait for their
        community's turn, those not tried ahead of those queued since, and those that waited on
        their own (their run's row is held) behind them, with their runs' later items: tried
        last, so that one held row does not keep the community's other runs waiting turn after
        turn. A renewal is answered with the error at once (tried again next round, with the
        other communities' renewals)."""
        if key[0] == "heartbeat":
            for entries, alone in ((untried, False), (held, True)):
                for _, _, future in entries:
                    if not future.done():
                        future.set_exception(
                            LockWaited(f"community {key[1]}: waited past {self.lock_wait_ms} ms", held=alone)
                        )
        else:  # (a submitter given up meanwhile, its task cancelled, is dropped)
            runs = {entry[1] for entry in held}
            queued = self._pending.get(key, [])
            waiting = [
                *untried,
                *[entry for entry in queued if entry[1] not in runs],
                *held,
                *[entry for entry in queued if entry[1] in runs],
            ]
            waiting = [entry for entry in waiting if not entry[2].done()]
            if waiting:
                self._pending[key] = waiting
            else:
                self._pending.pop(key, None)
        self._wake.set()

    def _many_or_replay(self, op: Operation, community: uuid.UUID, items: list[Any]) -> list[Any]:
        """On a pool thread: the batch's outcomes; or, when the database refuses it or it waited
        past the lock bound, each item alone, each within the bound (so that one run's row held
        by another transaction keeps only that run waiting, not the others of its batch, and a
        refused batch's replay holds the connection no longer than a batch would). An item that
        waited past the bound is :data:`HELD` (its community is then left a while) and those
        after it are :data:`UNTRIED`: they wait for the community's turn."""
        try:
            with lock_waits_bounded(self.lock_wait_ms):
                return list(op.many(community, items))
        except Exception as exc:
            if self.lock_wait_ms is not None and lock_wait_timed_out(exc):
                if len(items) == 1:  # its single form would wait for the same row
                    self._skip(op, community, len(items))
                    return [HELD]
                logger.info(
                    "agent_batch_lock_wait op=%s community=%s runs=%d: waited past %s ms for a lock; "
                    "its runs go one at a time",
                    op.name,
                    community,
                    len(items),
                    self.lock_wait_ms,
                )
            else:
                logger.warning("agent_batch_refused op=%s runs=%d error=%s", op.name, len(items), str(exc)[:200])
                if isinstance(exc, DatabaseError) and connection.connection is not None and not connection.is_usable():
                    connection.close()
        out: list[Any] = []
        waited = False
        for item in items:
            if waited:  # its community is left a while: the rest of its runs wait for its turn
                out.append(UNTRIED)
                continue
            self.replays += 1
            try:
                with lock_waits_bounded(self.lock_wait_ms):
                    out.append(op.one(item))
            except Exception as exc:  # this item only
                if self.lock_wait_ms is not None and lock_wait_timed_out(exc):
                    self._skip(op, community, 1)
                    out.append(HELD)
                    waited = True
                    continue
                if isinstance(exc, DatabaseError) and connection.connection is not None and not connection.is_usable():
                    connection.close()
                out.append(_Raised(exc))
        return out

    def _skip(self, op: Operation, community: uuid.UUID, runs: int) -> None:
        """A statement of ``community`` waited past the lock bound: leave it a while."""
        self.skipped.skip(community)
        logger.warning(
            "agent_batch_lock_wait op=%s community=%s runs=%d: waited past %s ms for a lock (a lifecycle "
            "move of its community, or a long transaction); its batches wait %.2fs, the others go on",
            op.name,
            community,
            runs,
            self.lock_wait_ms,
            self.skipped.seconds,
        )

    async def close(self) -> None:
        """Stop dispatching once what was queued is sent."""
        while self._pending or self._flushes:
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()


# _many_or_replay's answers for an item not written for a lock wait past the bound: it waited
# on its own (its run's row is held: tried last), or it was not tried (its community was left).
HELD = object()
UNTRIED = object()


class LockWaited(Exception):
    """A renewal's batch waited past the lock bound: nothing written, tried again next round.
    ``held``: this renewal waited on its own (its run's row is held), not merely left untried
    after another's did: the renewer tries it last from then on (as
    :func:`~buzz_delivery.lockwaits.tried_last`), or the runs renewed after it in each round
    would never be."""

    def __init__(self, message: str, *, held: bool = False) -> None:
        super().__init__(message)
        self.held = held


@dataclass(frozen=True)
class _Raised:
    exc: BaseException
