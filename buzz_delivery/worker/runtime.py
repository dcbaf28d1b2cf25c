"""The agent runtime (SPEC section 7): claim, run the handler, renew in the background, settle.

Threads: the caller's thread dispatches (claims, in batches, a little ahead of the handler
threads), ``concurrency`` handler threads run the handler, one settler thread settles their
results in batches (:mod:`buzz_delivery.worker.settler`), one renewer thread renews held
leases, one listener thread LISTENs for wake hints. Every service call is its own autocommit
statement (in a worker serving several communities, the renewer's, the settler's and the
dispatcher's claims and rate-limit statements each in a transaction of its own that bounds its
lock waits, so one community's locked rows never hold up the others': see
:mod:`buzz_delivery.worker.renewer`; a community whose claim waited past the bound is left for
a while and the other pairs are claimed): no transaction is open while a handler runs. The runtime
itself holds four database connections whatever the concurrency (dispatcher, settler, renewer,
listener); a handler thread opens one only if the handler uses the database. Each thread closes
its connection when it exits.

Logging: one INFO line per claim batch (``claimed n=...``) and per settle batch (``settled
n=...``); one DEBUG line per delivery (``claimed delivery=...``, ``settled delivery=...``,
``renewed delivery=...``); a WARNING or ERROR line for every delivery that went wrong.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import gc
import inspect
import json
import logging
import math
import os
import queue
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, DatabaseError, close_old_connections, connection, connections

from buzz_delivery import services, tracing
from buzz_delivery.conf import get_settings
from buzz_delivery.exceptions import BuzzDeliveryError
from buzz_delivery.holders import holder_identity
from buzz_delivery.loopwatch import LoopWatch
from buzz_delivery.services import Claim, Lease, LeaseLost, ratelimits, tenancy
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import lock_wait_timed_out, lock_waits_bounded
from buzz_delivery.usercode import TRANSACTION_LEFT_OPEN, AsyncUserCode, ScopedExecutor, UserCode, serve_loop
from buzz_delivery.worker.handlers import (
    FINISHED,
    NO_GUARD,
    Handler,
    SettleArgs,
    aborted_args,
    guards_user_code,
    settle_args_for,
)
from buzz_delivery.worker.listener import HintInbox, HintListener, Pair
from buzz_delivery.worker.renewer import DB_UNAVAILABLE, HeldLease, LeaseRenewer, busy_retry_seconds, lock_wait_ms
from buzz_delivery.worker.settler import SETTLED_KEYS, SettleJob, Settler

logger = logging.getLogger("buzz_delivery.worker")


_CONNECTION_HANDLER: Any = connections  # (the same object, typed loosely: its private ``_connections`` is read)


def _default_connection() -> Any:
    """This thread's default Django connection wrapper (``connections[DEFAULT_DB_ALIAS]``)."""
    return connections[DEFAULT_DB_ALIAS]


def thread_connection_lookup() -> Callable[[], Any]:
    """For a handler thread (a plain thread, never running an event loop between its
    deliveries): a function that returns the thread's default connection wrapper, as
    ``connections[DEFAULT_DB_ALIAS]`` would at that moment, read again on every call (a handler
    may replace it, or remove it).

    ``connections[...]`` goes through asgiref's thread-critical ``Local``, which first asks
    asyncio for a running loop (raising and catching inside) before it reads its plain
    ``threading.local``: ~0.7 µs on an idle machine, about 2 under load, once per delivery
    (issue 31). Outside a running loop that ``Local`` reads exactly that ``threading.local``
    (``_storage``), so this reads it directly, in C, while ``connections`` still holds the
    ``Local`` found here; it falls back to ``connections[...]`` when the
    wrapper is not there yet (created as Django creates it), when the ``Local`` was replaced,
    and altogether when this asgiref keeps its storage otherwise (the check below: the storage
    is a ``threading.local`` holding the very wrapper ``connections[...]`` returns)."""
    handler_local = getattr(connections, "_connections", None)  # (none: a Django that keeps it otherwise)
    storage = getattr(handler_local, "_storage", None)
    if not isinstance(storage, threading.local):
        return _default_connection
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:  # a thread running a loop: asgiref keeps a context's connections elsewhere
        return _default_connection
    expected = _default_connection()  # (creates the thread's wrapper, as its first delivery would)
    if getattr(storage, DEFAULT_DB_ALIAS, None) is not expected:
        return _default_connection

    def default_connection() -> Any:
        db = getattr(storage, DEFAULT_DB_ALIAS, None)
        if db is None or _CONNECTION_HANDLER._connections is not handler_local:
            return _default_connection()
        return db

    return default_connection


# Longest the dispatcher sleeps before it looks at the signal flag again.
SIGNAL_CHECK_SECONDS = 0.2
SUMMARY_KEYS = (
    "claimed",
    "finished",
    "failed",
    "retried",
    "lease_lost",
    "renewed",
    "timed_out",
    "settle_errors",
    "abandoned",
    "claim_statements",
    "settle_statements",
    "loop_stalls",  # an async handler's loop blocked (buzz_delivery.loopwatch)
    "rate_waits",  # claims held back by the claim rate limit (``rate_key``)
    "hints_dropped",  # held hints left unclaimed: nothing of their pair was claimable (hint_stagger)
)
# Claiming ahead: a claim may wait in the local queue for a free handler thread, for at most
# this fraction of the lease (and CLAIM_AHEAD_MAX_WAIT seconds) judged by the handlers' recent
# run time; queued claims are renewed like running ones. Nothing is claimed ahead before the
# first handler returned, nor while handlers run longer than that budget.
CLAIM_AHEAD_LEASE_FRACTION = 0.1
CLAIM_AHEAD_MAX_WAIT = 1.0
# Most claims per round trip and results per settle statement unless --batch-size says otherwise
# (never fewer than the handler threads). 50, not the thread count: a batch of 50 takes about
# 40% less server CPU per delivery than one of 16 (bench/results/peers-batch50.md), and the
# claim-ahead budget above keeps slow handlers from holding leases they cannot start.
DEFAULT_BATCH_SIZE = 50
MAX_BATCH_SIZE = 1000
# Handlers in flight at once: threads for a plain handler, tasks on one loop for an async one.
MAX_THREADS = 256
MAX_TASKS = 10_000
RUN_TIME_WEIGHT = 0.2  # weight of the newest handler run time in its moving average
# Seconds the settler waits for more results while a batch is short.
SETTLE_LINGER = 0.002
# Hint fan-out (issue 31): every worker process listening on a pair hears every hint, so K idle
# processes made K hinted claims per delivery, K-1 of them empty. A process whose last hinted
# claim of a pair came back empty (a sibling took the row first) holds that pair's next hints
# this many seconds, then claims one row of the pair, its oldest claimable one: empty, nothing
# the held hints name is claimable (a sibling took them within the stagger, or they are
# scheduled or gone) and they are dropped; won, the sibling missed it (busy, gone), so this
# process claims the rest and claims the pair's hints at once again. One process then takes a
# trickle at once and each sibling makes one claim per stagger window, not one per delivery. A
# delivery a busy or dead sibling left is claimed after the stagger. Any hinted claim that comes
# back empty holds the pair (a forged hint, one of a delivery committed with not_before, or
# superseded before its claim): the pair's next deliveries then wait the stagger, never a poll.
# 0 (the default) turns it off: it cut the claims of 4 idle processes from ~4 to 1.3-2.0 per
# delivery, but a delivery whose winner is starved waits the stagger, and on a loaded machine
# the p99s were higher with it (docs/performance.md#hint-fan-out, bench/results/wake-stop54.md).
DEFAULT_HINT_STAGGER = 0.0
MAX_HINT_STAGGER = 10.0

# Exit codes of ``run_delivery_worker`` (2 is argparse's bad arguments).
EXIT_OK = 0
EXIT_ERROR = 1  # stopped on an internal error (see the summary's ``reason``)
EXIT_ABANDONED = 3  # stopped with in-flight leases given up (shutdown grace expired, or hung handlers)
# Stop reasons that are a clean stop (exit 0 unless leases were given up).
CLEAN_REASONS = frozenset({"SIGTERM", "SIGINT", "max_deliveries", "idle_exit", "stopped"})
HANDLERS_HUNG = "handlers_hung"
# Most characters of a handler's exception message in a log line (the row keeps up to 10,000).
LOGGED_MESSAGE_CHARS = 500


class WorkerInTransaction(BuzzDeliveryError):
    """``run_worker`` was called inside ``transaction.atomic()``: claims would hold row locks
    until the caller commits. Call it in autocommit mode."""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Options of one worker (see ``run_delivery_worker --help``).

    ``community_id``/``target_pubkey`` (32 bytes): whose deliveries to claim; ``extra_pairs``:
    more (community, target) pairs the same process serves, with the same handler threads and
    connections (a pair given twice counts once; see :attr:`pairs`). ``handler``: see
    :mod:`buzz_delivery.worker.handlers`. ``concurrency``: handlers in flight at once: handler
    threads (1..256) for a plain handler; for an ``async def`` handler, tasks on one event loop
    thread (1..10,000), which hold no database connection of their own.
    ``lease_seconds``: None = ``LEASE_SECONDS``. ``batch_size``: most claims per round trip
    and most results per settle statement (1..1000; None = the larger of ``concurrency`` and
    :data:`DEFAULT_BATCH_SIZE`). Claims go to free
    handler threads, and up to ``batch_size`` more wait in a local queue when the handlers'
    recent run times say they start within a tenth of the lease (at most a second).
    ``poll_interval``: seconds between polls when idle. ``max_deliveries``: stop after claiming
    and settling that many. ``idle_exit``: stop after that many seconds with nothing to do.
    ``renew_fraction``: renew each lease after this fraction of its length (0 < f < 1).
    ``handler_timeout``: seconds a handler may run (None = no limit); a delivery with
    ``expires_at`` gets no more than until then. Past its deadline the delivery is settled
    ``retry`` at once (attempts count, the backoff applies; on the last attempt it ends
    ``failed``), its lease is no longer renewed and the handler's late result is dropped; a
    later claim of that delivery while the hung handler still runs here is settled ``retry``
    again without running it. When every handler thread is past its deadline the worker stops
    (exit 3): only a new process gets rid of a hung thread.
    ``shutdown_grace``: seconds a stopping worker waits for in-flight handlers before it gives
    up their leases (no longer renewed) and stops (exit 3); a second SIGTERM/SIGINT gives up at once.
    ``name``: the worker's name in its holder identity ``host:pid:name`` (:func:`holder_identity`),
    which every claim records as ``claimed_by`` and in the delivery's history.
    ``rate_key``: a key of ``BUZZ_DELIVERY['RATE_LIMITS']``: the claims of each community take
    its units first (one per delivery, :mod:`buzz_delivery.services.ratelimits`), so the fleet's
    workers sharing the key claim at most ``limit`` deliveries of a community per ``period``;
    over it, that community's claims wait for the next window (docs/flow-control.md).
    ``hint_stagger``: seconds (0..10; 0 = off, the default) a pair's hints wait before they are claimed while
    this worker's last hinted claim of that pair came back empty (a sibling process took the
    row): see :data:`DEFAULT_HINT_STAGGER`.
    """

    community_id: uuid.UUID
    target_pubkey: bytes
    handler: Handler
    concurrency: int = 1
    lease_seconds: float | None = None
    batch_size: int | None = None
    poll_interval: float = 1.0
    max_deliveries: int | None = None
    idle_exit: float | None = None
    renew_fraction: float = 1 / 3
    handler_timeout: float | None = 900.0
    shutdown_grace: float = 30.0
    name: str = "worker"
    extra_pairs: tuple[Pair, ...] = ()
    rate_key: str | None = None
    hint_stagger: float = DEFAULT_HINT_STAGGER

    def __post_init__(self) -> None:
        # A pair's community as text (any case, with or without hyphens) or its target as a
        # bytearray would neither deduplicate nor match the hints' canonical ids.
        pairs = tuple(
            (
                v.uuid_value(community, f"extra_pairs[{i}].community_id"),
                v.bytes32(target, f"extra_pairs[{i}].target_pubkey"),
            )
            for i, (community, target) in enumerate(self.extra_pairs)
        )
        object.__setattr__(self, "extra_pairs", pairs)
        # Threads for a plain handler; tasks on one loop (no connection each) for an async one.
        limit = MAX_TASKS if is_async_handler(self.handler) else MAX_THREADS
        v.int_in_range(self.concurrency, "concurrency", 1, limit)
        # A day at most, as the agent workers' poll_seconds: 1e10 was taken, and a wait on it (the
        # listener's retry after a lost connection, a rate-limit pause) raised OverflowError.
        v.poll_seconds(self.poll_interval, "poll_interval")
        if self.rate_key is not None:
            ratelimits.rate_limit_of(self.rate_key)  # an undeclared key: ValidationError keyed rate_key
        stagger = v.seconds_in_range(self.hint_stagger, "hint_stagger", 0.0, MAX_HINT_STAGGER)
        object.__setattr__(self, "hint_stagger", stagger)

    @property
    def pairs(self) -> tuple[Pair, ...]:
        """Every (community, target) pair this worker serves, the first pair first, each once."""
        return tuple(dict.fromkeys([(self.community_id, self.target_pubkey), *self.extra_pairs]))


class Tally:
    """Thread-safe counters of the summary line."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def summary(self) -> dict[str, int]:
        """:data:`SUMMARY_KEYS` -> counts."""
        with self._lock:
            return {key: self._counts[key] for key in SUMMARY_KEYS}


class WorkerSummary(dict[str, int]):
    """The counts of one worker run (:data:`SUMMARY_KEYS` -> int), plus why it stopped.

    ``reason``: ``SIGTERM``, ``SIGINT``, ``max_deliveries``, ``idle_exit`` or ``stopped`` (a clean
    stop), ``handlers_hung`` (every handler thread past its deadline), or an internal error
    (``worker_error``, ``handler_thread_died``, ``settler_died``). ``exit_code``: :data:`EXIT_OK`
    for a clean stop with nothing given up, :data:`EXIT_ABANDONED` when in-flight leases were
    given up or every handler hung, :data:`EXIT_ERROR` for an internal error.
    ``pending_retry``: deliveries of this community and target left ``pending`` while they wait
    out a retry backoff when the worker stopped (an ``idle_exit`` does not wait for them; the
    next worker claims them once their ``next_attempt_at`` has passed).
    """

    reason: str
    exit_code: int
    pending_retry: int

    def __init__(self, counts: dict[str, int], reason: str, pending_retry: int = 0) -> None:
        super().__init__(counts)
        self.reason = reason
        self.pending_retry = pending_retry
        if reason not in CLEAN_REASONS and reason != HANDLERS_HUNG:
            self.exit_code = EXIT_ERROR
        elif counts.get("abandoned") or reason == HANDLERS_HUNG:
            self.exit_code = EXIT_ABANDONED
        else:
            self.exit_code = EXIT_OK


def summary_line(summary: dict[str, int]) -> str:
    """The one JSON line the command prints at exit: the counts, then ``pending_retry``,
    ``reason`` and ``exit_code`` when ``summary`` is a :class:`WorkerSummary`."""
    line: dict[str, object] = dict(summary)
    if isinstance(summary, WorkerSummary):
        line.update(pending_retry=summary.pending_retry, reason=summary.reason, exit_code=summary.exit_code)
    return json.dumps(line, separators=(",", ":"))


class Worker:
    """One run of the agent runtime; use :func:`run_worker`."""

    def __init__(self, config: WorkerConfig, stop: threading.Event) -> None:
        self.config = config
        self.lease_seconds = v.lease_seconds(config.lease_seconds)
        self.batch_size = config.batch_size or min(max(config.concurrency, DEFAULT_BATCH_SIZE), MAX_BATCH_SIZE)
        self.holder = holder_identity(config.name)
        self.pairs = config.pairs
        self.next_pair = 0  # where the next poll of every pair starts (round robin)
        # Claim rate limit (config.rate_key): communities whose window is used up, until when
        # (monotonic), and the soonest of those, when the dispatcher's next round is due.
        self.rate_paused: dict[uuid.UUID, float] = {}
        self.rate_resume: float | None = None
        self.rate_windows: dict[uuid.UUID, dt.datetime] = {}  # the window of a claim's units
        self.backlogged: list[Pair] = []  # the pairs whose last poll came back full
        # Pairs whose last hinted claim came back empty: their hints wait config.hint_stagger
        # (see DEFAULT_HINT_STAGGER); a pair leaves the set once a claim of its hints wins.
        self.hint_stagger = config.hint_stagger
        self.hints_lost: set[Pair] = set()
        # When a poll of this worker last claimed rows of a pair (monotonic): a hinted claim that
        # comes back empty soon after may have lost to that poll, not to a sibling.
        self.polled_at: dict[Pair, float] = {}
        self.stop = stop
        self.wake = threading.Event()
        self.tally = Tally()
        self.inbox = HintInbox(self.wake)
        # Renewals and settles bound their lock waits only in a worker serving several
        # communities (one community's locked rows must not hold up another's leases); the
        # bound's own transaction costs a few µs a delivery that a one-community worker keeps.
        several = len({community for community, _ in self.pairs}) > 1
        self.renewer = LeaseRenewer(
            lease_seconds=self.lease_seconds,
            every=self.lease_seconds * config.renew_fraction,
            on_renewed=lambda: self.tally.add("renewed"),
            on_timed_out=self._timed_out,
            bound_lock_waits=several,
        )
        self.settler = Settler(
            max_batch=self.batch_size,
            linger=SETTLE_LINGER,
            lease_seconds=self.lease_seconds,
            count=self.tally.add,
            done=self._settled,
            bound_lock_waits=several,
        )
        # The dispatcher's claims (and their rate-limit statements) bound their lock waits the
        # same way: a community whose claim waited past the bound (and changed nothing) is not
        # claimed from until then (monotonic; keyed by the id's int), the others are.
        self.claim_lock_wait_ms = lock_wait_ms(self.lease_seconds) if several else None
        self.claims_busy: dict[int, float] = {}
        self.claims_busy_retry = busy_retry_seconds(self.lease_seconds)
        # (claim, monotonic instant of the claim)
        self.work: queue.SimpleQueue[tuple[Claim, float] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.in_flight = 0  # claimed and not yet settled (or dropped)
        self.handling = 0  # claimed and not yet handed to the settler: queued or running
        self.run_time: float | None = None  # moving average of handler run time, seconds
        self.claimed = 0
        self.last_busy = time.monotonic()
        self.error_reason: str | None = None  # the first internal error (see _fail)
        self.signal_name = ""  # set by the signal handler (see run_worker)
        self.signalled = False
        self.give_up = False  # a second signal: stop waiting for in-flight handlers
        # Claims whose handler has not yet reached its settle decision; once ``gave_up`` is set
        # (under ``_lock``) they are abandoned: none of them settles any more.
        # Keyed by the ids' ints (hashed in C; a UUID hashes through a Python method).
        self.undecided: set[tuple[int, int]] = set()
        self.gave_up = False
        self.threads: list[threading.Thread] = []
        self.exited: set[int | None] = set()  # handler threads that stopped as told (a stop marker)
        # Set by a handler (or loop) thread on its way out, whyever it ends: the dispatcher then
        # looks for a dead thread at once (else every SIGNAL_CHECK_SECONDS, see dispatch).
        self.thread_ended = False
        # An ``async def`` handler runs on one event loop thread (its loop, once running).
        self.is_async = is_async_handler(config.handler)
        # A handler that runs its user code in a guard of its own (the task runner: the task
        # and its signal receivers, each judged where it ran) is not wrapped in a second one.
        self.guards_handler = not guards_user_code(config.handler)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_ready = threading.Event()
        self._executors: tuple[ScopedExecutor, ...] = ()  # the loop's threads (usercode.serve_loop)
        self._community_texts: dict[int, str] = {}  # by the community id's int

    # --- handler threads -------------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        """Stop the worker for an internal error; the first reason given is the one reported."""
        with self._lock:
            if self.error_reason is None:
                self.error_reason = reason
        self.stop.set()
        self.wake.set()

    def _retry_now(self, lease: Lease, why: str) -> None:
        """Settle ``retry`` at once (attempts count, the backoff applies): one statement, no
        retries, never raises (it may run on the renewer or the dispatcher thread)."""
        try:
            outcome = services.finish_delivery(lease, "retry", failure_message=why)
        except Exception as exc:
            logger.warning("settle_error delivery=%s outcome=retry: %s; left to lapse", lease.delivery_id, exc)
            close_old_connections()
            return
        if isinstance(outcome, LeaseLost):
            self.tally.add("lease_lost")
            return
        logger.info(
            "settled n=1 delivery=%s generation=%d outcome=retry status=%s (%s)",
            lease.delivery_id,
            lease.lease_generation,
            outcome.status,
            why,
        )
        self.tally.add(SETTLED_KEYS.get(outcome.status, outcome.status))

    def _timed_out(self, held: HeldLease) -> None:
        """The renewer found a handler past its deadline: hand the delivery back now (a retry,
        so attempts count and the backoff applies) instead of letting its lease lapse."""
        self.tally.add("timed_out")
        self._retry_now(held.lease, "handler_timeout: the handler ran past its deadline")
        self.wake.set()  # the dispatcher checks whether every handler thread is now hung

    def _begin(self, claim: Claim, claimed_at: float) -> float | None:
        """Before a handler runs: None when the worker already gave its leases up (the claim is
        not run), else its start (monotonic), with its deadline handed to the renewer."""
        lease = claim.lease
        # A plain read (set once, under the lock, by drain): a give-up right after it still
        # drops this claim's result in _result, as it did when this read took the lock.
        if self.gave_up:  # a claim still queued when the worker gave its leases up: not run
            self.renewer.release(lease)
            return None
        started = time.monotonic()
        self.renewer.set_deadline(lease, self._deadline(claim, claimed_at, started))
        return started

    def _raised(self, lease: Lease, exc: BaseException) -> SettleArgs:
        """The settle of a handler that raised ``exc``: see :mod:`buzz_delivery.worker.handlers`."""
        if not isinstance(exc, Exception):
            # SystemExit, KeyboardInterrupt, CancelledError...: the handler asked to stop, which
            # ends this delivery (failed, the class name as its code), never the worker.
            args = aborted_args(exc)
            logger.warning(
                "handler_error delivery=%s generation=%d outcome=failed error=%s: the handler raised a BaseException",
                lease.delivery_id,
                lease.lease_generation,
                args.failure_code,
            )
            return args
        args = settle_args_for(exc)
        if isinstance(exc, DB_UNAVAILABLE):
            # The handler hit this thread's dead connection (a restart, a terminated backend):
            # drop it so the next handler call on this thread reconnects.
            connection.close()
        logger.warning(
            "handler_error delivery=%s generation=%d outcome=%s error=%s: %s",
            lease.delivery_id,
            lease.lease_generation,
            args.outcome,
            args.failure_code or type(exc).__name__,
            (args.failure_message or "")[:LOGGED_MESSAGE_CHARS],
            # An ordinary retry is one line; its traceback only at DEBUG (-v 2).
            exc_info=logger.isEnabledFor(logging.DEBUG),
        )
        return args

    def _result(self, lease: Lease, args: SettleArgs, held: HeldLease | None, ran: float) -> SettleJob | None:
        """After a handler ran (for ``ran`` seconds): what to settle, or None (the result is
        dropped). The claim's settle decision, its run time and its leaving the handlers' hands
        under one hold of the worker's lock (a no-op delivery's bookkeeping was three):

        - the decision: dropped when the worker already gave its leases up (the claim counts
          as abandoned and must not settle: see :meth:`drain`) or when the handler ran past its
          deadline; else it will settle;
        - the run time, folded into the moving average the claim-ahead budget reads;
        - the claim is no longer queued or running (``handling``), and no longer in flight
          when its result is dropped (else once the settler is done with it).

        The caller then hands the job to the settler (:meth:`_handed`); nothing here raises
        after the counts changed."""
        key = (lease.delivery_id.int, lease.lease_generation)
        timed_out = held is not None and held.timed_out
        now = time.monotonic()
        with self._lock:
            self.undecided.discard(key)
            gave_up = self.gave_up
            previous = self.run_time
            self.run_time = ran if previous is None else previous + RUN_TIME_WEIGHT * (ran - previous)
            self.handling -= 1
            if gave_up or timed_out:
                self.in_flight -= 1
            self.last_busy = now
        if gave_up:
            logger.warning(
                "result_dropped delivery=%s generation=%d outcome=%s: the worker gave up its leases at shutdown",
                lease.delivery_id,
                lease.lease_generation,
                args.outcome,
            )
            return None
        if timed_out:
            logger.warning(
                "result_dropped delivery=%s generation=%d outcome=%s: the handler returned after its deadline",
                lease.delivery_id,
                lease.lease_generation,
                args.outcome,
            )
            return None
        return SettleJob(lease, args)

    def _community_text(self, community_id: uuid.UUID) -> str:
        """``str(community_id)``, formatted once per community (a handler scope takes the text)."""
        text = self._community_texts.get(community_id.int)
        if text is None:
            text = self._community_texts[community_id.int] = str(community_id)
        return text

    def _handle(
        self, claim: Claim, claimed_at: float, default_connection: Callable[[], Any] = _default_connection
    ) -> SettleJob | None:
        """Run the handler for one claim; returns what to settle, or None (result dropped),
        with the claim counted out of the handlers' hands (:meth:`_result`).
        ``default_connection``: this thread's lookup of its default connection wrapper
        (:func:`thread_connection_lookup`)."""
        lease = claim.lease
        # The thread's default connection wrapper, looked up for each delivery, not once per
        # thread: a handler may have replaced it (``connections["default"] = ...``, a lane left
        # entered), and the scope and the guard below must go on the one this handler's
        # statements use, else they run with no community context (test_worker_thread_connection).
        db = default_connection()
        if db.in_atomic_block:  # never a transaction around a handler
            raise WorkerInTransaction("a handler thread is inside transaction.atomic()")
        started = self._begin(claim, claimed_at)
        if started is None:
            self._dropped()
            return None
        # With the delivery's community as context: what the handler reads of our tables
        # through the ORM (a deferred field, a related row) is that community's, and only
        # that; as the login role, which holds the grants on the project's own tables. What it
        # leaves open on this thread's connection is undone there (buzz_delivery.usercode).
        call = UserCode(self._community_text(lease.community_id), db) if self.guards_handler else None
        try:
            with call or NO_GUARD, tracing.handler_span(claim.delivery):
                self.config.handler(claim.delivery)
            args = FINISHED
        except BaseException as exc:
            args = self._raised(lease, exc)
        finally:
            held = self.renewer.release(lease)
            ran = time.monotonic() - started
        if call is not None and call.left_open is not None:
            args = _left_open_args(lease, call.left_open)
        return self._result(lease, args, held, ran)

    async def _ahandle(self, claim: Claim, claimed_at: float, target: tenancy.Target) -> SettleJob | None:
        """As :meth:`_handle`, for an ``async def`` handler, awaited on the worker's loop.
        ``target``: the tenancy target of its community's handlers (``tenancy.handler_target``)."""
        lease = claim.lease
        started = self._begin(claim, claimed_at)
        if started is None:
            self._dropped()
            return None
        # The delivery's community as the context of this task (and of its child tasks, and of
        # what it sends to the loop's threads): its async ORM and sync_to_async statements run
        # in its tenancy scope, as a plain handler's do, however many communities' handlers
        # share those threads (buzz_delivery.usercode, "async def handlers").
        call = AsyncUserCode(target.community, target)
        try:
            with call, tracing.handler_span(claim.delivery):
                await self.config.handler(claim.delivery)  # type: ignore[misc]
            args = FINISHED
        except BaseException as exc:  # a CancelledError too: it ends this delivery only
            args = self._raised(lease, exc)
        finally:
            held = self.renewer.release(lease)
            ran = time.monotonic() - started
        if call.left_open is not None:
            args = _left_open_args(lease, call.left_open)
        return self._result(lease, args, held, ran)

    def _settled(self, n: int) -> None:
        """The settler is done with ``n`` results (settled or not): they are no longer in flight."""
        with self._lock:
            self.in_flight -= n
            self.last_busy = time.monotonic()
        self.wake.set()

    def _dropped(self) -> None:
        """One claim is out of the handlers' hands without a :meth:`_result` (not run, or its
        step raised): it is no longer queued, running or in flight. (A result's own counts are
        taken in :meth:`_result`.)"""
        with self._lock:
            self.handling -= 1
            self.in_flight -= 1
            self.last_busy = time.monotonic()

    def _handed(self, job: SettleJob | None) -> None:
        """After a claim was counted out of the handlers' hands: settle its result, if any,
        and have the dispatcher look at the counts again."""
        if job is not None:
            self.settler.put(job)
        # The dispatcher clears the flag before it reads the counts, so a flag still set
        # means it has yet to read them: setting it again (a lock and a notify) is skipped.
        if not self.wake.is_set():
            self.wake.set()

    def _handler_thread(self) -> None:
        try:
            default_connection: Callable[[], Any] | None = None
            while (item := self.work.get()) is not None:
                claim, claimed_at = item
                if default_connection is None:  # at the thread's first delivery, as the wrapper was made
                    default_connection = thread_connection_lookup()
                try:
                    job = self._handle(claim, claimed_at, default_connection)
                except BaseException:
                    # Never let a handler thread die silently: claims would pile up unhandled.
                    logger.exception("worker_error delivery=%s: settle step raised", claim.lease.delivery_id)
                    self._fail("worker_error")
                    self._dropped()  # (a step that raised before the claim was counted out)
                    self._handed(None)
                else:
                    self._handed(job)
            with self._lock:
                self.exited.add(threading.get_ident())
        finally:
            self._thread_ends()
            connections.close_all()

    def _thread_ends(self) -> None:
        """A handler (or loop) thread is ending, as told or not: have the dispatcher look."""
        self.thread_ended = True
        self.wake.set()

    # --- the event loop of an async handler ------------------------------------------------------

    def _loop_thread(self) -> None:
        """With an ``async def`` handler: one thread runs an asyncio loop on which each claim's
        handler is a task (up to ``concurrency`` at once); claims reach it from the dispatcher
        a claim batch at a time (:meth:`_start`, :meth:`_spawn`), the stop marker through
        :meth:`_submit`. It ends once told to stop and every task is done."""
        try:
            asyncio.run(self._event_loop())
            with self._lock:
                self.exited.add(threading.get_ident())
        except BaseException:
            logger.exception("worker_error: the handlers' event loop stopped")
            self._fail("worker_error")
        finally:
            for executor in self._executors:  # the handlers' sync threads, and their connections
                executor.close()
            self._thread_ends()
            connections.close_all()

    async def _event_loop(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = asyncio.Event()
        # ``concurrency`` handlers at once: the claims ahead of them (``_ahead``) wait in
        # ``_waiting`` for a free slot, as they wait in the queue of the handler threads, and a
        # claim's task is created when it starts (issue 31: no semaphore for every task to pass,
        # no task made and parked for each claim ahead).
        self._waiting: collections.deque[tuple[Claim, float, tenancy.Target]] = collections.deque()
        # What this iteration of the loop finished, handed to the settler at its end (:meth:`_hand_over`).
        self._finished: list[SettleJob] = []
        self._hand_over_due = False
        self._free_slots = self.config.concurrency
        watch = LoopWatch(
            self.loop, name="buzz-worker-handlers", logger=logger, on_stall=lambda _: self.tally.add("loop_stalls")
        ).start_here()
        with serve_loop(self.loop, "buzz-delivery-handlers") as self._executors:
            self.loop_ready.set()
            try:
                await self._closing.wait()
                while self._tasks:  # (claims still waiting start as these end)
                    await asyncio.wait(set(self._tasks))
            finally:
                watch.stop()
                # Whatever the last iteration finished, should its hand-over not have run yet.
                self._hand_over()

    def _spawn(self, items: list[tuple[Claim, float]] | None) -> None:
        """On the loop: the claims of one claim batch (one hand-off from the dispatcher per
        batch), or the stop marker (None). Each claim waits with its community's tenancy
        target, made once per community and batch (it reads the settings: ``SWITCH_ROLES``)."""
        if items is None:
            self._closing.set()
            return
        targets: dict[int, tenancy.Target] = {}
        for claim, claimed_at in items:
            community_id = claim.lease.community_id
            target = targets.get(community_id.int)
            if target is None:
                target = targets[community_id.int] = tenancy.handler_target(self._community_text(community_id))
            self._waiting.append((claim, claimed_at, target))
        self._start_waiting()

    def _start_waiting(self) -> None:
        """Start the waiting claims' handlers, as many as there are free slots, oldest first."""
        waiting = self._waiting
        create_task = self.loop.create_task  # type: ignore[union-attr]
        while waiting and self._free_slots > 0:
            self._free_slots -= 1
            task = create_task(self._task(*waiting.popleft()))
            self._tasks.add(task)
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._free_slots += 1
        if self._waiting:
            self._start_waiting()

    async def _task(self, claim: Claim, claimed_at: float, target: tenancy.Target) -> None:
        try:
            job = await self._ahandle(claim, claimed_at, target)
        except BaseException:
            logger.exception("worker_error delivery=%s: settle step raised", claim.lease.delivery_id)
            self._fail("worker_error")
            self._dropped()
            job = None
        # Handed over at the end of this iteration of the loop, with whatever else it finished:
        # one hold of the settler's lock and one look of the dispatcher for them all (issue 31).
        if job is not None:
            self._finished.append(job)
        if not self._hand_over_due:
            self._hand_over_due = True
            self.loop.call_soon(self._hand_over)  # type: ignore[union-attr]

    def _hand_over(self) -> None:
        """On the loop: :meth:`_handed` of what its last iteration finished, at once."""
        self._hand_over_due = False
        jobs, self._finished = self._finished, []
        if jobs:
            self.settler.put_many(jobs)
        if not self.wake.is_set():  # (as in _handed)
            self.wake.set()

    def _submit(self, item: tuple[Claim, float] | None) -> None:
        """Hand a claim (or a stop marker) to the handlers: a thread's queue, or the loop."""
        if self.loop is None:
            self.work.put(item)
        else:
            self.loop.call_soon_threadsafe(self._spawn, None if item is None else [item])

    # --- dispatcher (the caller's thread) ------------------------------------------------------

    def _ahead(self) -> int:
        """How many claims may wait in the local queue beyond the free handler threads: as many
        as the working threads start, at their recent pace, within the claim-ahead budget
        (:data:`CLAIM_AHEAD_LEASE_FRACTION`); at most ``batch_size``; 0 before any handler ran."""
        with self._lock:
            run_time = self.run_time
        if run_time is None:
            return 0
        working = self.config.concurrency - self.renewer.timed_out_count()
        budget = min(self.lease_seconds * CLAIM_AHEAD_LEASE_FRACTION, CLAIM_AHEAD_MAX_WAIT)
        pace = working / max(run_time, 1e-6)  # handler starts per second
        return max(0, min(self.batch_size, int(budget * pace)))

    def _room(self) -> int:
        """How many deliveries the next claim may take: 0 while claims wait in the local queue
        beyond one per handler thread and less than a batch would fit (see below)."""
        capacity = self.config.concurrency + self._ahead()
        with self._lock:
            handling = self.handling
            # Results waiting for the settler hold no handler thread, but at most two batches
            # of them count as room: a stalled settle slows the claims down.
            free = min(capacity - handling, capacity + 2 * self.batch_size - self.in_flight)
        if self.config.max_deliveries is not None:
            free = min(free, self.config.max_deliveries - self.claimed)
        if 0 < free < self.batch_size and handling > self.config.concurrency:
            # Top the claimed-ahead queue up in whole batches: while claims still wait in it
            # beyond one per handler thread, one more claim now would only queue behind them, so
            # wait until it has run down to the threads' own or a full batch fits. Claiming
            # whatever each finished handler freed made a statement per few deliveries (a no-op
            # drain's claims averaged 34 rows of 50), each with its commit and fixed server
            # cost (issue 31).
            return 0
        return max(free, 0)

    def _claim(
        self, hinted: list[tuple[uuid.UUID, Pair]], must_poll: bool, room: int, *, backlog_only: bool = False
    ) -> tuple[int, bool]:
        """Claim hinted ids one by one (a single hint, or batch size 1) unless ``must_poll``;
        otherwise poll for the oldest: the pairs of the hints; or (``must_poll``) every pair in
        turn, one statement each, starting after the pair the last poll ended at, or only the
        pairs whose last poll came back full and those of the hints (``backlog_only``, while
        there are some). Hands
        each claim to a handler thread as soon as it is won. Returns how many were claimed and
        whether a backlog likely remains (a poll came back full, or room ran out before every
        pair was polled)."""
        if hinted and not must_poll and (len(hinted) == 1 or self.batch_size == 1):
            won = 0
            for delivery_id, (community_id, target_pubkey) in hinted[:room]:
                if self.claims_busy and self._claims_wait(community_id):
                    continue  # its last claim waited for a lock; a round polls it once that is over
                try:
                    if not self._rate_units(community_id, 1):
                        continue  # its community waits for the next window; the round then polls it
                    claim = services.claim_delivery(
                        community_id,
                        target_pubkey,
                        delivery_id=delivery_id,
                        lease_seconds=self.lease_seconds,
                        holder=self.holder,
                    )
                    self._rate_unused(community_id, 1 if claim is None else 0)
                except DB_UNAVAILABLE as exc:
                    if not lock_wait_timed_out(exc):
                        raise
                    self._claim_waited(community_id)
                    continue
                if claim is not None:
                    self._start([claim], "hint")
                    won += 1
                    if self.hints_lost:  # (empty unless hint_stagger: no hashing of the pair per hint)
                        self.hints_lost.discard((community_id, target_pubkey))
                elif self.hint_stagger:
                    self._hint_lost((community_id, target_pubkey))
            self.tally.add("claim_statements", min(len(hinted), room))
            return won, len(hinted) > room
        every_pair = not (hinted and not must_poll) and not (backlog_only and self.backlogged)
        hints_only = bool(hinted) and not must_poll
        if hints_only:
            pairs = list(dict.fromkeys(pair for _, pair in hinted))
        elif not every_pair:  # any pair a hint named since, then the backlogged pairs
            pairs = list(dict.fromkeys([*(pair for _, pair in hinted), *self.backlogged]))
        else:
            pairs = [self.pairs[(self.next_pair + i) % len(self.pairs)] for i in range(len(self.pairs))]
        won, backlog, polled = 0, False, 0
        full: list[Pair] = []
        for community_id, target_pubkey in pairs:
            if won >= room or self.stop.is_set() or self.signalled:
                backlog = True  # pairs left unpolled (or stopping: no new claims)
                break
            if self.claims_busy and self._claims_wait(community_id):
                polled += 1  # its last claim waited for a lock (not a backlog: no busy loop)
                continue
            try:
                limit = self._rate_units(community_id, min(self.batch_size, room - won))
                if not limit:
                    polled += 1  # its community waits for the next window (not a backlog: no busy loop)
                    continue
                claims = services.claim_deliveries(
                    community_id, target_pubkey, limit=limit, lease_seconds=self.lease_seconds, holder=self.holder
                )
                self._rate_unused(community_id, limit - len(claims))
            except DB_UNAVAILABLE as exc:
                if not lock_wait_timed_out(exc):
                    raise
                self._claim_waited(community_id)
                polled += 1
                continue
            polled += 1
            self.tally.add("claim_statements")
            self._start(claims, "poll")
            won += len(claims)
            if hints_only:  # a claim of these hints' pair: did a sibling take them first?
                if claims:
                    self.hints_lost.discard((community_id, target_pubkey))
                elif self.hint_stagger:
                    self._hint_lost((community_id, target_pubkey))
            if claims and self.hint_stagger:
                self.polled_at[(community_id, target_pubkey)] = time.monotonic()
            if len(claims) == limit:
                backlog = True
                full.append((community_id, target_pubkey))
        if every_pair:
            self.next_pair = (self.next_pair + polled) % len(self.pairs)
        # Pairs not polled this time (room ran out) still count as backlogged, and go first next
        # time: a pair that keeps filling the room does not starve the others.
        self.backlogged = [pair for pair in pairs[polled:] if pair not in full] + full
        return won, backlog

    def _hint_lost(self, pair: Pair) -> None:
        """A hinted claim of ``pair`` came back empty: a sibling took the row, so hold the pair's
        hints (:attr:`hints_lost`), unless a poll of this worker claimed rows of it within the
        stagger (the row may be among them: a one-process worker is never held by its own polls)."""
        if time.monotonic() - self.polled_at.get(pair, -math.inf) > self.hint_stagger:
            self.hints_lost.add(pair)

    def _sift_held(self, hinted: list[tuple[uuid.UUID, Pair]], room: int) -> tuple[list[tuple[uuid.UUID, Pair]], int]:
        """Of hints drained while their pair is in :attr:`hints_lost` (the oldest at least
        ``hint_stagger`` old): claim one delivery of each such pair, its oldest claimable one (a
        poll of one row). Empty: nothing of that pair is claimable now (a sibling took every row
        the held hints name, or they are scheduled, or gone), so its held hints are dropped
        unclaimed, and dropping them delays nothing. Won: the pair leaves :attr:`hints_lost` and
        its other hints are kept. A pair not claimed (no room left, its community waiting for a
        lock or a rate window) keeps its hints: they are claimed as hints beyond the room are.
        Claiming the oldest held hint by its id instead dropped due deliveries behind one that
        was never claimable (a hint of a delivery committed with ``not_before``, or forged), and
        those a sibling left (dead or stalled after the oldest), until the next poll. Returns the
        hints left to claim (the other pairs' too) and the room left."""
        pairs = list(dict.fromkeys(pair for _, pair in hinted if pair in self.hints_lost))
        checked: set[Pair] = set()
        taken: set[uuid.UUID] = set()
        for pair in pairs:
            if room <= 0:
                break
            community_id, target_pubkey = pair
            if self.claims_busy and self._claims_wait(community_id):
                continue  # its last claim waited for a lock; a round polls it once that is over
            try:
                if not self._rate_units(community_id, 1):
                    continue  # its community waits for the next window; the round then polls it
                claims = services.claim_deliveries(
                    community_id, target_pubkey, limit=1, lease_seconds=self.lease_seconds, holder=self.holder
                )
                self._rate_unused(community_id, 1 - len(claims))
            except DB_UNAVAILABLE as exc:
                if not lock_wait_timed_out(exc):
                    raise
                self._claim_waited(community_id)
                continue
            self.tally.add("claim_statements")
            checked.add(pair)
            if claims:
                self._start(claims, "hint")
                room -= len(claims)
                taken.update(claim.lease.delivery_id for claim in claims)
                self.hints_lost.discard(pair)
                self.polled_at[pair] = time.monotonic()  # its hint, if not drained yet, lost to this claim
        kept = [
            (delivery_id, pair)
            for delivery_id, pair in hinted
            if pair not in checked or (pair not in self.hints_lost and delivery_id not in taken)
        ]
        dropped = sum(1 for _, pair in hinted if pair in checked and pair in self.hints_lost)
        if dropped:
            self.tally.add("hints_dropped", dropped)
        return kept, room

    def _claims_wait(self, community_id: uuid.UUID) -> bool:
        """Whether ``community_id`` is not claimed from now: its last claim waited past the lock
        bound, less than :attr:`claims_busy_retry` seconds ago."""
        until = self.claims_busy.get(community_id.int)
        if until is None:
            return False
        if until > time.monotonic():
            self._round_due_by(until)  # a round now (a hint's, the listener's) leaves it again
            return True
        del self.claims_busy[community_id.int]
        return False

    def _claim_waited(self, community_id: uuid.UUID) -> None:
        """A claim of ``community_id`` (or its rate-limit statement) waited past the lock bound
        (only in a worker serving several communities): PostgreSQL cancelled it, so it claimed
        nothing (the units a rate-limit take granted it stay spent for their window: giving them
        back would wait too). That community is left for :attr:`claims_busy_retry` seconds; the
        other pairs are claimed meanwhile."""
        self.rate_windows.pop(community_id, None)
        self._claims_busy(community_id)
        logger.warning(
            "claim_lock_wait community=%s: waited past %s ms for a lock (a lifecycle move of its "
            "community, or a long transaction); its claims wait %.2fs, the other pairs go on",
            community_id,
            self.claim_lock_wait_ms,
            self.claims_busy_retry,
        )

    def _claims_busy(self, community_id: uuid.UUID) -> None:
        """Leave ``community_id`` unclaimed for :attr:`claims_busy_retry` seconds, and have the
        dispatcher's next round due when that is over (as when a rate window ends): its pending
        deliveries were hinted already, and a round every ``poll_interval`` could leave them
        that much longer (a poll interval of minutes, with LISTEN hints). The worker is busy
        until then (``--idle-exit`` counts from its next try): a community whose rows stay
        locked longer than the idle limit no longer makes the worker exit with its work pending."""
        until = time.monotonic() + self.claims_busy_retry
        self.claims_busy[community_id.int] = until
        self._round_due_by(until)
        with self._lock:  # not idle (--idle-exit): that community may have work it could not claim
            self.last_busy = until

    def _round_due_by(self, instant: float) -> None:
        """Have the dispatcher's next round of every pair due at ``instant`` (monotonic) at the latest."""
        self.rate_resume = instant if self.rate_resume is None else min(self.rate_resume, instant)

    def _rate_units(self, community_id: uuid.UUID, want: int) -> int:
        """With a ``rate_key``: how many of ``want`` deliveries of ``community_id`` this claim may
        take, their units taken first (0: the window is used up; the community waits for the
        next one, and the dispatcher's next round is due then). Without one: ``want``. What the
        claim then leaves unused goes back to the window (:meth:`_rate_unused`), so idle polls
        spend nothing. A community whose write fence refuses the take (not active) is left for a
        poll interval, as the claim would find nothing there; a lost database stops the round
        like a claim's."""
        key = self.config.rate_key
        if key is None:
            return want
        if self.rate_paused.get(community_id, 0.0) > time.monotonic():
            return 0
        spec = ratelimits.rate_limit_of(key)
        try:
            outcome: ratelimits.TakeOutcome = ratelimits.take(community_id, key, 0)  # what is left
            for _ in range(2):  # again with what is left if a peer took some in between
                if not isinstance(outcome, ratelimits.Granted) or outcome.used >= spec.limit:
                    break
                units = min(want, spec.limit - outcome.used)
                taken = ratelimits.take(community_id, key, units)
                if isinstance(taken, ratelimits.Granted):
                    self.rate_windows[community_id] = taken.window_start
                    return units
                outcome = taken
        except DB_UNAVAILABLE:
            raise
        except DatabaseError as exc:  # the write fence: the community is not active
            logger.info("rate_take_refused community=%s error=%s", community_id, exc)
            self._rate_pause(community_id, self.config.poll_interval)
            return 0
        if isinstance(outcome, ratelimits.Wait):
            seconds = outcome.seconds
        else:  # the window is exactly used up: until it ends (a period at most, as a Wait's)
            seconds = ratelimits.seconds_left(spec, outcome.window_start, outcome.at)
        self._rate_pause(community_id, seconds)
        self.tally.add("rate_waits")
        return 0

    def _rate_pause(self, community_id: uuid.UUID, seconds: float) -> None:
        resume = time.monotonic() + seconds
        self.rate_paused[community_id] = resume
        self.rate_resume = resume if self.rate_resume is None else min(self.rate_resume, resume)

    def _rate_unused(self, community_id: uuid.UUID, units: int) -> None:
        """Give back the units a claim took and did not use (a failure only logs: the units
        are then lost for this window, never granted twice)."""
        window = self.rate_windows.pop(community_id, None)
        if self.config.rate_key is None or units <= 0 or window is None:
            return
        try:
            ratelimits.give_back(community_id, self.config.rate_key, units, window)
        except DB_UNAVAILABLE as exc:
            if not lock_wait_timed_out(exc):
                raise
            # Its community's rows got locked since the claim (which stands): the units stay
            # spent for this window, and its next claims wait as after a claim that waited.
            logger.info("rate_give_back_lock_wait community=%s units=%d: left spent", community_id, units)
            self._claims_busy(community_id)
        except DatabaseError as exc:
            logger.info("rate_give_back_refused community=%s error=%s", community_id, exc)

    def _start(self, claims: list[Claim], via: str) -> None:
        if not claims:
            return
        claimed_at = time.monotonic()
        hung = self.renewer.timed_out_delivery_ids()
        again: list[Claim] = []
        if hung:  # (none, almost always: then no lookup per claim)
            again = [c for c in claims if c.lease.delivery_id in hung]
            claims = [c for c in claims if c.lease.delivery_id not in hung]
        with self._lock:
            self.in_flight += len(claims)
            self.handling += len(claims)
            self.claimed += len(claims) + len(again)
            self.last_busy = time.monotonic()
            self.undecided.update((c.lease.delivery_id.int, c.lease.lease_generation) for c in claims)
        for claim in again:
            # Never run a delivery twice at once in one process: its earlier handler still hangs here.
            self.tally.add("claimed")
            self._retry_now(claim.lease, "handler_timeout: an earlier attempt still runs in this worker")
        if self.is_async and claims:
            self._load_snapshots(claims)
        if logger.isEnabledFor(logging.DEBUG):
            for claim in claims:
                lease = claim.lease
                logger.debug(
                    "claimed delivery=%s generation=%d attempt=%d lease_until=%s",
                    lease.delivery_id,
                    lease.lease_generation,
                    claim.delivery.attempt,
                    lease.lease_until.isoformat(),
                )
        # Every lease is held (renewed) before its claim reaches a handler: one lock for the batch.
        self.renewer.hold_many([claim.lease for claim in claims])
        if self.loop is None:
            put = self.work.put
            for claim in claims:
                put((claim, claimed_at))
        else:  # the loop: one wake-up (a write to its self-pipe) per batch, not one per claim
            self.loop.call_soon_threadsafe(self._spawn, [(claim, claimed_at) for claim in claims])
        self.tally.add("claimed", len(claims))
        logger.info("claimed n=%d via=%s", len(claims), via)

    def _load_snapshots(self, claims: list[Claim]) -> None:
        """An async handler cannot load a deferred field on first access (Django refuses the ORM
        on the loop): load the claims' snapshots here, one statement per community. On an error
        they stay deferred (a handler that reads them fails that delivery's attempt: a retry)."""
        by_community: dict[uuid.UUID, list[Any]] = {}
        for claim in claims:
            by_community.setdefault(claim.lease.community_id, []).append(claim.delivery)
        for community_id, deliveries in by_community.items():
            try:
                services.load_snapshots(community_id, deliveries)
            except Exception as exc:
                logger.warning("snapshot_load_error community=%s n=%d: %s", community_id, len(deliveries), exc)
                close_old_connections()

    def _deadline(self, claim: Claim, claimed_at: float, started: float) -> float | None:
        """Monotonic time after which this claim's handler is past its deadline: the worker's
        ``handler_timeout`` from the handler's start (``started``), and never past the
        delivery's ``expires_at`` (measured from the claim, ``claimed_at``, on the database
        clock, so no clock of this host is compared with the server's)."""
        timeout = self.config.handler_timeout
        deadline = None if timeout is None else started + timeout
        delivery = claim.delivery
        expires_at = delivery.expires_at
        if expires_at is not None and delivery.claimed_at is not None:
            expiry = claimed_at + max((expires_at - delivery.claimed_at).total_seconds(), 0.0)
            deadline = expiry if deadline is None else min(deadline, expiry)
        return deadline

    def _working(self) -> int:
        """Handlers in flight that are not past their deadline."""
        with self._lock:
            in_flight = self.in_flight
        return in_flight - self.renewer.timed_out_count()

    def _finished_quota(self) -> bool:
        m = self.config.max_deliveries
        with self._lock:
            claimed = self.claimed
        return m is not None and claimed >= m and self._working() <= 0

    def _idle_too_long(self) -> bool:
        limit = self.config.idle_exit
        with self._lock:
            last_busy = self.last_busy
        if self.claims_busy:  # busy until a community left after a lock wait is tried again, whatever
            # settled meanwhile (a settle of another community sets ``last_busy`` to an earlier instant)
            last_busy = max(last_busy, *self.claims_busy.values())
        return limit is not None and self._working() <= 0 and time.monotonic() - last_busy >= limit

    def dispatch(self) -> str:
        """Claim until stopped, the quota is done or idle too long; returns why it stopped.

        Polls right away while the last poll came back full (a backlog: hints are then
        redundant and dropped; with several pairs, only the pairs that came back full are polled
        again until the next full round), else every pair every ``poll_interval``; a hint wakes
        it in between."""
        backlog, next_poll, next_thread_check = True, 0.0, 0.0
        held_until: float | None = None  # when a hint held back (hints_lost) is due
        with self._lock:
            # Idle from now, not from __init__: starting the threads and the listener can take
            # longer than ``idle_exit`` on a loaded machine, which exited before the first poll.
            self.last_busy = time.monotonic()
        while not (self.stop.is_set() or self.signalled):
            self.wake.clear()
            # Never go on claiming (nor exit 0) for threads that are gone. A thread that ends
            # says so (thread_ended) and is looked for at once; the liveness of every thread is
            # also checked every SIGNAL_CHECK_SECONDS (a settler, or a thread that died past
            # its own finally), not on every round: a round runs once per few deliveries, and
            # asking each of 16 threads is_alive() was ~14% of the dispatcher's CPU (issue 31).
            now = time.monotonic()
            if self.thread_ended or now >= next_thread_check:
                next_thread_check = now + SIGNAL_CHECK_SECONDS
                dead = self._dead_thread()
                if dead is not None:
                    logger.error("%s: stopping the worker", dead)
                    self._fail(dead)
                    break
            if self._finished_quota():
                return "max_deliveries"
            if held_until is None and self._idle_too_long():  # a held hint's delivery is work to do
                return "idle_exit"
            if self.renewer.timed_out_count() >= self.config.concurrency:
                logger.error(
                    "handlers_hung: all %d handler threads are past their deadline; stopping",
                    self.config.concurrency,
                )
                return HANDLERS_HUNG
            room = self._room()
            held_until = None
            hinted: list[tuple[uuid.UUID, Pair]]
            if not room:
                hinted, poll_asked = [], False
            elif self.hints_lost:
                hinted, poll_asked, held_until = self.inbox.drain_due(
                    self.hints_lost, self.hint_stagger, time.monotonic()
                )
            else:
                hinted, poll_asked = self.inbox.drain()
            round_due = poll_asked or time.monotonic() >= next_poll
            poll_due = backlog or round_due
            if poll_due and held_until is not None:  # a poll now: it takes the held hints along
                more, _ = self.inbox.drain()
                hinted, held_until = hinted + more, None
            if room and (hinted or poll_due):
                try:
                    with lock_waits_bounded(self.claim_lock_wait_ms):
                        if self.hints_lost and not poll_due and hinted:
                            hinted, room = self._sift_held(hinted, room)
                        if hinted or poll_due:
                            _, backlog = self._claim(hinted, poll_due, room, backlog_only=not round_due)
                except DB_UNAVAILABLE as exc:
                    logger.warning("db_unavailable role=claim error=%s", exc)
                    close_old_connections()
                    backlog = True
                    self.backlogged = list(self.pairs)  # the hints drained for this poll are gone
                    self.stop.wait(min(self.config.poll_interval, SIGNAL_CHECK_SECONDS))
                    continue
                if round_due:  # a round of every pair: the next one is due in poll_interval
                    next_poll = time.monotonic() + self.config.poll_interval
                if self.rate_resume is not None:  # a community's claim window (or claim wait) ends sooner
                    next_poll, self.rate_resume = min(next_poll, self.rate_resume), None
                if backlog:
                    continue
            timeout = max(next_poll - time.monotonic(), 0.0) if room else self.config.poll_interval
            if held_until is not None:
                timeout = min(timeout, max(held_until - time.monotonic(), 0.0))
            if self.config.idle_exit is not None:
                timeout = min(timeout, self.config.idle_exit)
            self.wake.wait(min(timeout, SIGNAL_CHECK_SECONDS))
        return self.signal_name if self.signalled else "stopped"

    def _dead_thread(self, *, settler: bool = True) -> str | None:
        """Why to stop when a thread the worker needs died (never expected: each one catches
        what its work raises), else None. ``settler``: judge the settler too (not once the
        drain has closed it)."""
        with self._lock:
            exited = set(self.exited)
        if any(not thread.is_alive() and thread.ident not in exited for thread in self.threads):
            return "handler_thread_died"
        if settler and self.settler.ident is not None and not self.settler.is_alive():
            return "settler_died"
        return None

    def drain(self, threads: list[threading.Thread]) -> int:
        """Wait up to ``shutdown_grace`` seconds for in-flight handlers to finish and settle
        (handlers already past their deadline are not waited for). Returns how many in-flight
        leases were given up (0 when everything settled)."""
        for _ in threads:
            self._submit(None)
        give_up_at = time.monotonic() + self.config.shutdown_grace
        while True:
            with self._lock:
                in_flight = self.in_flight
            if in_flight == 0:
                for thread in threads:
                    thread.join()
                self.settler.close()
                self.settler.join()
                return 0
            if self._working() <= 0 or self.give_up or time.monotonic() >= give_up_at:
                break
            dead = self._dead_thread()
            if dead is not None:
                self._fail(dead)  # reported whatever stopped the dispatcher (a signal, a quota)
                break  # what a dead thread held never settles: give up now
            self.wake.wait(SIGNAL_CHECK_SECONDS)
            self.wake.clear()
        with self._lock:
            self.gave_up = True
            abandoned = len(self.undecided)
        logger.error(
            "shutdown_gave_up abandoned=%d: their leases are no longer renewed and lapse; the reaper returns them",
            abandoned,
        )
        self.tally.add("abandoned", abandoned)
        # Settles already under way finish (each retries for at most one lease length).
        settles_done_by = time.monotonic() + self.lease_seconds + 5
        while time.monotonic() < settles_done_by and self._dead_thread() is None:
            with self._lock:
                if self.in_flight <= len(self.undecided):
                    break
            time.sleep(0.05)
        self.settler.close()  # a daemon thread: a settle still stuck past that is not waited for
        return abandoned

    def run(self, conn_params: dict[str, Any]) -> WorkerSummary:
        """Run until stopped; drain in-flight work; return the :class:`WorkerSummary`."""
        c = self.config
        listener = HintListener(
            channel=get_settings().notify_channel,
            pairs=self.pairs,
            inbox=self.inbox,
            conn_params=conn_params,
            stop=self.stop,
            retry_seconds=c.poll_interval,
        )
        if self.is_async:
            threads = self.threads = [
                threading.Thread(target=self._loop_thread, name="buzz-delivery-loop", daemon=True)
            ]
        else:
            threads = self.threads = [
                threading.Thread(target=self._handler_thread, name=f"buzz-delivery-handler-{i}", daemon=True)
                for i in range(c.concurrency)
            ]
        logger.info(
            "started community=%s target=%s%s handler=%s%s concurrency=%d batch_size=%d lease_seconds=%g pid=%d",
            c.community_id,
            c.target_pubkey.hex(),
            f" pairs={len(self.pairs)}" if len(self.pairs) > 1 else "",
            _handler_name(c.handler),
            " (async)" if self.is_async else "",
            c.concurrency,
            self.batch_size,
            self.lease_seconds,
            os.getpid(),
        )
        self.renewer.start()
        self.settler.start()
        listener.start()
        for thread in threads:
            thread.start()
        if self.is_async and not self.loop_ready.wait(30):
            self._fail("worker_error")  # its thread logged why
        reason = "error"
        try:
            reason = self.dispatch()
            dead = self._dead_thread()  # a signal may have ended the dispatch first: it does not hide this
            if dead is not None:
                self._fail(dead)
        finally:
            self.stop.set()
            with self._lock:
                in_flight = self.in_flight
            logger.info("stopping reason=%s in_flight=%d", self.error_reason or reason, in_flight)
            self.drain(threads)
            dead = self._dead_thread(settler=False)  # a handler thread that died while draining
            if dead is not None:
                self._fail(dead)
            self.renewer.shutdown()
            listener.join()
        # An internal error wins over how the dispatcher stopped, even one raised while draining.
        summary = WorkerSummary(self.tally.summary(), self.error_reason or reason, self._pending_retry())
        log = logger.info if summary.exit_code == EXIT_OK else logger.error
        log(
            "stopped reason=%s exit_code=%d %s pending_retry=%d",
            summary.reason,
            summary.exit_code,
            " ".join(f"{k}={n}" for k, n in summary.items()),
            summary.pending_retry,
        )
        if summary.pending_retry:
            logger.info(
                "%d deliveries are pending a retry (waiting out their backoff); the next worker claims them",
                summary.pending_retry,
            )
        return summary

    def _pending_retry(self) -> int:
        """Deliveries of this worker's pairs waiting out a retry backoff (0 if unknown)."""
        try:
            return sum(services.count_pending_retry(community_id, target) for community_id, target in self.pairs)
        except DB_UNAVAILABLE as exc:
            logger.warning("db_unavailable role=summary error=%s", exc)
            close_old_connections()
            return 0


def _left_open_args(lease: Any, left_open: str) -> SettleArgs:
    """What to settle for a delivery whose handler left a transaction open (``left_open`` says
    what): failed, :data:`TRANSACTION_LEFT_OPEN` (its connection was discarded, nothing it wrote
    there is kept)."""
    logger.warning(
        "handler_error delivery=%s generation=%d outcome=failed error=%s: %s",
        lease.delivery_id,
        lease.lease_generation,
        TRANSACTION_LEFT_OPEN,
        left_open,
    )
    return SettleArgs(
        "failed",
        TRANSACTION_LEFT_OPEN,
        f"the handler left its database connection with {left_open}; nothing it wrote there is kept",
    )


def is_async_handler(handler: Handler) -> bool:
    """Whether ``handler`` is an ``async def`` function (or an object with an async ``__call__``)."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(type(handler).__call__)


def _handler_name(handler: Handler) -> str:
    """``module:qualname`` of a function; of a callable object (``run_task_worker``'s
    ``TaskRunner``), its class's, not its repr with a memory address."""
    name = getattr(handler, "__qualname__", None) or f"{type(handler).__qualname__} instance"
    return f"{getattr(handler, '__module__', '?')}:{name}"


_heap_frozen = False


def freeze_startup_heap() -> None:
    """Move what this process holds before its first worker runs (Django's apps, models,
    settings, imported modules: ~100,000 objects) out of the cyclic garbage collector's scans,
    once per process (``gc.freeze``). Every delivery allocates a few dozen container objects
    that live across thread hand-offs, so the collector runs about once every 400 deliveries
    and each older-generation pass walked that whole heap: 3-12 us of client CPU per delivery
    (bench/results/worker-client-cpu.md). Frozen objects are still freed by reference counting;
    only a reference cycle among them is never collected (what was garbage is collected first)."""
    global _heap_frozen
    if _heap_frozen:
        return
    _heap_frozen = True
    gc.collect()
    gc.freeze()


def run_worker(
    config: WorkerConfig, *, stop: threading.Event | None = None, handle_signals: bool = True
) -> WorkerSummary:
    """Run the agent side for one community and target, or several pairs
    (``config.extra_pairs``), until stopped (SPEC section 7).

    Claims the oldest claimable deliveries (or a hinted one), calls ``config.handler(delivery)``
    in a handler thread, renews each lease every ``renew_fraction`` of its length, and settles:
    return -> ``finished``; :class:`~buzz_delivery.worker.PermanentFailure` (or an exception
    class with ``permanent = True``) -> ``failed``; any other exception -> ``retry``. A lost
    lease drops the result. Database errors are logged (``db_unavailable``) and the broken
    connection is closed; the worker carries on.

    Stops when ``stop`` is set, on SIGTERM/SIGINT (``handle_signals``, main thread only), after
    ``max_deliveries`` or ``idle_exit``: no new claims, in-flight handlers finish and settle
    within ``shutdown_grace`` seconds, else their leases are given up (a second signal gives up
    at once). Nothing about one delivery stops it: handler text is made storable, a handler's
    ``BaseException`` fails that delivery (its class name as the code), a transaction the
    handler leaves open is rolled back and fails it (``transaction_left_open``; see
    :mod:`buzz_delivery.usercode`), a settle that raises leaves that lease to lapse. A handler
    or settler thread that dies all the same stops the worker (exit 1). A handler past its
    deadline (``handler_timeout``, ``expires_at``) is no longer renewed. Returns a :class:`WorkerSummary`: the counts of
    :data:`SUMMARY_KEYS`, ``reason`` and ``exit_code``. Raises ``ValidationError`` for a bad
    ``lease_seconds``; :class:`WorkerInTransaction` inside ``transaction.atomic()``.
    """
    if connection.in_atomic_block:
        raise WorkerInTransaction("run_worker must not run inside transaction.atomic()")
    stop = stop or threading.Event()
    worker = Worker(config, stop)
    previous: dict[int, Any] = {}
    if handle_signals and threading.current_thread() is threading.main_thread():

        def on_signal(signum: int, frame: Any) -> None:
            # Only set plain attributes: Event.set() takes a lock that the interrupted main thread
            # may hold inside Event.wait(), which would deadlock. The dispatcher polls the flag.
            if worker.signalled:
                worker.give_up = True  # a second signal: give up in-flight leases now
                return
            worker.signal_name = signal.Signals(signum).name
            worker.signalled = True

        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, on_signal)
    listen_alias = get_settings().listen_database or connection.alias
    try:
        freeze_startup_heap()  # after the signal handlers: a SIGTERM meanwhile stops it cleanly
        return worker.run(connections[listen_alias].get_connection_params())
    finally:
        for restored, previous_handler in previous.items():
            signal.signal(restored, previous_handler)
