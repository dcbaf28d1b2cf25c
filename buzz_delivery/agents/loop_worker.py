"""The event-loop agent worker behind ``manage.py run_agent_worker --async`` (SPEC 12 "Runtime").

One asyncio loop holds up to ``in_flight`` runs at once (each handler a task) on a fixed
``connections`` database connections (:class:`~buzz_delivery.agents.batcher.DbPool`), however
many runs are in flight: claims take up to the free room (at most 100 a statement) per
community; journal entries, results, renewals and completions of many runs go to PostgreSQL in
batches per community, each row fenced by its own lease
(:class:`~buzz_delivery.agents.batcher.Batcher`). One more connection LISTENs for wake hints
unless ``listen`` is off.

The renewal task renews every held lease each ``lease_seconds / 3`` (one statement per
community and batch); a run whose renewal is refused is marked lost and its handler task is
cancelled, with the task of each of its calls in flight (a cancel fenced it, or its lease
lapsed): the handler makes no further call. With
``handler_timeout``, a run held longer is given up the same way (its lease lapses and the run is
resumed from its journal elsewhere). :meth:`AsyncAgentWorker.stop` (SIGTERM/SIGINT) stops
claiming and drains in-flight runs for ``shutdown_grace`` seconds; the rest are abandoned.

A handler is ``async def handler(ctx)`` (an :class:`~buzz_delivery.agents.aio_runtime.AsyncContext`)
or a plain ``def handler(ctx)`` run on a thread (at most ``in_flight`` threads). One run's
failure, however it fails, ends that run only.

Acceptance (on unless ``accept`` is off): as the threaded worker, each round first accepts the
deliveries addressed to ``agents`` into runs (:mod:`~buzz_delivery.agents.acceptance`, on a pool
connection, so within the connection budget), and the core's delivery hints wake the loop.

    >>> from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig  # doctest: +SKIP
    >>> config = AsyncWorkerConfig(handler=h, agents=[key], in_flight=1000, connections=4)  # doctest: +SKIP
    >>> AsyncAgentWorker(config).run()  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from django.db import connections

from buzz_delivery.agents import services as s
from buzz_delivery.agents.acceptance import Acceptance, communities_with_pending_deliveries
from buzz_delivery.agents.aio_runtime import AsyncContext, Runtime, _Parked, read_journal, run_claim
from buzz_delivery.agents.batcher import Batcher, DbPool, LockWaited, operations
from buzz_delivery.agents.services import batch
from buzz_delivery.agents.services.runs import MAX_CLAIM
from buzz_delivery.agents.tool_threads import ToolThreads
from buzz_delivery.agents.worker import (
    COMMUNITIES_WITH_CLAIMABLE_RUNS,
    RunListener,
    Waker,
    check_common,
    seconds_value,
    unreachable_for_long,
)
from buzz_delivery.conf import get_settings as core_settings
from buzz_delivery.fairness import round_robin, share
from buzz_delivery.lockwaits import Skipped, tried_last
from buzz_delivery.loopwatch import LoopWatch
from buzz_delivery.services import tenancy
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, lock_wait_timed_out, lock_waits_bounded
from buzz_delivery.services.workers import HEARTBEAT_SECONDS, WorkerIdentity, deregister_worker, heartbeat_worker
from buzz_delivery.usercode import ScopedExecutor, serve_loop
from buzz_delivery.worker.handlers import describe
from buzz_delivery.worker.renewer import DB_UNAVAILABLE, busy_retry_seconds, lock_wait_ms
from buzz_delivery.worker.runtime import MAX_TASKS, MAX_THREADS

logger = logging.getLogger("buzz_delivery.agents")

DEFAULT_CONNECTIONS = 4
DEFAULT_IN_FLIGHT = 1000
# Runs held at once: tasks on one loop, as the delivery worker's async def handlers (1..10,000);
# the documented use is 1,000 (the default, tests/test_agents_aio.py holds 1,000 on 4 connections).
MAX_IN_FLIGHT = MAX_TASKS
# Database connections: one pool thread each, as the other workers' threads (1..256).
MAX_CONNECTIONS = MAX_THREADS


@dataclass
class AsyncWorkerConfig:
    """As :class:`~buzz_delivery.agents.worker.WorkerConfig`, with ``in_flight`` (runs held at
    once) and ``connections`` (the runtime's database connections) instead of ``concurrency``;
    ``max_batch``: items of one batched statement; ``linger``: seconds a batch waits for more."""

    handler: Callable[..., Any]
    agents: list[bytes]
    communities: list[uuid.UUID] = field(default_factory=list)
    in_flight: int = DEFAULT_IN_FLIGHT
    connections: int = DEFAULT_CONNECTIONS
    lease_seconds: float = 60
    poll_seconds: float = 1.0
    max_runs: int | None = None
    exit_when_idle: bool = False
    worker_id: str = ""  # empty: host:pid (check_common)
    shutdown_grace: float = 30.0
    handler_timeout: float | None = None
    listen: bool = True
    max_batch: int = 200
    linger: float = 0.0
    registry: WorkerIdentity | None = None  # kept live in the workers registry through the pool
    # Built-in acceptance (as the threaded worker's): the deliveries addressed to ``agents`` are
    # claimed, ``accept_batch`` at most per claim, and accepted into runs on a pool connection
    # before each round's run claims (buzz_delivery.agents.acceptance).
    accept: bool = True
    accept_batch: int = 50

    def __post_init__(self) -> None:
        v.int_in_range(self.in_flight, "in_flight", 1, MAX_IN_FLIGHT)
        v.int_in_range(self.connections, "connections", 1, MAX_CONNECTIONS)
        v.int_in_range(self.max_batch, "max_batch", 1, batch.MAX_BATCH)
        seconds_value(self.linger, "linger", zero=True)
        check_common(self)


class _LoopWaker(Waker):
    """A :class:`Waker` the listener thread calls: it sets an asyncio event on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
        super().__init__()
        self.loop, self.event = loop, event

    def wake(self) -> None:
        super().wake()
        self.loop.call_soon_threadsafe(self.event.set)


class _LoopThreads(ToolThreads, ScopedExecutor):
    """The loop's default executor: scoped (:class:`~buzz_delivery.usercode.ScopedExecutor`),
    and the integrations' :class:`~buzz_delivery.agents.tool_threads.ToolThreads` (which
    they would otherwise put in its place, unscoped)."""


class AsyncAgentWorker:
    """Runs :class:`AsyncWorkerConfig` until stopped; :attr:`counts` is the summary (as the
    threaded worker's, plus ``batches`` and ``batched_items``)."""

    def __init__(self, config: AsyncWorkerConfig) -> None:
        if config.in_flight < 1 or config.connections < 1:
            raise ValueError("in_flight and connections must be >= 1")
        self.config = config
        self._executors: tuple[ScopedExecutor, ...] = ()  # the loop's threads (usercode.serve_loop)
        self.counts: Counter[str] = Counter()
        self.stopping = threading.Event()
        self.held: dict[uuid.UUID, AsyncContext] = {}
        self.since: dict[uuid.UUID, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self.listener: RunListener | None = None
        self.claim_after: uuid.UUID | None = None  # where the last claim round ended (round robin)
        # Serving several communities (or every one with work), the claims, the acceptance and
        # the batches bound their lock waits: a community whose statement waited past the bound
        # (and changed nothing) is left for a while (``skipped``), its pool connection given back,
        # and the others go on. A worker of one community keeps its one-statement claims and batches.
        several = len(set(config.communities)) != 1
        self.lock_wait_ms = lock_wait_ms(config.lease_seconds) if several else None
        self.skipped = Skipped(busy_retry_seconds(config.lease_seconds))
        self.acceptance = (
            Acceptance(
                config.agents,
                holder=config.worker_id or None,
                batch=config.accept_batch,
                lease_seconds=config.lease_seconds,
                every=config.poll_seconds,
                lock_wait_ms=self.lock_wait_ms,
                skipped=self.skipped,
            )
            if config.accept
            else None
        )

    def stop(self, *_: Any) -> None:
        """Stop claiming (thread- and signal-safe); in-flight runs drain within the grace."""
        self.stopping.set()
        if self._loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                self._loop.call_soon_threadsafe(self._wake.set)

    def run(self, conn_params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run until stopped; returns the summary counts (also :meth:`summary_line`)."""
        try:
            asyncio.run(self._main(conn_params))
        finally:
            for executor in self._executors:
                executor.close()
            connections.close_all()
        return dict(self.counts)

    async def _main(self, conn_params: dict[str, Any] | None) -> None:
        # The loop's threads for the handlers' and tools' async ORM, sync_to_async and
        # asyncio.to_thread: each statement in its run's community scope (usercode.serve_loop,
        # aio_runtime.async_user_code); closed with their connections once the loop has ended.
        with serve_loop(asyncio.get_running_loop(), "agent-loop", _LoopThreads) as self._executors:
            await self._serve(conn_params)

    async def _serve(self, conn_params: dict[str, Any] | None) -> None:
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        pool = DbPool(cfg.connections)
        batcher = Batcher(
            pool,
            operations(cfg.lease_seconds),
            max_batch=cfg.max_batch,
            linger=cfg.linger,
            lock_wait_ms=self.lock_wait_ms,
            skipped=self.skipped,
        )
        batcher.start()
        user_executor = ThreadPoolExecutor(max_workers=min(cfg.in_flight, 256), thread_name_prefix="agent-user")
        runtime = Runtime(pool, batcher, user_executor)
        listen_stop = threading.Event()
        if cfg.listen and not cfg.exit_when_idle:
            alias = core_settings().listen_database or "default"
            params = conn_params if conn_params is not None else connections[alias].get_connection_params()
            self.listener = RunListener(
                waker=_LoopWaker(self._loop, self._wake),
                communities=list(cfg.communities),
                conn_params=params,
                stop=listen_stop,
                agents=cfg.agents if self.acceptance is not None else None,
                on_delivery=self.acceptance.hint if self.acceptance is not None else None,
            )
            self.listener.start()
        if cfg.registry is not None:
            await self._beat(pool)
        renewals = asyncio.create_task(self._renew(runtime))
        tasks: set[asyncio.Task[None]] = set()
        # Renewals run on this loop: a handler that blocks it lets every held lease lapse.
        watch = LoopWatch(self._loop, name="buzz-agent-worker", logger=logger, on_stall=self._stalled).start_here()
        try:
            await self._claim_loop(runtime, tasks)
            await self._drain(tasks)
        except Exception:
            logger.exception("worker_error")
            self.counts["internal_errors"] += 1
            self._abandon(tasks)
        finally:
            watch.stop()
            renewals.cancel()
            listen_stop.set()
            await batcher.close()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.counts["batches"] = batcher.batches
            self.counts["batched_items"] = batcher.items
            self.counts["batch_replays"] = batcher.replays
            if self.acceptance is not None:
                self.counts["accepted"] = self.acceptance.counts["accepted"]
                self.counts["accept_errors"] = self.acceptance.counts["errors"]
            if cfg.registry is not None:
                try:
                    await pool.run(deregister_worker, cfg.registry.id)
                except Exception as exc:
                    logger.warning("deregister_failed worker=%s error=%s", cfg.registry.id, exc)
            await asyncio.get_running_loop().run_in_executor(None, pool.close)
            user_executor.shutdown(wait=False, cancel_futures=True)
            # Off the loop: Django refuses to close a connection from an async context (each
            # close failed, and the user code's connections stayed open until the process ended).
            await asyncio.get_running_loop().run_in_executor(None, runtime.user_connections.close_all)
            if self.listener is not None:
                self.listener.join(timeout=5)

    def _stalled(self, seconds: float) -> None:
        self.counts["loop_stalls"] += 1

    def _communities(self) -> list[uuid.UUID]:
        if self.config.communities:
            return list(self.config.communities)
        params = {"agents": self.config.agents, "after": self.claim_after}
        with tenancy.fleet():
            found = [row[0] for row in fetch_all(COMMUNITIES_WITH_CLAIMABLE_RUNS, params)]
        if self.acceptance is not None and (self.acceptance.due() or self.config.exit_when_idle):
            found = list(dict.fromkeys([*found, *communities_with_pending_deliveries(self.config.agents)]))
        return found

    def _room(self, tasks: set[asyncio.Task[None]]) -> int:
        room = self.config.in_flight - len(tasks)
        if self.config.max_runs is not None:
            room = min(room, self.config.max_runs - self.counts["claimed"])
        return room

    async def _claim_loop(self, runtime: Runtime, tasks: set[asyncio.Task[None]]) -> None:
        cfg = self.config
        assert self._wake is not None
        last_reached = time.monotonic()  # when a round last reached the database
        while not self.stopping.is_set():
            if cfg.max_runs is not None and self.counts["claimed"] >= cfg.max_runs:
                return
            if self._room(tasks) <= 0:
                self._wake.clear()
                await self._wait(cfg.poll_seconds)
                continue
            self._wake.clear()
            try:
                found = await self._round(runtime, tasks)
            except DB_UNAVAILABLE as exc:  # a restart, a terminated backend: the pool reconnects next poll
                logger.warning("db_unavailable role=agent-worker error=%s", describe(exc).strip()[:200])
                self.counts["db_errors"] += 1
                # No run could be claimed: idle (exit 0) once the database stayed out of reach.
                if cfg.exit_when_idle and unreachable_for_long(last_reached, cfg.poll_seconds):
                    return
                await self._pause(cfg.poll_seconds)  # not cut short by runs ending: one retry a poll
                continue
            last_reached = time.monotonic()
            if not found:
                # A community left after a lock wait still has work: not idle; claimed again
                # once its wait is over, not a poll interval later.
                left = self.skipped.next_try()
                carried = None if self.acceptance is None else self.acceptance.next_round()
                if carried is not None:  # claimed deliveries wait: claimed again when they may go
                    left = carried if left is None else min(left, carried)
                if cfg.exit_when_idle and left is None:
                    return
                if await self._wait(cfg.poll_seconds if left is None else min(left, cfg.poll_seconds)):
                    self.counts["woken"] += 1

    async def _round(self, runtime: Runtime, tasks: set[asyncio.Task[None]]) -> bool:
        """One round: acceptance, then runs claimed and started in every community with work;
        whether it found any."""
        cfg = self.config
        communities = round_robin(await runtime.pool.run(self._communities), self.claim_after)
        found = await self._accept(runtime, communities)
        # Fairness (buzz_delivery.fairness): every community with work gets its share of the
        # room, from the one after where the last round ended, before any gets more. A round
        # claims at most the room it started with: runs that end while it claims free room for
        # the next round, not for this one's second pass (on a cluster, where a claim takes
        # longer and more runs end meanwhile, a full community's second pass took that room too,
        # 75 of its runs claimed while another's one waited for the next round, not 50).
        budget = self._room(tasks)
        each = share(budget, len(communities))
        full: list[uuid.UUID] = []
        for community in communities:
            room = min(self._room(tasks), budget)
            if self.stopping.is_set() or room <= 0:
                break
            if self.skipped.waits(community):
                continue  # its last claim or batch waited for a lock: claimed again once that is over
            limit = min(each, room, MAX_CLAIM)
            claimed = await self._claim(runtime, community, limit, tasks)
            budget -= claimed
            self.claim_after = community
            found = found or bool(claimed)
            if claimed == limit:
                full.append(community)
        for community in full:
            room = min(self._room(tasks), budget)
            if self.stopping.is_set() or room <= 0:
                break
            budget -= await self._claim(runtime, community, min(room, MAX_CLAIM), tasks)
        if not found and cfg.exit_when_idle:
            found = await self._accept(runtime, communities, force=True)  # nothing left to accept either
        return found

    async def _claim(self, runtime: Runtime, community: uuid.UUID, limit: int, tasks: set[asyncio.Task[None]]) -> int:
        """Claim up to ``limit`` runs of ``community`` and start them; how many.

        The journals of the resumed runs are read in one more statement before they start (the
        runs of a claim then start together and share their batches). When that read fails (a
        terminated backend, a restart), the runs start all the same, their journals unknown:
        each reads its own in its task before its handler
        (:func:`~buzz_delivery.agents.aio_runtime.read_journal`). A claimed run is never left
        unstarted until its lease lapses, its attempt spent for nothing."""
        cfg = self.config
        held_until = time.monotonic() + cfg.lease_seconds  # before the claim: its lease ends later
        try:
            claimed = await runtime.pool.run(self._claim_bounded, community, limit)
        except DB_UNAVAILABLE as exc:
            if self.lock_wait_ms is None or not lock_wait_timed_out(exc):
                raise
            self.skipped.skip(community)
            self.counts["lock_waits"] += 1
            logger.warning(
                "claim_lock_wait community=%s: waited past %s ms for a lock (a lifecycle move of its community, "
                "or a long transaction); its claims wait %.2fs, the other communities go on",
                community,
                self.lock_wait_ms,
                self.skipped.seconds,
            )
            return 0
        resumed = [c.lease.run_id for c in claimed if batch.resumed(c)]
        journals: dict[uuid.UUID, list[Any]] | None = {}
        if resumed:
            try:
                journals = await runtime.pool.run(batch.journals_of, community, resumed)
            except Exception as exc:  # the claims hold: their tasks read the journals again
                logger.warning(
                    "journal_read_failed community=%s runs=%d error=%s; each run reads its own",
                    community, len(resumed), describe(exc).strip()[:200],
                )  # fmt: skip
                journals = None
        for claim in claimed:
            self.counts["claimed"] += 1
            known = journals is not None or not batch.resumed(claim)
            journal = (journals or {}).get(claim.lease.run_id, []) if known else None
            self._start(runtime, claim, journal, tasks, held_until)
        return len(claimed)

    def _claim_bounded(self, community: uuid.UUID, limit: int) -> list[s.AgentClaim]:
        """On a pool thread: the claim, its lock waits bounded when the worker serves several
        communities."""
        cfg = self.config
        with lock_waits_bounded(self.lock_wait_ms):
            return s.claim_agent_runs(
                community, cfg.agents, worker_id=cfg.worker_id, limit=limit, lease_seconds=cfg.lease_seconds
            )

    async def _accept(self, runtime: Runtime, communities: list[uuid.UUID], *, force: bool = False) -> bool:
        """One acceptance round (when due, or ``force``) on a pool connection; whether it created
        runs. An error is logged and counted: acceptance never stops the worker."""
        if self.acceptance is None:
            return False
        try:
            return await runtime.pool.run(functools.partial(self.acceptance.round, communities, force=force)) > 0
        except Exception:
            logger.exception("accept_error")
            self.acceptance.counts["errors"] += 1
            return False

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if the worker is told to stop (checked every tenth)."""
        until = time.monotonic() + seconds
        while not self.stopping.is_set() and (left := until - time.monotonic()) > 0:
            await asyncio.sleep(min(left, seconds / 10))

    async def _wait(self, timeout: float) -> bool:
        assert self._wake is not None
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def _start(
        self,
        runtime: Runtime,
        claim: s.AgentClaim,
        journal: list[Any] | None,
        tasks: set[asyncio.Task[None]],
        held_until: float = math.inf,
    ) -> None:
        """Hold ``claim`` and run it in a task of its own; ``journal``: its entries, None when
        not known (the claim's read failed: the task reads it first); ``held_until``: when its
        lease surely still holds (monotonic: the time before the claim + the lease)."""
        ctx = AsyncContext(claim, journal, runtime)
        ctx.held_until = held_until
        self.held[claim.lease.run_id] = ctx
        self.since[claim.lease.run_id] = time.monotonic()
        task = asyncio.create_task(self._one(runtime, ctx))
        ctx.task = task
        tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            tasks.discard(t)
            self.held.pop(claim.lease.run_id, None)
            self.since.pop(claim.lease.run_id, None)
            if self._wake is not None:
                self._wake.set()  # room for another claim

        task.add_done_callback(done)

    async def _one(self, runtime: Runtime, ctx: AsyncContext) -> None:
        cfg = self.config
        try:
            known = (
                ctx.journal_known
                or ctx.run.unwinding
                or await read_journal(runtime, ctx, retry_for=cfg.lease_seconds, pause=cfg.poll_seconds)
            )
            if known and time.monotonic() >= ctx.held_until:
                # Its journal came back only after its lease lapsed (the claim's own read waited that
                # long, its renewals failing meanwhile): no handler on a lease that may be another's.
                logger.warning("lease_lapsed run=%s: not started; the run is left to its lease", ctx.lease.run_id)
                ctx.mark_lost("lease_lapsed")
                result = "lost"
            elif known:
                result = await run_claim(runtime, ctx, cfg.handler)
            else:
                result = "lost"  # left to its lease, as a run whose runtime statement failed
        except asyncio.CancelledError:
            result = "lost"
        except _Parked:  # a task the handler left parked the run after the handler's turn: parked
            result = "parked" if ctx.parked is not None else "lost"
        except Exception:  # a runtime error of this run only: its lease lapses, the run is reclaimed
            logger.exception("run_error run=%s", ctx.lease.run_id)
            result = "lost"
        if ctx.failure_code is not None and result != "lost":  # failed (or unwound): say why
            logger.info("%s run=%s code=%r", result, ctx.lease.run_id, ctx.failure_code)
        else:
            logger.info("%s run=%s", result, ctx.lease.run_id)
        self.counts[result] += 1

    async def _renew(self, runtime: Runtime) -> None:
        cfg = self.config
        every = max(cfg.lease_seconds / 3, 0.2)
        tick = every if cfg.handler_timeout is None else min(every, 0.25)
        next_renewal = time.monotonic() + every
        next_beat = time.monotonic() + HEARTBEAT_SECONDS
        while True:
            await asyncio.sleep(tick)
            self._time_out()
            if cfg.registry is not None and time.monotonic() >= next_beat:
                next_beat = time.monotonic() + HEARTBEAT_SECONDS
                await self._beat(runtime.pool)
            if time.monotonic() < next_renewal:
                continue
            next_renewal = time.monotonic() + every
            await self._renew_round(runtime)

    async def _renew_round(self, runtime: Runtime) -> None:
        """Renew every lease held, in :attr:`held`'s order (each community's renewals one batch)."""
        held = [ctx for ctx in self.held.values() if not ctx.lost.is_set()]
        await asyncio.gather(*(self._renew_one(runtime, ctx) for ctx in held), return_exceptions=True)

    async def _beat(self, pool: DbPool) -> None:
        """Refresh this process's row in the live workers registry (on a pool connection)."""
        assert self.config.registry is not None
        try:
            await pool.run(heartbeat_worker, self.config.registry)
        except Exception as exc:  # never stops the worker
            logger.warning("heartbeat_failed worker=%s error=%s", self.config.registry.id, exc)

    async def _renew_one(self, runtime: Runtime, ctx: AsyncContext) -> None:
        held_until = time.monotonic() + self.config.lease_seconds  # before the renewal is sent
        try:
            outcome = await runtime.batcher.submit("heartbeat", ctx.lease.community_id, ctx.lease.run_id, ctx.lease)
        except LockWaited as exc:  # its community's rows are locked: try again next round
            if exc.held:
                # Its own row is held (another transaction): tried last from then on. Tried first
                # every round, it waited alone each time and the renewals after it in the batch,
                # left untried, never went: their leases lapsed, their rows free all along.
                tried_last(self.held, ctx.lease.run_id)
            logger.warning("heartbeat_lock_wait run=%s: %s", ctx.lease.run_id, exc)
            return
        except Exception as exc:  # a lost connection: try again next round
            logger.warning("heartbeat_error run=%s: %s", ctx.lease.run_id, exc)
            return
        if isinstance(outcome, s.Renewed):
            if outcome.lease.lease_generation == ctx.lease.lease_generation:
                ctx.lease = outcome.lease
                ctx.held_until = held_until
            self.counts["renewed"] += 1
            return
        if isinstance(outcome, s.AlreadyTerminal) or (ctx.task is not None and ctx.task.done()):
            return  # this holder ended the run meanwhile (its completion went first): nothing to stop
        reason = getattr(outcome, "reason", "") or "lost"
        logger.info("lease_lost run=%s reason=%s", ctx.lease.run_id, reason)
        self._give_up(ctx, reason)

    def _give_up(self, ctx: AsyncContext, reason: str) -> None:
        ctx.mark_lost(reason)
        ctx.cancel_tasks()  # the handler's task and each call's in flight (its tasks' too)

    def _time_out(self) -> None:
        limit = self.config.handler_timeout
        if limit is None:
            return
        now = time.monotonic()
        for run_id, since in list(self.since.items()):
            ctx = self.held.get(run_id)
            if ctx is not None and now - since > limit and not ctx.lost.is_set():
                logger.warning("handler_timeout run=%s: its lease is left to lapse", run_id)
                self.counts["timed_out"] += 1
                self.since.pop(run_id, None)
                self._give_up(ctx, "timed_out")

    async def _drain(self, tasks: set[asyncio.Task[None]]) -> None:
        """Let in-flight runs reach their resting point: all of them when the claiming ended by
        itself (idle, max runs); ``shutdown_grace`` seconds from a stop, then abandon the rest."""
        while tasks and not self.stopping.is_set():
            await asyncio.wait(set(tasks), timeout=0.2)
        if not tasks:
            return
        _, pending = await asyncio.wait(set(tasks), timeout=self.config.shutdown_grace)
        if pending:
            self._abandon(pending)

    def _abandon(self, tasks: set[asyncio.Task[None]]) -> None:
        for ctx in list(self.held.values()):
            if ctx.task in tasks and not ctx.lost.is_set():
                logger.warning("abandoned run=%s (shutdown grace over)", ctx.lease.run_id)
                self.counts["abandoned"] += 1
                self._give_up(ctx, "abandoned")

    def summary_line(self) -> str:
        keys = (
            "claimed", "completed", "failed", "compensated", "compensation_failed", "parked", "lost", "timed_out",
            "abandoned", "woken",
        )  # fmt: skip
        body = {k: self.counts.get(k, 0) for k in keys}
        body.update(
            renewed=self.counts.get("renewed", 0),
            db_errors=self.counts.get("db_errors", 0),
            internal_errors=self.counts.get("internal_errors", 0),
            batches=self.counts.get("batches", 0),
            batched_items=self.counts.get("batched_items", 0),
            accepted=self.counts.get("accepted", 0),
            accept_errors=self.counts.get("accept_errors", 0),
            loop_stalls=self.counts.get("loop_stalls", 0),
        )
        return json.dumps(body, separators=(",", ":"))
