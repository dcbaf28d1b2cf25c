"""The agent runtime (SPEC section 7): claim, run the handler, renew in the background, settle.

Threads: the caller's thread dispatches (claims), ``concurrency`` handler threads run the handler
and settle, one renewer thread renews held leases, one listener thread LISTENs for wake hints.
Every service call is its own autocommit statement: no transaction is open while a handler runs.
Each thread the runtime starts uses its own Django connection and closes it when it exits.
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from django.db import close_old_connections, connection, connections
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from buzz_delivery import services
from buzz_delivery.conf import get_settings
from buzz_delivery.exceptions import BuzzDeliveryError
from buzz_delivery.services import AlreadyTerminal, Claim, LeaseLost
from buzz_delivery.services import validation as v
from buzz_delivery.worker.handlers import FINISHED, Handler, SettleArgs, settle_args_for
from buzz_delivery.worker.listener import HintInbox, HintListener
from buzz_delivery.worker.renewer import DB_UNAVAILABLE, LeaseRenewer

logger = logging.getLogger("buzz_delivery.worker")

# Longest the dispatcher sleeps before it looks at the signal flag again.
SIGNAL_CHECK_SECONDS = 0.2
SUMMARY_KEYS = ("claimed", "finished", "failed", "retried", "lease_lost", "renewed")


class WorkerInTransaction(BuzzDeliveryError):
    """``run_worker`` was called inside ``transaction.atomic()``: claims would hold row locks
    until the caller commits. Call it in autocommit mode."""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Options of one worker (see ``run_delivery_worker --help``).

    ``community_id``/``target_pubkey`` (32 bytes): whose deliveries to claim. ``handler``: see
    :mod:`buzz_delivery.worker.handlers`. ``concurrency``: handler threads (1..256).
    ``lease_seconds``: None = ``LEASE_SECONDS``. ``batch_size``: most claims per round trip
    (1..1000; None = ``concurrency``; never more than the free handler threads).
    ``poll_interval``: seconds between polls when idle. ``max_deliveries``: stop after claiming
    and settling that many. ``idle_exit``: stop after that many seconds with nothing to do.
    ``renew_fraction``: renew each lease after this fraction of its length (0 < f < 1).
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


class Tally:
    """Thread-safe counters of the summary line."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def summary(self) -> dict[str, int]:
        """``{"claimed", "finished", "failed", "retried", "lease_lost", "renewed"}`` -> counts."""
        with self._lock:
            return {key: self._counts[key] for key in SUMMARY_KEYS}


def summary_line(summary: dict[str, int]) -> str:
    """The one JSON line the command prints at exit."""
    return json.dumps(summary, separators=(",", ":"))


class Worker:
    """One run of the agent runtime; use :func:`run_worker`."""

    def __init__(self, config: WorkerConfig, stop: threading.Event) -> None:
        self.config = config
        self.lease_seconds = v.lease_seconds(config.lease_seconds)
        self.batch_size = config.batch_size or config.concurrency
        self.stop = stop
        self.wake = threading.Event()
        self.tally = Tally()
        self.inbox = HintInbox(self.wake)
        self.renewer = LeaseRenewer(
            lease_seconds=self.lease_seconds,
            every=self.lease_seconds * config.renew_fraction,
            on_renewed=lambda: self.tally.add("renewed"),
        )
        self.work: queue.SimpleQueue[Claim | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.in_flight = 0
        self.claimed = 0
        self.last_busy = time.monotonic()
        self.stop_reason = "stopped"
        self.signalled = False  # set by the signal handler (see run_worker)

    # --- handler threads -------------------------------------------------------------------

    def _settle(self, claim: Claim, args: SettleArgs) -> None:
        lease = claim.lease
        retrying = Retrying(
            retry=retry_if_exception_type(DB_UNAVAILABLE),
            stop=stop_after_delay(self.lease_seconds),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            before_sleep=_reconnect("settle"),
            reraise=True,
        )
        try:
            outcome = retrying(
                services.finish_delivery,
                lease,
                args.outcome,
                failure_code=args.failure_code,
                failure_message=args.failure_message,
            )
        except DB_UNAVAILABLE as exc:
            logger.error("db_unavailable role=settle delivery=%s gave up: %s", lease.delivery_id, exc)
            return
        ids = f"delivery={lease.delivery_id} generation={lease.lease_generation}"
        if isinstance(outcome, LeaseLost):
            logger.warning("lease_lost %s during=settle outcome=%s result dropped", ids, args.outcome)
            self.tally.add("lease_lost")
            return
        status = outcome.status
        again = " (already settled)" if isinstance(outcome, AlreadyTerminal) else ""
        logger.info("settled %s outcome=%s status=%s%s", ids, args.outcome, status, again)
        self.tally.add({"finished": "finished", "failed": "failed", "pending": "retried"}.get(status, status))

    def _handle(self, claim: Claim) -> None:
        lease = claim.lease
        if connection.in_atomic_block:  # never a transaction around a handler
            raise WorkerInTransaction("a handler thread is inside transaction.atomic()")
        try:
            self.config.handler(claim.delivery)
            args = FINISHED
        except Exception as exc:
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
                type(exc).__name__,
                exc,
                exc_info=args.outcome == "retry",
            )
        except BaseException as exc:
            # SystemExit, KeyboardInterrupt, CancelledError...: settle as a retry so the delivery
            # is not left claimed and renewed but never handled, then stop the whole worker.
            args = SettleArgs("retry", None, f"{type(exc).__name__}: {exc}"[:10_000])
            logger.error(
                "handler_error delivery=%s generation=%d outcome=retry error=%s: stopping the worker",
                lease.delivery_id,
                lease.lease_generation,
                type(exc).__name__,
            )
            self.stop_reason = f"handler raised {type(exc).__name__}"
            self.stop.set()
            self.wake.set()
        finally:
            self.renewer.release(lease.delivery_id)
        self._settle(claim, args)

    def _handler_thread(self) -> None:
        try:
            while (claim := self.work.get()) is not None:
                try:
                    self._handle(claim)
                except BaseException:
                    # Never let a handler thread die silently: claims would pile up unhandled.
                    logger.exception("worker_error delivery=%s: settle step raised", claim.lease.delivery_id)
                    self.stop_reason = "worker_error"
                    self.stop.set()
                    self.wake.set()
                finally:
                    with self._lock:
                        self.in_flight -= 1
                        self.last_busy = time.monotonic()
                    self.wake.set()
        finally:
            connections.close_all()

    # --- dispatcher (the caller's thread) ------------------------------------------------------

    def _room(self) -> int:
        with self._lock:
            free = self.config.concurrency - self.in_flight
        if self.config.max_deliveries is not None:
            free = min(free, self.config.max_deliveries - self.claimed)
        return max(free, 0)

    def _claim(self, hinted: list[uuid.UUID], must_poll: bool, room: int) -> tuple[int, bool]:
        """Claim hinted ids one by one (a single hint, or batch size 1) unless ``must_poll``;
        otherwise poll for the oldest. Hands each claim to a handler thread as soon as it is won.
        Returns how many were claimed and whether a backlog likely remains."""
        c = self.config
        if hinted and not must_poll and (len(hinted) == 1 or self.batch_size == 1):
            won = 0
            for delivery_id in hinted[:room]:
                claim = services.claim_delivery(
                    c.community_id, c.target_pubkey, delivery_id=delivery_id, lease_seconds=self.lease_seconds
                )
                if claim is not None:
                    self._start([claim])
                    won += 1
            return won, len(hinted) > room
        limit = min(self.batch_size, room)
        claims = services.claim_deliveries(
            c.community_id, c.target_pubkey, limit=limit, lease_seconds=self.lease_seconds
        )
        self._start(claims)
        return len(claims), len(claims) == limit

    def _start(self, claims: list[Claim]) -> None:
        if not claims:
            return
        with self._lock:
            self.in_flight += len(claims)
            self.claimed += len(claims)
            self.last_busy = time.monotonic()
        for claim in claims:
            lease = claim.lease
            logger.info(
                "claimed delivery=%s generation=%d attempt=%d lease_until=%s",
                lease.delivery_id,
                lease.lease_generation,
                claim.delivery.attempt,
                lease.lease_until.isoformat(),
            )
            self.tally.add("claimed")
            self.renewer.hold(lease)
            self.work.put(claim)

    def _finished_quota(self) -> bool:
        m = self.config.max_deliveries
        with self._lock:
            return m is not None and self.claimed >= m and self.in_flight == 0

    def _idle_too_long(self) -> bool:
        limit = self.config.idle_exit
        with self._lock:
            return limit is not None and self.in_flight == 0 and time.monotonic() - self.last_busy >= limit

    def dispatch(self) -> str:
        """Claim until stopped, the quota is done or idle too long; returns why it stopped.

        Polls right away while the last poll came back full (a backlog: hints are then
        redundant and dropped), else every ``poll_interval``; a hint wakes it in between."""
        backlog, next_poll = True, 0.0
        while not (self.stop.is_set() or self.signalled):
            self.wake.clear()
            if self._finished_quota():
                return "max_deliveries"
            if self._idle_too_long():
                return "idle_exit"
            room = self._room()
            hinted, poll_asked = self.inbox.drain() if room else ([], False)
            poll_due = backlog or poll_asked or time.monotonic() >= next_poll
            if room and (hinted or poll_due):
                try:
                    _, backlog = self._claim(hinted, poll_due, room)
                except DB_UNAVAILABLE as exc:
                    logger.warning("db_unavailable role=claim error=%s", exc)
                    close_old_connections()
                    backlog = True
                    self.stop.wait(min(self.config.poll_interval, SIGNAL_CHECK_SECONDS))
                    continue
                if poll_due:
                    next_poll = time.monotonic() + self.config.poll_interval
                if backlog:
                    continue
            timeout = max(next_poll - time.monotonic(), 0.0) if room else self.config.poll_interval
            if self.config.idle_exit is not None:
                timeout = min(timeout, self.config.idle_exit)
            self.wake.wait(min(timeout, SIGNAL_CHECK_SECONDS))
        return self.stop_reason

    def run(self, conn_params: dict[str, Any]) -> dict[str, int]:
        """Run until stopped; drain in-flight work; return the summary counts."""
        c = self.config
        listener = HintListener(
            channel=get_settings().notify_channel,
            community_id=c.community_id,
            target_pubkey=c.target_pubkey,
            inbox=self.inbox,
            conn_params=conn_params,
            stop=self.stop,
            retry_seconds=c.poll_interval,
        )
        threads = [
            threading.Thread(target=self._handler_thread, name=f"buzz-delivery-handler-{i}", daemon=True)
            for i in range(c.concurrency)
        ]
        self.renewer.start()
        listener.start()
        for thread in threads:
            thread.start()
        reason = "error"
        try:
            reason = self.dispatch()
        finally:
            self.stop.set()
            with self._lock:
                in_flight = self.in_flight
            logger.info("stopping reason=%s in_flight=%d", reason, in_flight)
            for _ in threads:
                self.work.put(None)
            for thread in threads:
                thread.join()
            self.renewer.shutdown()
            listener.join()
        summary = self.tally.summary()
        logger.info("stopped %s", " ".join(f"{k}={n}" for k, n in summary.items()))
        return summary


def _reconnect(role: str) -> Any:
    def before_sleep(state: Any) -> None:
        logger.warning(
            "db_unavailable role=%s attempt=%d error=%s", role, state.attempt_number, state.outcome.exception()
        )
        close_old_connections()

    return before_sleep


def run_worker(
    config: WorkerConfig, *, stop: threading.Event | None = None, handle_signals: bool = True
) -> dict[str, int]:
    """Run the agent side for one community and target until stopped (SPEC section 7).

    Claims the oldest claimable deliveries (or a hinted one), calls ``config.handler(delivery)``
    in a handler thread, renews each lease every ``renew_fraction`` of its length, and settles:
    return -> ``finished``; :class:`~buzz_delivery.worker.PermanentFailure` (or an exception
    class with ``permanent = True``) -> ``failed``; any other exception -> ``retry``. A lost
    lease drops the result. Database errors are logged (``db_unavailable``) and the broken
    connection is closed; the worker carries on.

    Stops when ``stop`` is set, on SIGTERM/SIGINT (``handle_signals``, main thread only), after
    ``max_deliveries`` or ``idle_exit``: no new claims, in-flight handlers finish and settle.
    Returns the summary counts ``{"claimed", "finished", "failed", "retried", "lease_lost",
    "renewed"}``. Raises ``ValidationError`` for a bad ``lease_seconds``;
    :class:`WorkerInTransaction` inside ``transaction.atomic()``.
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
            worker.stop_reason = signal.Signals(signum).name
            worker.signalled = True

        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, on_signal)
    try:
        return worker.run(connection.get_connection_params())
    finally:
        for restored, previous_handler in previous.items():
            signal.signal(restored, previous_handler)
