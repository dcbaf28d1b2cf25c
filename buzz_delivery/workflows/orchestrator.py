"""The orchestrator behind ``manage.py run_workflow_worker`` (SPEC section 11 "Orchestrator").

Shaped like the delivery worker (:mod:`buzz_delivery.worker`): a dispatcher (the calling thread)
claims ready steps of one community, or of every community with work (walking them round
robin, one claim statement per community, each its share of the room first: see
:meth:`Orchestrator._walk`), up to ``batch_size`` per statement: as many as there are idle step
threads, and up to ``batch_size`` more in a local queue while the steps' recent run times say
they start within a tenth of the lease, a second and the poll interval (threads on a step
longer than that count for nothing). A claimed ``send_message`` step takes no step thread: it
goes to the completer, which sends a claim's sends in one transaction, and with every step
thread busy the leader claims the ready sends ahead (``claim_steps(sends_only=True)``, after a
NOTIFY; issue 31). Step threads run
:func:`buzz_delivery.workflows.executor.execute`; what a ``function`` step returns is recorded
by the completer thread (:mod:`buzz_delivery.workflows.completer`), many steps per statement,
and claims ready steps in the same transaction (a wake that comes while outputs wait for it is
left to that batch, once per batch; the dispatcher claims what the batch left, or claims itself
when no batch went through within the poll interval); a renewer thread renews each third of its
length the leases of the steps a step thread took (running, or awaiting completion), one
statement per community per round (``renew_steps``, each row fenced by its own lease): a claim
still in the local queue is not renewed, and one that no step thread took within
``poll_interval`` is handed back (``release_steps``: ready again, its attempt given back), so a
claimed step starts or goes back; a listener thread LISTENs on ``buzz_workflows`` (the Advance
trigger NOTIFYs it with the community id whenever a step becomes ready) and wakes the
dispatcher, which polls every ``poll_interval`` anyway. SIGTERM/SIGINT: stop claiming, let
in-flight steps finish within ``shutdown_grace`` seconds, then exit (leases still held lapse and
are reclaimed by the maintenance; what is still queued is handed back). Nothing about one step
stops it: what a step's code raises (any ``BaseException``) or leaves open on its connection
fails that step (:mod:`buzz_delivery.workflows.executor`); an error of the runtime's own is
counted (``errors``) and that lease left to lapse; no step thread dies of either. Should a step
thread or the completer die all the same, the orchestrator stops (exit 1) instead of claiming
for threads that are gone.

Several orchestrators of one community elect a leader (issue 31, :class:`Leadership`): the
one holding the community's session advisory lock claims on every wake and chains claims into
its completions; the others claim only as many ready steps as it left waiting
:data:`FOLLOW_AFTER` seconds (the oldest) and chain nothing, so the community's work is one
chain of large batches, not K chains of small ones. A follower tries the lock once a poll
interval and leads once the leader's session is gone. While the lock is held by another
session a follower does not LISTEN (:meth:`Orchestrator._lead`): it polls. ``--all`` elects no
leader (and always LISTENs).

An ``async def`` function step runs on none of the step threads: one event-loop thread awaits
such steps as tasks, up to ``async_concurrency`` at once, none holding a database connection.
Everything about them that touches the database happens on the threads above: the thread that
claimed a step resolves its input (:func:`~buzz_delivery.workflows.executor.prepare_call`)
before handing it to the loop, the completer records what it returned or raised, the renewer
renews its lease while it runs. A claim is sized for the free step threads and the free loop
places together (:func:`mixed_room`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from django.db import DatabaseError, InterfaceError, close_old_connections, connection, connections

from buzz_delivery.conf import get_settings as core_settings
from buzz_delivery.exceptions import in_chain
from buzz_delivery.fairness import share
from buzz_delivery.holders import holder_identity
from buzz_delivery.listening import Listener
from buzz_delivery.lockwaits import Skipped, tried_last
from buzz_delivery.loopwatch import LoopWatch
from buzz_delivery.services import AlreadyTerminal, LeaseLost, Settled
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import lock_wait_timed_out, lock_waits_bounded
from buzz_delivery.worker.renewer import busy_retry_seconds, lock_wait_ms
from buzz_delivery.workflows import executor
from buzz_delivery.workflows.completer import Completer
from buzz_delivery.workflows.conf import NOTIFY_CHANNEL
from buzz_delivery.workflows.registry import get_function, missing_counts, registered_names
from buzz_delivery.workflows.services import (
    claim_steps,
    communities_with_due_waits,
    communities_with_ready_steps,
    end_due_waits,
    renew_steps,
)
from buzz_delivery.workflows.services.steps import MAX_CLAIM, release_steps, steps_left_waiting
from buzz_delivery.workflows.services.types import RenewOutcome, StepClaim, StepLease, StepOutcome, StepRenewed

logger = logging.getLogger("buzz_delivery.workflows")

# Most claims and completions per statement unless --batch-size says otherwise.
DEFAULT_BATCH_SIZE = 32
# Seconds the completer waits for more outputs while a batch is short.
COMPLETE_LINGER = 0.002
# Claimed steps wait in the local queue only while they would start within this fraction of
# the lease, and within CLAIM_AHEAD_MAX_SECONDS, judged by the recent run time of the steps (a
# step's timeout counts from its claim, queue time included).
CLAIM_AHEAD_LEASE_FRACTION = 0.1
CLAIM_AHEAD_MAX_SECONDS = 1.0

# ``async def`` function steps in flight at once on the event loop (unless --async-concurrency
# says otherwise), and the most it may be told.
DEFAULT_ASYNC_CONCURRENCY = 1000
MAX_ASYNC_CONCURRENCY = 10_000
# Weight of the newest claim in the moving share of ``async def`` function steps among claims.
ASYNC_SHARE_WEIGHT = 0.05

# Seconds an orchestrator whose claims keep coming back empty gathers wakes before claiming
# again (doubling per miss, at most MISS_GATHER_MAX).
MISS_GATHER = 0.001
MISS_GATHER_MAX = 0.02

# One community's orchestrators (issue 31): the one holding the community's session advisory
# lock (this namespace, hashtext of the community id; taken on a connection of its own) leads:
# it claims on every wake and chains claims into its completions; the others follow: they
# claim only as many ready steps as the leader left waiting FOLLOW_AFTER seconds or more (at
# most the poll interval), and chain nothing. Leadership is a performance hint, never a
# guarantee: every claim and completion stays fenced by its lease, and with no leader (or two,
# for a moment) every step is still claimed.
LEADER_LOCK_NAMESPACE = 0x62776C31  # "bwl1"
TRY_LEAD = "SELECT pg_try_advisory_lock(%s, hashtext(%s::text))"
FOLLOW_AFTER = 0.1

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_ABANDONED = 3
SUMMARY_KEYS = (
    "claimed",
    "succeeded",
    "failed",
    "retried",
    "waiting",
    "lease_lost",
    "already_terminal",
    "renewed",
    "renew_statements",  # one per community with held steps per renewal round
    "claim_statements",
    "chained",
    "complete_statements",
    "fail_statements",  # transactions recording failures of async steps (one per community and batch)
    "send_statements",  # transactions sending send_message steps (one per community and batch)
    "errors",
    "handed_back",
    "abandoned",
    "awaited",
    "loop_stalls",  # an async step blocked the loop (buzz_delivery.loopwatch)
    "led",  # 1 when this orchestrator led its community at some point (issue 31)
    "follow_reads",  # a follower's reads of whether ready steps were left waiting for it
    "sends_ahead",  # send_message steps claimed with every step thread busy (issue 31)
    "unlistened",  # times the listener stopped listening: this orchestrator followed a live leader
)


@dataclass(frozen=True)
class OrchestratorConfig:
    """``community_id``: one community, or None for all. Times in seconds. ``concurrency``:
    step threads. ``batch_size``: most claims per statement and most completions per statement
    (1..1000; None = the larger of ``concurrency`` and :data:`DEFAULT_BATCH_SIZE`).
    ``async_concurrency``: ``async def`` function steps awaited at once as tasks on the one
    event-loop thread (1..10,000), which hold no database connection. ``name``: the name in the
    holder identity ``host:pid:name`` its step claims record (``claimed_by``)."""

    community_id: uuid.UUID | None
    concurrency: int = 4
    batch_size: int | None = None
    lease_seconds: float = 60
    poll_interval: float = 1.0
    idle_exit: float | None = None
    max_steps: int | None = None
    shutdown_grace: float = 30.0
    name: str = "orchestrator"
    async_concurrency: int = DEFAULT_ASYNC_CONCURRENCY

    def __post_init__(self) -> None:
        v.int_in_range(self.async_concurrency, "async_concurrency", 1, MAX_ASYNC_CONCURRENCY)
        # A day at most, as every worker's: 1e10 was taken and the dispatcher's first idle wait
        # on it raised OverflowError.
        v.poll_seconds(self.poll_interval, "poll_interval")


def _listener(
    conn_params: dict[str, Any],
    community: uuid.UUID | None,
    wake: threading.Event,
    stop: threading.Event,
    retry: float,
    on_hint: Callable[[str], None] | None = None,
) -> Listener:
    """The LISTEN thread on ``buzz_workflows``: a hint naming ``community`` (any, when None)
    wakes the dispatcher, as does every (re)connection; any payload and any error are survived
    (:class:`~buzz_delivery.listening.Listener`). ``on_hint(payload)`` first, for every hint
    that wakes it (the payload is only compared, never trusted)."""
    wanted = None if community is None else str(community)

    def hint(channel: str, payload: str) -> None:
        if wanted is None or payload == wanted:
            if on_hint is not None:
                on_hint(payload)
            wake.set()

    return Listener(
        name="buzz-workflows-listener",
        channels=(NOTIFY_CHANNEL,),
        conn_params=conn_params,
        stop=stop,
        on_notify=hint,
        retry_seconds=retry,
        on_listen=wake.set,
        logger=logger,
    )


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, stop: threading.Event) -> None:
        self.config = config
        self.holder = holder_identity(config.name)
        self.stop = stop
        # --all: one renewer thread renews every community's steps, so each renewal statement
        # waits for a lock at most this long (None: one community, the one-statement renewal).
        self.renew_lock_wait_ms = lock_wait_ms(config.lease_seconds) if config.community_id is None else None
        # --all: the dispatcher's claims and the completer's transactions bound their lock waits
        # the same way; a community whose claim or completion waited past the bound (and changed
        # nothing) is left a while (``skipped``) and the others are claimed and completed meanwhile.
        self.skipped = Skipped(busy_retry_seconds(config.lease_seconds))
        self.wake = threading.Event()
        # put/get only: the C queue (queue.Queue's Python Condition cost a notify per claim).
        self.work: queue.SimpleQueue[StepClaim | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(SUMMARY_KEYS, 0)
        # Claims in the local queue, not yet taken by a step thread, with when they were queued
        # (monotonic): never renewed; handed back when no thread took them within a poll
        # interval. Keyed (step id, generation): a step claimed again is another claim.
        self.queued: dict[tuple[uuid.UUID, int], tuple[StepClaim, float]] = {}
        # Claims a step thread took (running, or their output waiting for the completer): renewed.
        self.held: dict[tuple[uuid.UUID, int], StepLease] = {}
        self.running: dict[tuple[uuid.UUID, int], float] = {}  # on a step thread since (monotonic)
        self.in_flight = 0  # claimed and not yet ended here: queued, running or being completed
        self.batches = 0  # completer batches through (the dispatcher's deferral is judged by it)
        self.threads: list[threading.Thread] = []
        self.starved = False  # the dispatcher waits for a place to come free
        self.deferred_wake = False  # the dispatcher left a claim to the completer's next batch
        self.awaiting = 0  # of those, returned and waiting for the completer
        self.sends_awaiting = 0  # of those, send_message steps handed to the completer to send
        # A NOTIFY came since the last claim of sends ahead (see _claim_sends_ahead), and when
        # (monotonic) such claims may start again after one came back empty.
        self.sends_hint = True
        self.sends_ahead_after = 0.0
        self.step_seconds: float | None = None  # moving average of a step's run time
        self.batch_size = (
            max(config.concurrency, DEFAULT_BATCH_SIZE)
            if config.batch_size is None
            else v.int_in_range(config.batch_size, "batch_size", 1, MAX_CLAIM)
        )
        self.completer = Completer(
            max_batch=self.batch_size,
            linger=COMPLETE_LINGER,
            done=self._completed,
            room=self._chain_room,
            accept=self._accept,
            after=self._after_batch,
            lease_seconds=config.lease_seconds,
            holder=self.holder,
            lock_wait_ms=self.renew_lock_wait_ms,
            skipped=self.skipped,
        )
        # ``async def`` function steps are awaited as tasks on one event-loop thread (no database
        # connection of their own), up to ``async_concurrency`` at once: the keys of the claims
        # routed there, how many are in flight and awaiting the completer, and the moving share
        # of such steps among the claims (how the dispatcher sizes a claim for both sides).
        self.on_loop: set[tuple[uuid.UUID, int]] = set()
        self.loop_in_flight = 0
        self.loop_awaiting = 0
        self.has_async = _any_async_function()
        self.async_share = 0.5
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_ready = threading.Event()
        self.loop_thread: threading.Thread | None = None
        self.loop_closing = False
        self.signal_name: str | None = None
        # Fairness between communities (--all): each walk starts after the community the last
        # one ended at, and gives every community with ready steps its share of the room before
        # any gets more. The completer chains claims (claims in its completion's transaction)
        # only while the last walk found one community with work, and only in that one: a hint
        # naming another community, or a poll interval without a walk, ends that.
        self.walk_after: uuid.UUID | None = None
        self.chain_for: uuid.UUID | None = None
        self.next_walk = 0.0  # --all: when (monotonic) the dispatcher walks whatever the chain
        self.renew_done = threading.Event()
        self.next_due_check = 0.0  # when the dispatcher next ends the due sleeps and waits

        # One community (issue 31): whether this orchestrator leads it (see LEADER_LOCK_NAMESPACE);
        # --all: every orchestrator claims and chains as it did.
        self.leadership: Leadership | None = None
        self.listener: Listener | None = None
        self.leading = config.community_id is None
        self.follow_after = min(FOLLOW_AFTER, config.poll_interval)

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    # --- threads -----------------------------------------------------------------

    def _step_thread(self) -> None:
        try:
            while True:
                claim = self.work.get()
                if claim is None:
                    return
                if not self._take(claim):
                    continue  # handed back while it waited
                try:
                    self._run_step(claim)
                except BaseException:  # never let a step thread die: the claims queued for it would wait
                    logger.exception("step_thread_error step=%s run=%s", claim.step.key, claim.lease.run_id)
                    self.add("errors")
        finally:
            connection.close()

    def _take(self, claim: StepClaim, *, thread: bool = True) -> bool:
        """A step thread (or the event loop, ``thread=False``) takes ``claim`` from the queue:
        held (renewed) from now on. False when the dispatcher handed it back meanwhile."""
        key = _key(claim.lease)
        with self.lock:
            if self.queued.pop(key, None) is None:
                return False
            self.held[key] = claim.lease
            if thread:
                self.running[key] = time.monotonic()
        return True

    def _run_step(self, claim: StepClaim) -> None:
        deferred = False
        try:
            started = time.monotonic()
            outcome = executor.execute(claim, defer_output=True)  # what the step's code raises stays there
            self._timed(time.monotonic() - started)
            if isinstance(outcome, executor.Output):
                with self.lock:
                    self.awaiting += 1
                self.completer.put(claim, outcome.value)
                deferred = True
            else:
                self._count(outcome)
        except BaseException:
            logger.exception("step_error step=%s run=%s", claim.step.key, claim.lease.run_id)
            self.add("errors")
            if connection.connection is not None and not connection.is_usable():
                connection.close()
        finally:
            with self.lock:
                self.running.pop(_key(claim.lease), None)
            if not deferred:
                self._ended(claim)

    def _timed(self, seconds: float) -> None:
        with self.lock:
            previous = self.step_seconds
            self.step_seconds = seconds if previous is None else 0.8 * previous + 0.2 * seconds

    def _ended(self, claim: StepClaim) -> None:
        # Wake the dispatcher only when it waits for room: ready steps wake it by NOTIFY, and
        # the completer claims what its completions released.
        key = _key(claim.lease)
        with self.lock:
            self.held.pop(key, None)
            self.in_flight -= 1
            if key in self.on_loop:
                self.on_loop.discard(key)
                self.loop_in_flight -= 1
            starved, self.starved = self.starved, False
        if starved:
            self.wake.set()

    def _completed(self, claim: StepClaim, outcome: StepOutcome | None) -> None:
        """The completer's ``done``: count the outcome and free the claim's place."""
        if outcome is None:
            self.add("errors")
        else:
            self._count(outcome)
        with self.lock:
            self.awaiting -= 1
            if claim.step.kind == "send_message":
                self.sends_awaiting -= 1
            if _key(claim.lease) in self.on_loop:
                self.loop_awaiting -= 1
        self._ended(claim)

    def _count(self, outcome: object) -> None:
        if isinstance(outcome, Settled):
            key = {
                "succeeded": "succeeded",
                "failed": "failed",
                "ready": "retried",
                "waiting": "waiting",
                "pending": "waiting",
            }
            self.add(key.get(outcome.status, "succeeded"))
        elif isinstance(outcome, AlreadyTerminal):
            self.add("already_terminal")
        elif isinstance(outcome, LeaseLost):
            self.add("lease_lost")

    # --- the event loop of ``async def`` function steps ------------------------------------

    def _loop_thread(self) -> None:
        """One thread runs an asyncio loop on which each ``async def`` function step is a task
        (up to ``async_concurrency`` at once, the rest waiting their turn in claim order); claims
        reach it from the thread that claimed them (:meth:`_enqueue`), their input already
        resolved. Nothing on the loop touches the database: what a task returns or raises goes
        to the completer. It ends once told to stop and every task is done."""
        try:
            asyncio.run(self._event_loop())
        except BaseException:
            logger.exception("loop_error: the event loop of async steps stopped")
        finally:
            connections.close_all()

    async def _event_loop(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending: collections.deque[tuple[StepClaim, executor.AsyncCall]] = collections.deque()
        self._closing = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        watch = LoopWatch(
            self.loop, name="buzz-workflows-steps", logger=logger, on_stall=lambda _: self.add("loop_stalls")
        )
        watch.start_here()
        self.loop_ready.set()
        try:
            await self._closing.wait()
            while self._tasks:
                await asyncio.wait(set(self._tasks))
        finally:
            watch.stop()

    def _spawn(self, claim: StepClaim | None, call: executor.AsyncCall | None) -> None:
        """On the loop: queue one claim for a task (None: stop once the tasks are done)."""
        if claim is None or call is None:
            self._closing.set()
            return
        self._pending.append((claim, call))
        self._start_pending()

    def _start_pending(self) -> None:
        while self._pending and len(self._tasks) < self.config.async_concurrency:
            claim, call = self._pending.popleft()
            if not self._take(claim, thread=False):
                continue  # handed back while it waited
            task = asyncio.ensure_future(self._await_step(claim, call))
            self._tasks.add(task)
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._start_pending()

    async def _await_step(self, claim: StepClaim, call: executor.AsyncCall) -> None:
        self.add("awaited")
        try:
            result = await executor.await_call(claim, call)  # what the step's code raises stays there
        except BaseException:  # never expected: not a reason to lose the loop
            logger.exception("step_error step=%s run=%s", claim.step.key, claim.lease.run_id)
            self.add("errors")
            self._ended(claim)
            return
        with self.lock:
            self.awaiting += 1
            self.loop_awaiting += 1
        if isinstance(result, executor.Output):
            self.completer.put(claim, result.value)
        else:
            self.completer.put_failure(claim, result)

    def _prepare(self, claim: StepClaim) -> executor.AsyncCall | None:
        """An ``async def`` function step made ready for the loop (its input read here, on the
        thread that claimed it), or None: a step thread runs it (any other step; or one whose
        input could not be read now, which the step thread reads again)."""
        if self.loop is None or claim.step.kind != "function":
            return None
        try:
            return executor.prepare_call(claim)
        except Exception as exc:
            logger.warning("prepare_error step=%s run=%s error=%s", claim.step.key, claim.lease.run_id, exc)
            if isinstance(exc, DatabaseError):
                close_old_connections()
                if connection.connection is not None and not connection.is_usable():
                    connection.close()
            return None

    def _to_loop(self, claim: StepClaim, call: executor.AsyncCall) -> bool:
        loop = self.loop
        if loop is None or self.loop_closing:
            return False
        try:
            loop.call_soon_threadsafe(self._spawn, claim, call)
        except RuntimeError:  # the loop is gone (its thread died): a step thread runs it
            return False
        return True

    def _renew_thread(self) -> None:
        every = self.config.lease_seconds / 3
        try:
            while True:
                with self.lock:
                    if self.stop.is_set() and not self.in_flight:
                        return
                self.renew_done.wait(every)  # set only when the step threads are gone
                if self.renew_done.is_set():
                    return
                with self.lock:
                    leases = list(self.held.values())  # started or completing: queued claims are not renewed
                self._renew_round(leases)
        finally:
            connection.close()

    def _renew_round(self, leases: list[StepLease]) -> None:
        """Renew ``leases``: one statement per community (per :data:`MAX_CLAIM` of its leases),
        each row fenced by its own lease. A lease found lost is no longer held (its completion
        will be told ``LeaseLost``, and writes nothing); a statement the database refuses
        leaves its leases held, to be renewed next round. With ``--all``, a statement waits for
        a lock at most :attr:`renew_lock_wait_ms`: past it (its community's rows are locked, a
        lifecycle move of that community waiting behind a long transaction of its own code, say)
        it changed nothing, that community is left for the next round and the others go on."""
        by_community: dict[uuid.UUID, list[StepLease]] = {}
        for lease in leases:
            by_community.setdefault(lease.community_id, []).append(lease)
        for community, held in by_community.items():
            for start in range(0, len(held), MAX_CLAIM):
                chunk = held[start : start + MAX_CLAIM]
                try:
                    with lock_waits_bounded(self.renew_lock_wait_ms):
                        outcomes = renew_steps(community, chunk, self.config.lease_seconds)
                except DatabaseError as exc:
                    if lock_wait_timed_out(exc):
                        logger.warning(
                            "renew_lock_wait community=%s n=%d: waited past %s ms for a lock (a lifecycle "
                            "move of its community, or a long transaction); renewed next round, the others go on",
                            community,
                            len(held),
                            self.renew_lock_wait_ms,
                        )
                        # One of its rows may be held, not the whole community: its leases one at
                        # a time, until one waits too (that one is renewed last from then on).
                        self._renew_singly(community, chunk if len(chunk) > 1 else [])
                        if len(chunk) == 1:
                            with self.lock:
                                tried_last(self.held, _key(chunk[0]))
                        break
                    close_old_connections()
                    connection.close()
                    continue
                self._renewed(chunk, outcomes)

    def _renewed(self, chunk: list[StepLease], outcomes: list[RenewOutcome]) -> None:
        with self.lock:
            self.counts["renew_statements"] += 1
            for lease, renewed in zip(chunk, outcomes, strict=True):
                key = _key(lease)
                if isinstance(renewed, StepRenewed) and key in self.held:
                    self.held[key] = renewed.lease
                    self.counts["renewed"] += 1
                elif isinstance(renewed, LeaseLost):
                    self.held.pop(key, None)  # its complete will be told LeaseLost

    def _renew_singly(self, community: uuid.UUID, chunk: list[StepLease]) -> None:
        """Renew ``chunk`` (whose statement waited past the lock bound) one lease at a time until
        one waits: one step row held by a long transaction then keeps neither the others of its
        community from renewal (the chunk's statement waited for it every round, so they all
        lapsed) nor, tried last from then on, the next round's single renewals."""
        for lease in chunk:
            try:
                with lock_waits_bounded(self.renew_lock_wait_ms):
                    outcomes = renew_steps(community, [lease], self.config.lease_seconds)
            except DatabaseError as exc:
                if lock_wait_timed_out(exc):
                    with self.lock:
                        tried_last(self.held, _key(lease))
                else:
                    close_old_connections()
                    connection.close()
                return
            self._renewed([lease], outcomes)

    # --- dispatcher ---------------------------------------------------------------------

    def _room(self, freed: int = 0, freed_loop: int = 0) -> int:
        """How many steps to claim now: idle step threads, plus up to ``batch_size`` to queue
        while the recent step run time says a queued step starts within a tenth of the lease (and
        within a second);
        results waiting for the completer hold no thread, but at most two batches of them
        count as free (a stalled completer slows the claims down). ``freed``: that many of the
        awaiting results are being completed and count as gone (``freed_loop``: of the loop's).
        With ``async def`` functions registered, the free places of the event loop count too,
        sized by :func:`mixed_room` (a claim cannot choose the kind of the steps it takes)."""
        c = self.config
        budget = min(c.lease_seconds * CLAIM_AHEAD_LEASE_FRACTION, CLAIM_AHEAD_MAX_SECONDS, c.poll_interval)
        now = time.monotonic()
        with self.lock:
            ahead = 0
            if self.step_seconds is not None:
                # Threads on a step longer than the budget start nothing queued within it.
                working = c.concurrency - sum(1 for since in self.running.values() if now - since > budget)
                ahead = min(self.batch_size, int(budget / max(self.step_seconds, 1e-4) * max(working, 0)))
            awaiting = self.awaiting - self.loop_awaiting - freed
            occupied = self.in_flight - self.loop_in_flight - freed - min(awaiting, 2 * self.batch_size)
            threads = c.concurrency + ahead - occupied
            if not self.has_async:
                return max(0, min(self.batch_size, threads))
            awaiting_loop = self.loop_awaiting - freed_loop
            occupied_loop = self.loop_in_flight - freed_loop - min(awaiting_loop, 2 * self.batch_size)
            tasks = c.async_concurrency - occupied_loop
            share = self.async_share
            # Sends take no loop place, so the loop's room alone would let a claim take sends
            # past the two batches a stuck completer may hold: cap it by the sends already there.
            sends_room = 2 * self.batch_size - self.sends_awaiting
        return max(0, min(mixed_room(threads, tasks, share, self.batch_size), sends_room))

    def _chain_room(self, completing: list[StepClaim], community: uuid.UUID) -> int:
        """The completer's ``room``: nothing once stopping or under ``max_steps`` (the
        dispatcher counts those claims), nor (--all) in a community other than the one the
        last walk found alone with work (:attr:`chain_for`), else :meth:`_room` with the
        batch's places freed."""
        if self.stop.is_set() or self.signal_name or self.config.max_steps is not None:
            return 0
        if self.config.community_id is None and community != self.chain_for:
            return 0
        if not self.leading:
            return 0  # a follower: the leader chains (issue 31)
        with self.lock:
            on_loop = sum(1 for claim in completing if _key(claim.lease) in self.on_loop)
        return self._room(freed=len(completing) - on_loop, freed_loop=on_loop)

    def _hinted(self, payload: str) -> None:
        """A step became ready in community ``payload`` (ours, with one community): sends may
        be ready to claim ahead; --all: unless it is the one the completer chains in, the next
        claim is a walk of every community with work."""
        with self.lock:
            self.sends_hint = True
            if self.config.community_id is None and self.chain_for is not None and payload != str(self.chain_for):
                self.chain_for = None

    def _after_batch(self) -> None:
        """The completer's ``after``: a claim the dispatcher left to the batch is its again."""
        with self.lock:
            self.batches += 1
            deferred, self.deferred_wake = self.deferred_wake, False
        if deferred:
            self.wake.set()

    def _accept(self, claims: list[StepClaim]) -> None:
        """Take claims made elsewhere (the completer's) into the work queue."""
        self._enqueue(claims)
        self.add("claimed", len(claims))
        self.add("chained", len(claims))

    def _enqueue(self, claims: list[StepClaim]) -> None:
        """Queue claims for the step threads, or, an ``async def`` function step, for the
        event loop (its input resolved here first: :meth:`_prepare`)."""
        self._to_sender([claim for claim in claims if claim.step.kind == "send_message"])
        for claim in claims:
            if claim.step.kind == "send_message":
                continue
            key = _key(claim.lease)
            call = self._prepare(claim)
            with self.lock:
                self.queued[key] = (claim, time.monotonic())
                self.in_flight += 1
                if call is not None:
                    self.has_async = True
                    self.on_loop.add(key)
                    self.loop_in_flight += 1
                if self.has_async:
                    self.async_share += ASYNC_SHARE_WEIGHT * ((call is not None) - self.async_share)
            if call is not None and self._to_loop(claim, call):
                continue
            if call is not None:
                with self.lock:
                    self.on_loop.discard(key)
                    self.loop_in_flight -= 1
            self.work.put(claim)

    def _to_sender(self, claims: list[StepClaim]) -> None:
        """Claimed ``send_message`` steps go straight to the completer, which sends them in one
        transaction (issue 31): no step thread takes them, so a batch holds every send of a
        claim, not one per step thread. Held (renewed) from now on, as a step thread's claim
        is; each one's place is freed when the completer is through with it."""
        if not claims:
            return
        with self.lock:
            self.sends_ahead_after = 0.0  # sends are about: claim them ahead again
            for claim in claims:
                self.held[_key(claim.lease)] = claim.lease
            self.in_flight += len(claims)
            self.awaiting += len(claims)
            self.sends_awaiting += len(claims)
        self.completer.put_sends(claims)

    def _hand_back(self, waited: float) -> None:
        """Hand back the claims that waited in the local queue ``waited`` seconds or more
        without a step thread taking them (never, when the threads are alive and the claim-ahead
        budget holds): :func:`release_steps`, so another orchestrator runs them now and no
        lease is renewed for work nobody does. A release the database refuses leaves those
        leases to lapse (they are not renewed)."""
        now = time.monotonic()
        with self.lock:
            stale = [claim for claim, at in self.queued.values() if now - at >= waited]
            for claim in stale:
                key = _key(claim.lease)
                del self.queued[key]
                if key in self.on_loop:
                    self.on_loop.discard(key)
                    self.loop_in_flight -= 1
            self.in_flight -= len(stale)
        if not stale:
            return
        by_community: dict[uuid.UUID, list[StepLease]] = {}
        for claim in stale:
            by_community.setdefault(claim.lease.community_id, []).append(claim.lease)
        for community, leases in by_community.items():
            try:
                released = release_steps(community, leases)
            except DatabaseError as exc:
                logger.warning("hand_back_refused steps=%d error=%s", len(leases), str(exc).splitlines()[:1])
                close_old_connections()
                connection.close()
                continue
            self.add("handed_back", released)
            logger.warning("handed_back steps=%d: no step thread took them within %.1f s", released, waited)

    def _dead_thread(self) -> str | None:
        """The reason to stop when a thread the orchestrator needs is gone (never expected)."""
        if any(not t.is_alive() for t in self.threads):
            return "step_thread_died"
        if self.completer.ident is not None and not self.completer.is_alive():
            return "completer_died"
        if self.loop_thread is not None and not self.loop_thread.is_alive() and not self.loop_closing:
            return "loop_thread_died"
        return None

    def _lead(self) -> bool:
        """One community: whether this orchestrator leads it now (asked of the database at
        most once a poll interval); --all: always.

        A follower of a live leader (the lock held by another session) does not LISTEN: the
        leader claims what a NOTIFY announces, and the follower claims only what was left
        waiting, which its poll (every poll interval) finds as well; a listening backend
        costs a transaction on the server for every notifying commit of the database, and a
        wake here. It LISTENs again once it leads or no longer knows whether anyone does (a
        connection error): resuming wakes the dispatcher, as any (re)connection does."""
        if self.leadership is not None:
            self.leading = self.leadership.check()
            if self.listener is not None:
                self.listener.pause(self.leadership.following)
            if self.leading:
                with self.lock:
                    self.counts["led"] = 1
        return self.leading

    def _may_claim(self, room: int) -> int:
        """How many of ``room`` to claim: the leader (and --all) all of it; a follower as many
        as there are ready steps that have waited ``follow_after`` seconds or more (the leader
        is saturated, slow, or gone). Its claim takes that many in the claim's own order
        (priority first, then age), so a fresher step of higher priority may be among them and
        an aged one of lower priority wait a round; the count ignores the concurrency limits, so
        under a binding limit a follower claims on every wake, as before leadership."""
        c = self.config
        if self.leading or c.community_id is None:
            return room
        self.add("follow_reads")
        return steps_left_waiting(c.community_id, self.follow_after, room)

    def _sends_wanted(self) -> bool:
        """Whether :meth:`_claim_sends_ahead` would claim now."""
        c = self.config
        with self.lock:
            return (
                c.community_id is not None
                and c.max_steps is None
                and self.leading
                and self.sends_hint
                and self.sends_awaiting < 2 * self.batch_size
                and time.monotonic() >= self.sends_ahead_after
            )

    def _claim_sends_ahead(self) -> bool:
        """With every step thread busy: claim the community's ready ``send_message`` steps (a
        statement that takes only those) and hand them to the completer, which sends them all in
        one transaction (issue 31); a send needs no step thread. Only the leader of one
        community, only after a NOTIFY since the last such claim or a poll interval without
        one (so a busy orchestrator does not claim for nothing on every freed place, and a send
        made ready without a NOTIFY, reaped or past its backoff, is still claimed ahead), never
        under ``max_steps``, and at most two batches of sends waiting for the completer (a slow
        completer slows these claims down).
        One that comes back empty stops them for a poll interval, unless a send is claimed
        meanwhile (a community without sends pays at most one such claim a poll interval).
        True when it claimed a full batch: more may be ready, claim again now."""
        c = self.config
        if not self._sends_wanted():
            return False
        assert c.community_id is not None
        with self.lock:
            limit = min(self.batch_size, 2 * self.batch_size - self.sends_awaiting)
            self.sends_hint = False  # a NOTIFY from now on asks for another claim
        try:
            claims = claim_steps(
                c.community_id, limit=limit, lease_seconds=c.lease_seconds, holder=self.holder, sends_only=True
            )
        except DatabaseError as exc:
            logger.warning("db_unavailable role=dispatcher error=%s", str(exc).splitlines()[:1])
            close_old_connections()
            connection.close()
            return False
        self.add("claim_statements")
        self._enqueue(claims)
        self.add("claimed", len(claims))
        self.add("sends_ahead", len(claims))
        if not claims:
            with self.lock:
                self.sends_ahead_after = time.monotonic() + c.poll_interval
        if len(claims) == limit:
            with self.lock:
                self.sends_hint = True
            return True
        return False

    def _claim(self, room: int) -> list[StepClaim]:
        c = self.config
        if c.community_id is not None:
            self.add("claim_statements")
            return claim_steps(c.community_id, limit=room, lease_seconds=c.lease_seconds, holder=self.holder)
        return self._walk(room)

    def _walk(self, room: int) -> list[StepClaim]:
        """--all: claim up to ``room`` steps over the communities with ready steps, round robin.
        First every community gets its share (``room`` split evenly, at least one each, in the
        order of :func:`communities_with_ready_steps` from after the community the last walk
        ended at); then what is left goes to those that filled their share. So no community
        gets a second share while another with work waits, and a backlog of any size delays
        another community's step by at most the claim batch in progress."""
        c = self.config
        self.next_walk = time.monotonic() + c.poll_interval
        communities = communities_with_ready_steps(after=self.walk_after)
        with self.lock:
            self.chain_for = communities[0] if len(communities) == 1 else None
        claims: list[StepClaim] = []
        each = share(room, len(communities))
        full: list[uuid.UUID] = []
        for community in communities:
            if len(claims) >= room:
                break
            if self.skipped.waits(community):
                continue  # its last claim or completion waited for a lock: claimed once that is over
            limit = min(each, room - len(claims))
            won = self._claim_of(community, limit)
            self.walk_after = community
            claims += won
            if len(won) == limit:
                full.append(community)
        for community in full:
            if len(claims) >= room:
                break
            claims += self._claim_of(community, room - len(claims))
        return claims

    def _claim_of(self, community: uuid.UUID, limit: int) -> list[StepClaim]:
        """--all: one claim statement of ``community``, its lock waits bounded: one that waited
        past the bound claimed nothing, and its community is left a while (``skipped``)."""
        c = self.config
        self.add("claim_statements")
        try:
            with lock_waits_bounded(self.renew_lock_wait_ms):
                return claim_steps(community, limit=limit, lease_seconds=c.lease_seconds, holder=self.holder)
        except DatabaseError as exc:
            if not lock_wait_timed_out(exc):
                raise
        self.skipped.skip(community)
        logger.warning(
            "claim_lock_wait community=%s: waited past %s ms for a lock (a lifecycle move of its community, or "
            "a long transaction); its claims wait %.2fs, the other communities go on",
            community,
            self.renew_lock_wait_ms,
            self.skipped.seconds,
        )
        return []

    def _end_due_waits(self) -> None:
        """At most once a poll interval: sleeps and event waits whose time came end now
        (``end_due_waits``), not at the next maintenance pass; what they release NOTIFYs."""
        now = time.monotonic()
        if now < self.next_due_check:
            return
        self.next_due_check = now + self.config.poll_interval
        try:
            c = self.config.community_id
            for community in [c] if c is not None else communities_with_due_waits():
                try:
                    end_due_waits(community)
                except DatabaseError as exc:
                    if _connection_lost(exc):
                        raise
                    # This community's poll failed on its own (its statement, its rows): the
                    # others are polled all the same. One that always fails and sorts first
                    # would otherwise starve every other community's due waits, each poll.
                    self.add("errors")
                    logger.warning("due_waits_failed community=%s error=%s", community, str(exc).splitlines()[:1])
        except DatabaseError as exc:
            logger.warning("db_unavailable role=dispatcher error=%s", str(exc).splitlines()[:1])
            close_old_connections()
            connection.close()

    def _await_batch(self, batch: int, until: float) -> None:
        """The dispatcher left its claim to the completer's batch after ``batch`` (see
        :meth:`dispatch`): wait until that batch is through (its ``after`` wakes us), until
        ``until`` (monotonic), a stop, or (--all) a hint that ends the chain. Other wakes (the
        NOTIFYs of steps made ready meanwhile, about one a run: that batch claims them) change
        none of these, and are waited through here rather than each paying a pass of the
        dispatch loop (its thread checks, hand-back scan, room and leadership)."""
        c = self.config
        while True:
            self.wake.clear()  # before the checks: a batch through after them sets it again
            if self.batches != batch or self.stop.is_set() or self.signal_name:
                return
            if c.community_id is None and self.chain_for is None:
                return
            left = until - time.monotonic()
            if left <= 0:
                return
            self.wake.wait(left)

    def dispatch(self) -> str:
        c = self.config
        idle_since = time.monotonic()
        started = 0
        misses = 0  # claims in a row that came back empty
        deferred_at: int | None = None  # the completer batch count when a claim was last left to it
        deferred_until = 0.0  # ... and until when (monotonic) it is left to that batch
        while True:
            if self.signal_name:
                return self.signal_name
            if self.stop.is_set():
                return "stopped"
            dead = self._dead_thread()
            if dead is not None:
                logger.error("%s: stopping the orchestrator", dead)
                return dead
            self._hand_back(c.poll_interval)
            self._end_due_waits()
            if c.max_steps is not None and started >= c.max_steps:
                return "max_steps"
            room = self._room()
            if c.max_steps is not None:
                room = min(room, c.max_steps - started)
            claims: list[StepClaim] = []
            if c.community_id is None and time.monotonic() >= self.next_walk:
                with self.lock:
                    self.chain_for = None  # a walk at least every poll interval, hint or not
            leading = self._lead()
            with self.lock:
                # Leave the claim to the completer's batch only where it may chain (--all: the
                # one community the last walk found with work, see _walk; one community: when
                # this orchestrator leads it).
                chaining = leading and (c.community_id is not None or self.chain_for is not None)
                completing = self.awaiting > 0 and c.max_steps is None and chaining
                self.deferred_wake = self.deferred_wake or (room > 0 and completing)
                # The batch count with that decision: a batch through after it (its wake
                # consumed before the wait below) must end the wait, not be waited past.
                batches = self.batches
            if room > 0 and completing and (deferred_at != batches or time.monotonic() < deferred_until):
                # The completer is about to record a batch, and it claims the ready steps in that
                # transaction; it wakes us after the batch, and we claim what it left. When no
                # batch went through within the poll interval (a completer waiting on a run
                # lock), we claim ourselves.
                if deferred_at != batches:
                    deferred_at, deferred_until = batches, time.monotonic() + c.poll_interval
                self._await_batch(deferred_at, deferred_until)
                continue
            hold_off = False  # a follower with nothing left waiting for it
            if room > 0:
                self.wake.clear()
                try:
                    allowed = self._may_claim(room)
                    hold_off = allowed == 0
                    if not hold_off:
                        claims = self._claim(allowed)
                except DatabaseError as exc:
                    logger.warning("db_unavailable role=dispatcher error=%s", str(exc).splitlines()[:1])
                    close_old_connections()
                    connection.close()
            self._enqueue(claims)
            started += len(claims)
            self.add("claimed", len(claims))
            with self.lock:
                busy = self.in_flight > 0
            if claims or busy or self.skipped:  # (a community left for a lock wait has work)
                idle_since = time.monotonic()
            elif c.idle_exit is not None and time.monotonic() - idle_since >= c.idle_exit:
                return "idle_exit"
            if hold_off:
                # A follower: what a wake announces is the leader's unless it is left waiting
                # (the leader claims at once); look again FOLLOW_AFTER after the wake, or after
                # a poll interval without one.
                if self.wake.wait(c.poll_interval):
                    self.stop.wait(self.follow_after)
            elif room - len(claims) <= 0:
                # Out of room: sends take none (claimed ahead, sent by the completer); a freed
                # place wakes us (a NOTIFY meanwhile is moot: the claim after the wake reads
                # what is ready, and marks sends to claim ahead).
                if self._claim_sends_ahead():
                    continue
                self.wake.clear()
                with self.lock:
                    self.starved = True
                if self._room() > 0 or self._sends_wanted():
                    continue  # a place came free meanwhile, or a NOTIFY marked sends to claim
                if not self.wake.wait(c.poll_interval):
                    # A poll: sends made ready without a NOTIFY (a lapsed lease the reaper
                    # readied, a retry whose backoff gate passed) are claimed ahead too; an
                    # empty claim pauses them a poll interval, so at most one a poll interval.
                    with self.lock:
                        self.sends_hint = True
            elif not claims:
                # Woken for nothing: another orchestrator took the steps. After such misses,
                # gather wakes a little before the next claim (a few ms, growing with the
                # misses in a row), so that K orchestrators woken by every NOTIFY do not all
                # claim for each; a claim that wins resets it.
                misses += 1
                left = self.skipped.next_try()  # a community left for a lock wait: claimed once it is over
                if self.wake.wait(c.poll_interval if left is None else min(left, c.poll_interval)) and misses > 1:
                    self.stop.wait(min(MISS_GATHER_MAX, MISS_GATHER * 2 ** min(misses - 2, 8)))
            else:
                # The claim took every ready step (fewer than the room): claim again when woken,
                # not at once (that claim would come back empty; a NOTIFY since the clear above
                # has set the wake already, so nothing that became ready meanwhile waits). Not
                # with --all: its walk reads a bounded number of communities, so steps of the
                # communities past it may be ready, their NOTIFYs heard before the clear.
                misses = 0
                if c.community_id is not None:
                    self.wake.wait(c.poll_interval)

    def run(self, conn_params: dict[str, Any]) -> dict[str, Any]:
        c = self.config
        missing_before = missing_counts()
        threads = self.threads = [
            threading.Thread(target=self._step_thread, name=f"buzz-workflows-step-{i}", daemon=True)
            for i in range(c.concurrency)
        ]
        renewer = threading.Thread(target=self._renew_thread, name="buzz-workflows-renewer", daemon=True)
        listener = self.listener = _listener(
            conn_params,
            c.community_id,
            self.wake,
            self.stop,
            c.poll_interval,
            on_hint=self._hinted,
        )
        self.loop_thread = threading.Thread(target=self._loop_thread, name="buzz-workflows-loop", daemon=True)
        if c.community_id is not None:
            self.leadership = Leadership(conn_params, c.community_id, c.poll_interval)
        for t in (*threads, self.completer, renewer, listener, self.loop_thread):
            t.start()
        reason = "error"
        try:
            if not self.loop_ready.wait(30):
                raise RuntimeError("the event loop of async steps did not start")
            reason = self.dispatch()
        finally:
            self.stop.set()
            if self.leadership is not None:
                self.leadership.close()  # another orchestrator leads from now on
                self.leading = False
            deadline = time.monotonic() + c.shutdown_grace
            # Drain first: a claim the completer made just before the stop still reaches the
            # work queue, ahead of the threads' stop markers.
            while time.monotonic() < deadline:
                with self.lock:
                    if not self.in_flight:
                        break
                if self._dead_thread() is not None:
                    break  # queued claims will not be taken: hand them back now
                self.wake.wait(0.05)
                self.wake.clear()
            self._hand_back(0.0)  # what no thread took is another orchestrator's to run
            for _ in threads:
                self.work.put(None)
            loop, self.loop_closing = self.loop, True
            if loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop is gone already
                    loop.call_soon_threadsafe(self._spawn, None, None)
            for t in (*threads, self.loop_thread):
                assert t is not None
                t.join(max(0.0, deadline - time.monotonic()))
            self.completer.close()
            self.completer.join(max(0.0, deadline - time.monotonic()))
            if self.completer.is_alive():  # items kept for a community whose rows stay locked
                self.completer.abandon()
                self.completer.join(5 + (self.renew_lock_wait_ms or 0) / 1000)  # a statement under way
            with self.lock:
                self.counts["abandoned"] = self.in_flight
                self.in_flight = 0
            self.renew_done.set()
            renewer.join(5)
            listener.join(5)
        self.counts["unlistened"] = listener.pauses
        self.counts["complete_statements"] = self.completer.statements
        self.counts["fail_statements"] = self.completer.fail_batches
        self.counts["send_statements"] = self.completer.send_batches
        exit_code = EXIT_OK if reason in ("SIGTERM", "SIGINT", "stopped", "idle_exit", "max_steps") else EXIT_ERROR
        if self.counts["abandoned"] and exit_code == EXIT_OK:
            exit_code = EXIT_ABANDONED
        # Steps that named a function this process does not have: {name: steps} (the log says how
        # to register it; the step failed function_not_registered).
        missing = dict(sorted((missing_counts() - missing_before).items()))
        return {**self.counts, "not_registered": missing, "reason": reason, "exit_code": exit_code}


class Leadership:
    """The leadership of one community's orchestrators (issue 31): a session advisory lock
    (:data:`LEADER_LOCK_NAMESPACE`, hashtext of the community id) held on a connection of its
    own, made with the listener's parameters (a direct connection when the default one goes
    through a transaction pooler; on Citus, the coordinator: the lock touches no table). The
    leader's process ending (SIGKILL too) ends its session and frees the lock. :meth:`check`
    asks the database at most once every ``every`` seconds: a follower tries the lock, a leader
    checks that its session is still there; any error means not leading (a new connection is
    tried next time). Used by the dispatcher thread only.

    The dispatcher must not hang on this connection, nor a vanished leader keep the lock for the
    hours TCP takes to notice: connecting and every statement are bounded by a few poll
    intervals (``connect_timeout``, TCP keepalives, ``statement_timeout``), and the server ends
    an idle session past ``idle_session_timeout`` (PostgreSQL 14+), which a living leader's
    check once a poll interval never reaches. A follower that cannot reach the database logs it
    (at most once a minute) and keeps following: the steps are still claimed, only not chained."""

    WARN_EVERY = 60.0

    def __init__(self, conn_params: dict[str, Any], community: uuid.UUID, every: float) -> None:
        bound = max(5, math.ceil(3 * every))  # seconds: a few poll intervals
        self.conn_params = {
            "connect_timeout": bound,
            "keepalives": 1,
            "keepalives_idle": bound,
            "keepalives_interval": max(1, bound // 3),
            "keepalives_count": 3,
            **conn_params,
            "application_name": f"buzz-workflows-lead:{os.getpid()}",
        }
        self.bound = bound
        self.community = str(community)
        self.every = every
        self.conn: psycopg.Connection[Any] | None = None
        self.leading = False
        # The last try found the lock held by another session: a leader is alive (its session
        # is; the lock goes with it). False while leading, before the first try and after any
        # error: whether anyone leads is then unknown.
        self.following = False
        self.next_check = 0.0
        self.next_warning = 0.0

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(**self.conn_params, autocommit=True)
        conn.execute("SELECT set_config('statement_timeout', %s, false)", (f"{self.bound}s",))
        if conn.info.server_version >= 140000:
            idle = max(60, 10 * self.bound)
            conn.execute("SELECT set_config('idle_session_timeout', %s, false)", (f"{idle}s",))
        return conn

    def check(self) -> bool:
        now = time.monotonic()
        if now < self.next_check:
            return self.leading
        self.next_check = now + self.every
        try:
            if self.conn is None or self.conn.closed:
                self.leading = False
                self.conn = self._connect()
            if self.leading:
                self.conn.execute("SELECT 1")  # the session, and the lock with it, still there
            else:
                row = self.conn.execute(TRY_LEAD, (LEADER_LOCK_NAMESPACE, self.community)).fetchone()
                self.leading = bool(row and row[0])
                self.following = not self.leading
                if self.leading:
                    logger.info("leading community=%s", self.community)
        except psycopg.Error as exc:
            if self.leading:
                logger.warning("leadership_lost community=%s error=%s", self.community, str(exc).splitlines()[:1])
            elif now >= self.next_warning:
                self.next_warning = now + self.WARN_EVERY
                logger.warning(
                    "leadership_unreachable community=%s error=%s (following: steps are claimed, not chained)",
                    self.community,
                    str(exc).splitlines()[:1],
                )
            self.close()
        return self.leading

    def close(self) -> None:
        self.leading = self.following = False
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # a broken connection may fail to close: dropped anyway
                conn.close()


# SQLSTATEs of a session the server ended or could not keep (class 08: connection exception,
# 57P01..57P03: shut down by an administrator, a crash, or unable to connect now).
CONNECTION_SQLSTATES = ("08", "57P01", "57P02", "57P03")


def _connection_lost(exc: BaseException) -> bool:
    """``exc`` is a failure of the connection, not of one community's statement: the session
    ended (its SQLSTATE), or psycopg lost it (an ``OperationalError`` without one), or Django
    closed it. Such a failure ends the pass, to reconnect."""
    if connection.connection is None or isinstance(exc, InterfaceError):
        return True
    failure = in_chain(exc, psycopg.Error)
    if failure is None:
        return False
    state = failure.sqlstate
    if state is None:
        return isinstance(failure, psycopg.OperationalError | psycopg.InterfaceError)
    return state.startswith(CONNECTION_SQLSTATES)


def _key(lease: StepLease) -> tuple[uuid.UUID, int]:
    return (lease.step_id, lease.lease_generation)


def _any_async_function() -> bool:
    """Whether a function registered in this process (decorated, or named in the settings) is
    ``async def``: only then does the dispatcher claim for the event loop too."""
    return any(executor.is_async_function(fn) for name in registered_names() if (fn := get_function(name)))


def mixed_room(threads: int, tasks: int, share: float, batch: int) -> int:
    """How many steps to claim (0..``batch``) when ``threads`` step-thread places and ``tasks``
    event-loop places are free (either may be negative: claims waiting beyond it) and about
    ``share`` of the claimed steps are ``async def`` function steps (the rest go to threads). A
    claim cannot choose its steps' kind, so the claim is sized for the expected mix: neither
    side is expected beyond its room, except that while one side has room the other may take up
    to a batch (scaled by its share) beyond its own, so that steps of the free side queued
    behind the busy side's are reached; what no thread takes within the poll interval is
    handed back."""
    sync_allow = threads + (batch * share if tasks > 0 else 0.0)
    async_allow = tasks + (batch * (1.0 - share) if threads > 0 else 0.0)
    limits = [math.inf]
    if share < 1.0:
        limits.append(sync_allow / (1.0 - share))
    if share > 0.0:
        limits.append(async_allow / share)
    n = min(limits)
    return 0 if n <= 0 else int(min(batch, n))


def run_orchestrator(
    config: OrchestratorConfig, *, stop: threading.Event | None = None, handle_signals: bool = True
) -> dict[str, Any]:
    """Run the orchestrator until stopped (signal, ``stop``, ``idle_exit``, ``max_steps``).
    Returns the summary: the counts of :data:`SUMMARY_KEYS`, ``reason`` and ``exit_code``
    (0 clean, 1 internal error, 3 in-flight steps abandoned at the end of the grace)."""
    stop = stop or threading.Event()
    orchestrator = Orchestrator(config, stop)
    previous: dict[int, Any] = {}
    if handle_signals and threading.current_thread() is threading.main_thread():

        def on_signal(signum: int, frame: Any) -> None:
            orchestrator.signal_name = signal.Signals(signum).name  # a plain attribute: no locks here

        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    # LISTEN on a direct connection when the default one goes through a transaction pooler.
    listen_alias = core_settings().listen_database or connection.alias
    try:
        return orchestrator.run(connections[listen_alias].get_connection_params())
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def summary_line(summary: dict[str, Any]) -> str:
    return json.dumps(summary, separators=(",", ":"))
