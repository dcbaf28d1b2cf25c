"""Batched settles (SPEC sections 4.5 and 7): one thread turns handler results into settle
statements, many results (finished, failed or retried) per statement (issue 29).

Handler threads put a :class:`SettleJob` (a lease and its :class:`SettleArgs`) on the queue and
move on to their next claim. The settler takes whatever is queued, waiting up to ``linger``
seconds for more while fewer than ``max_batch`` are there, then settles the batch:

- every result of one community (whatever its target and outcome: ``finished``, ``failed``,
  ``retry`` with its own failure text and Retry-After) through one
  :func:`services.settle_deliveries` statement (one ``UPDATE ... FROM unnest`` in the
  plan-cached ``SETTLE_MANY`` function; an all-``finished`` batch takes the ``FINISH_MANY``
  one), each row still fenced by its own (delivery, target, generation) and written as
  ``finish_delivery`` writes it, and each outcome judged by the rows the statement returned (a
  lease it did not settle is passed to ``finish_delivery``, whose fenced read tells
  ``AlreadyTerminal``, a repeated retry and ``LeaseLost`` apart, as a single settle would). A
  workflow send's delivery counts its step in that statement (the fan-in trigger), so in the
  settling transaction;
- a lone result of its community, or a second lease of a delivery already in the batch, one
  ``finish_delivery`` statement.

A batch statement that the database refuses for a reason other than a lost connection is
replayed one lease at a time, so that nothing about one delivery keeps the others of its batch
from settling; a single settle that raises leaves that lease to lapse (``settle_errors``). A
lost connection is retried (reconnecting) for up to one lease length. The thread uses its own
Django connection and closes it when it stops.

One thread settles every community the worker serves, so a settle waits for a lock at most
:func:`~buzz_delivery.worker.renewer.lock_wait_ms` (``lock_timeout``). A settle that waited
longer (a lifecycle move of its community waiting behind a long transaction of that community's
own code, say) was cancelled and changed nothing. A batch that waited is settled one lease at a
time (one held row of a community does not hold up its other results) until one of those
waits: it, and that community's later results, are kept (the one that waited last, so that the
next try settles the others first) and settled again, with the same leases (so the same
fencing: a result is applied once or judged ``LeaseLost``, never twice), after
:func:`~buzz_delivery.worker.renewer.busy_retry_seconds`; the other communities' results settle
meanwhile. A lease is not renewed while its result waits: it lapses if its community stays
locked longer than the lease has left, and the settle is then ``LeaseLost``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import close_old_connections, connections
from tenacity import RetryCallState, Retrying, retry_if_exception, wait_exponential

from buzz_delivery import services
from buzz_delivery.services import AlreadyTerminal, Lease, LeaseLost, Settled
from buzz_delivery.services.db import lock_wait_timed_out, lock_waits_bounded
from buzz_delivery.services.types import FinishOutcome, Settle
from buzz_delivery.worker.handlers import SettleArgs
from buzz_delivery.worker.renewer import DB_UNAVAILABLE, busy_retry_seconds, lock_wait_ms

logger = logging.getLogger("buzz_delivery.worker")

# A settle that lost its connection is tried again after RETRY_FIRST_WAIT seconds, each wait
# twice the last, at most RETRY_MOST_WAIT, until one lease length has passed since its first try.
RETRY_FIRST_WAIT = 0.2
RETRY_MOST_WAIT = 2.0

# Summary key of each recorded status (``pending`` = a retry back in the queue).
SETTLED_KEYS = {"finished": "finished", "failed": "failed", "pending": "retried"}


T = TypeVar("T")


def next_batch(
    source: queue.Queue[T | None], max_batch: int, linger: float, wait: float | None = None
) -> tuple[list[T], bool]:
    """Block for one item of ``source`` (for ``wait`` seconds at most when given: none came,
    ``([], False)``), then gather more (up to ``max_batch``, for ``linger`` seconds at most).
    ``None`` in the queue is the close marker. Returns (items, whether the close marker was
    seen).

    ``source`` is a :class:`queue.Queue`, not a ``SimpleQueue``: CPython 3.11's timed
    ``SimpleQueue.get`` can wait with no timeout at all (until the next put) when its thread was
    preempted past what was left of the wait (test_worker_settler_linger); ``Queue.get`` waits
    on a condition with its own deadline. What is already queued is taken under one lock
    (:func:`_take_queued`), not one ``get`` a result: a ``Queue.get`` is a few Python calls."""
    try:
        first = source.get() if wait is None else source.get(timeout=wait)
    except queue.Empty:
        return [], False
    if first is None:
        return [], True
    items = [first]
    until = time.monotonic() + linger
    while len(items) < max_batch:
        took, closed = _take_queued(source, items, max_batch)
        if closed:
            return items, True
        if took:
            continue  # room left: take what came meanwhile, else wait below
        left = until - time.monotonic()
        if left <= 0:
            break
        try:
            item = source.get(timeout=left)
        except queue.Empty:
            break
        if item is None:
            return items, True
        items.append(item)
    return items, False


def _take_queued(source: queue.Queue[T | None], items: list[T], max_batch: int) -> tuple[int, bool]:
    """Move what ``source`` holds now onto ``items``, in order, until ``items`` holds
    ``max_batch`` or the close marker is taken: what as many ``get_nowait`` calls would take.
    Returns (how many were taken, the marker included; whether the marker was taken)."""
    with source.mutex:
        queued = source.queue
        n = min(len(queued), max_batch - len(items))
        took = 0
        closed = False
        while took < n:
            item = queued.popleft()
            took += 1
            if item is None:
                closed = True
                break
            items.append(item)
        if took:
            source.not_full.notify(took)  # as each get does (nothing waits on an unbounded queue)
    return took, closed


class _Busy:
    """A settle that waited past the lock bound: it changed nothing, its results are kept."""


BUSY = _Busy()


@dataclass(frozen=True, slots=True)
class SettleJob:
    """One handler result to settle: the claim's ``lease`` and what to settle it with."""

    lease: Lease
    args: SettleArgs


class Settler(threading.Thread):
    """Settles queued :class:`SettleJob` s in batches of at most ``max_batch`` (1..1000).

    ``linger``: seconds to wait for more results while a batch is short (0 = settle what is
    there). ``lease_seconds``: how long a lost connection is retried. ``count(key, n)``: adds to
    the worker's summary (``finished``, ``failed``, ``retried``, ``lease_lost``,
    ``settle_errors``, ``settle_statements``). ``done(n)``: called after each
    batch with how many jobs it took (settled or not). Stops after :meth:`close`, once every job
    queued before it is settled."""

    def __init__(
        self,
        *,
        max_batch: int,
        linger: float,
        lease_seconds: float,
        count: Callable[[str, int], None],
        done: Callable[[int], None],
        bound_lock_waits: bool = True,
    ) -> None:
        super().__init__(name="buzz-delivery-settler", daemon=True)
        self.max_batch = max_batch
        self.linger = linger
        self.lease_seconds = lease_seconds
        self._count = count
        self._done = done
        self._queue: queue.Queue[SettleJob | None] = queue.Queue()  # see next_batch
        # ``bound_lock_waits``: False for a worker serving one community (nothing of another
        # community waits behind its settles: they keep their one-statement fast path).
        self._lock_wait_ms = lock_wait_ms(lease_seconds) if bound_lock_waits else None
        self._busy_retry = busy_retry_seconds(lease_seconds)
        # Communities (by their id's int) whose settle waited past the lock bound, until when
        # (monotonic) their results wait; and those results, in the order they came.
        self._busy: dict[int, float] = {}
        self._deferred: list[SettleJob] = []

    def put(self, job: SettleJob) -> None:
        """Queue one result (thread-safe, never blocks): what ``Queue.put`` does on this
        unbounded queue, with the notify only when the settler waits on it. (``Queue.put`` is a
        few Python calls, its notify a few more even with nothing waiting: every handler thread
        puts once a delivery, mostly while the settler is busy settling the last batch.)
        A waiter registers in the condition's ``_waiters`` under the same mutex, so it is
        either seen here or finds the job queued before it waits."""
        source = self._queue
        with source.mutex:
            source.queue.append(job)
            source.unfinished_tasks += 1
            not_empty = source.not_empty
            if not_empty._waiters:  # type: ignore[attr-defined]
                not_empty.notify()

    def put_many(self, jobs: list[SettleJob]) -> None:
        """:meth:`put` of several results under one hold of the queue's lock (the async
        handlers' loop hands over what one of its iterations finished)."""
        source = self._queue
        with source.mutex:
            source.queue.extend(jobs)
            source.unfinished_tasks += len(jobs)
            not_empty = source.not_empty
            if not_empty._waiters:  # type: ignore[attr-defined]
                not_empty.notify()

    def close(self) -> None:
        """Settle what is queued, then stop (see :meth:`join`)."""
        self._queue.put(None)

    # --- the thread ----------------------------------------------------------------------------

    def run(self) -> None:
        try:
            closing = False
            while not closing:
                jobs, closing = next_batch(self._queue, self.max_batch, self.linger, self._retry_wait())
                jobs = self._due_deferred(everything=closing) + jobs
                if not jobs:
                    continue
                deferred: list[SettleJob] = []
                try:
                    deferred = self._settle_batch(jobs)
                except BaseException:
                    # Never let the settler die: every later result would stay unsettled.
                    logger.exception("worker_error role=settler n=%d: batch settle raised; left to lapse", len(jobs))
                    self._count("settle_errors", len(jobs))
                finally:
                    if closing and deferred:  # the worker gave up waiting: these are not tried again
                        logger.error(
                            "settle_error n=%d: their communities stayed locked past the shutdown; left to lapse",
                            len(deferred),
                        )
                        self._count("settle_errors", len(deferred))
                        deferred = []
                    self._deferred += deferred
                    self._done(len(jobs) - len(deferred))
        finally:
            connections.close_all()

    # --- results of communities whose settle waited past the lock bound ----------------------

    def _retry_wait(self) -> float | None:
        """Seconds until the first kept result's community may be tried again (None: none kept)."""
        if not self._deferred:
            return None
        return max(min(self._busy.values(), default=0.0) - time.monotonic(), 0.0)

    def _due_deferred(self, *, everything: bool = False) -> list[SettleJob]:
        """The kept results whose community's wait is over (``everything``: all of them, a last
        try while the settler closes), taken off the list."""
        now = time.monotonic()
        for community, until in list(self._busy.items()):
            if until <= now or everything:
                del self._busy[community]
        if not self._deferred:
            return []
        busy = self._busy
        due = [job for job in self._deferred if job.lease.community_id.int not in busy]
        if due:
            self._deferred = [job for job in self._deferred if job.lease.community_id.int in busy]
        return due

    def _busy_now(self, job: SettleJob) -> bool:
        return job.lease.community_id.int in self._busy

    def _mark_busy(self, jobs: list[SettleJob]) -> None:
        """A settle of ``jobs`` (one community) waited past the lock bound and changed nothing:
        keep them, and that community's next results, for :attr:`_busy_retry` seconds."""
        lease = jobs[0].lease
        self._busy[lease.community_id.int] = time.monotonic() + self._busy_retry
        logger.warning(
            "settle_lock_wait community=%s n=%d: waited past %s ms for a lock (a lifecycle move of "
            "its community, or a long transaction); settled again in %.2fs, the others go on",
            lease.community_id,
            len(jobs),
            self._lock_wait_ms,
            self._busy_retry,
        )

    # --- one batch -----------------------------------------------------------------------------

    def _retried(self, settle: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``settle(*args, **kwargs)``, tried once directly (the hot path: no retry machinery
        built); only a lost connection (not a lock wait past its bound) hands the rest of the
        attempts to a tenacity ``Retrying`` (:meth:`_after_lost`)."""
        started = time.monotonic()
        try:
            return settle(*args, **kwargs)
        except DB_UNAVAILABLE as exc:
            if not _connection_lost(exc):
                raise
            return self._after_lost(exc, started, settle, *args, **kwargs)

    def _after_lost(
        self, first: BaseException, started: float, settle: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        """The retries of a settle whose first try (at ``started``, monotonic) lost its
        connection (``first``): before each wait the loss is logged and the connection closed;
        waits of 0.2 s doubling up to 2 s; given up (the last error raised) once one lease length
        has passed since the first try. The first try's error is replayed as the ``Retrying``'s
        attempt 1, so that its numbering, waits and logging are the policy's from the first try."""
        lease_seconds = self.lease_seconds
        replay: list[BaseException] = [first]
        for attempt in Retrying(
            retry=retry_if_exception(_connection_lost),
            stop=lambda _state: time.monotonic() - started >= lease_seconds,
            wait=wait_exponential(multiplier=RETRY_FIRST_WAIT, max=RETRY_MOST_WAIT),
            before_sleep=_reconnect,
            reraise=True,
        ):
            with attempt:
                if replay:
                    raise replay.pop()
                return settle(*args, **kwargs)
        raise AssertionError("unreachable: Retrying reraises or returns")  # pragma: no cover

    def _settle_batch(self, jobs: list[SettleJob]) -> list[SettleJob]:
        """Settle ``jobs``; returns those kept for later (their community is busy)."""
        with lock_waits_bounded(self._lock_wait_ms):
            return self._settle_bounded(jobs)

    def _settle_bounded(self, jobs: list[SettleJob]) -> list[SettleJob]:
        # The batch statement takes the leases of one community: group by community.
        # Keyed by the UUIDs' ints (hashed in C; a UUID hashes through a Python method).
        groups: dict[int, list[SettleJob]] = {}
        seen: set[int] = set()
        singles: list[SettleJob] = []
        kept: list[SettleJob] = []
        if self._busy:  # results of a community still waiting out its lock wait: not tried now
            kept = [job for job in jobs if self._busy_now(job)]
            jobs = [job for job in jobs if not self._busy_now(job)]
        for job in jobs:
            # One statement takes each delivery once: a second lease of the same delivery (a
            # requeue while the old handler ran) settles on its own.
            lease = job.lease
            key = lease.delivery_id.int
            if key not in seen:
                seen.add(key)
                groups.setdefault(lease.community_id.int, []).append(job)
            else:
                singles.append(job)
        results: list[tuple[SettleJob, FinishOutcome]] = []
        statements = 0
        for group in groups.values():
            if len(group) > 1:
                batch, used = self._settle_many(group)
                statements += used
                if isinstance(batch, _Busy):
                    # One of its rows may be held, not the whole community: settle the group
                    # one lease at a time below, until one of them waits too.
                    singles = group + singles
                elif batch is None:
                    singles = group + singles
                else:
                    results += batch
            else:
                singles = group + singles
        waited: list[SettleJob] = []
        for job in singles:
            if self._busy_now(job):
                kept.append(job)
                continue
            outcome, used = self._settle_one(job)
            statements += used
            if isinstance(outcome, _Busy):
                self._mark_busy([job])
                waited.append(job)
            elif outcome is not None:
                results.append((job, outcome))
        # A result whose settle waited goes after its community's other kept results: the next
        # try settles those first, so one held row does not keep the rest of its community's
        # results (whose leases are no longer renewed) waiting until it is released.
        kept += waited
        if kept:  # (rare: a community's settle waited)
            kept_ids = {id(job) for job in kept}
            jobs = [job for job in jobs if id(job) not in kept_ids]
        if jobs:
            self._record(jobs, results, statements)
        elif statements:
            self._count("settle_statements", statements)
        return kept

    def _settle_many(self, jobs: list[SettleJob]) -> tuple[list[tuple[SettleJob, FinishOutcome]] | _Busy | None, int]:
        """Settle ``jobs`` (one community, distinct deliveries, each with its own outcome) in one
        statement. Returns (the outcomes, statements run: 1 + two per lease the batch did not
        settle, roughly), (None, 0) when the statement must be replayed lease by lease, or
        (:data:`BUSY`, 1) when it waited past the lock bound (nothing was settled)."""
        if all(job.args.outcome == "finished" for job in jobs):  # the common batch: no per-row texts to check
            return self._call_many(jobs, services.finish_deliveries, [job.lease for job in jobs], "finished")
        settles = [
            Settle(
                job.lease,
                job.args.outcome,
                failure_code=job.args.failure_code,
                failure_message=job.args.failure_message,
                retry_after=job.args.retry_after,
            )
            for job in jobs
        ]
        return self._call_many(jobs, services.settle_deliveries, settles)

    def _call_many(
        self, jobs: list[SettleJob], settle: Callable[..., list[FinishOutcome]], *args: Any
    ) -> tuple[list[tuple[SettleJob, FinishOutcome]] | _Busy | None, int]:
        try:
            outcomes = self._retried(settle, *args)
        except DB_UNAVAILABLE as exc:
            if lock_wait_timed_out(exc):
                # Its statement changed nothing; if a follow-up read of the batch waited (a lease
                # the statement did not settle), what it did settle is found settled next time.
                return BUSY, 1
            logger.error("db_unavailable role=settle n=%d gave up: %s", len(jobs), exc)
            return [], 1
        except Exception as exc:
            logger.warning("settle_error n=%d batch refused (%s): settling one by one", len(jobs), exc)
            return None, 0
        unsettled = sum(1 for o in outcomes if not isinstance(o, Settled))
        return list(zip(jobs, outcomes, strict=True)), 1 + 2 * unsettled

    def _settle_one(self, job: SettleJob) -> tuple[FinishOutcome | _Busy | None, int]:
        lease, args = job.lease, job.args
        try:
            outcome = self._retried(
                services.finish_delivery,
                lease,
                args.outcome,
                failure_code=args.failure_code,
                failure_message=args.failure_message,
                retry_after=args.retry_after,
            )
        except DB_UNAVAILABLE as exc:
            if lock_wait_timed_out(exc):
                return BUSY, 1
            logger.error("db_unavailable role=settle delivery=%s gave up: %s", lease.delivery_id, exc)
            return None, 1
        except Exception:
            # Nothing about one delivery may stop the worker: its lease lapses and the reaper
            # returns it (attempts and retries apply there).
            logger.exception(
                "settle_error delivery=%s generation=%d outcome=%s: left to lapse",
                lease.delivery_id,
                lease.lease_generation,
                args.outcome,
            )
            self._count("settle_errors", 1)
            return None, 1
        return outcome, 1 if isinstance(outcome, Settled) else 2

    def _record(self, jobs: list[SettleJob], results: list[tuple[SettleJob, FinishOutcome]], statements: int) -> None:
        """Count and log a settled batch: one INFO line per batch, one DEBUG line per delivery,
        a WARNING per lost lease."""
        counts = dict.fromkeys(("finished", "failed", "retried", "lease_lost", "already"), 0)
        debug = logger.isEnabledFor(logging.DEBUG)
        if results and not debug:
            # The common batch: one outcome object for every lease (finish_deliveries returns
            # its frozen Settled once per lease when all settled): counted at once, as the loop
            # below would count it (it logs nothing per row for a Settled without DEBUG).
            same = results[0][1]
            if isinstance(same, Settled) and all(outcome is same for _, outcome in results):
                key = SETTLED_KEYS.get(same.status, same.status)
                counts[key] = counts.get(key, 0) + len(results)
                results = []
        for job, outcome in results:
            lease = job.lease
            if isinstance(outcome, LeaseLost):
                logger.warning(
                    "lease_lost delivery=%s generation=%d during=settle outcome=%s result dropped",
                    lease.delivery_id,
                    lease.lease_generation,
                    job.args.outcome,
                )
                counts["lease_lost"] += 1
                continue
            status = outcome.status
            again = isinstance(outcome, AlreadyTerminal)
            counts["already"] += again
            key = SETTLED_KEYS.get(status, status)
            counts[key] = counts.get(key, 0) + 1
            if debug:
                logger.debug(
                    "settled delivery=%s generation=%d outcome=%s status=%s%s",
                    lease.delivery_id,
                    lease.lease_generation,
                    job.args.outcome,
                    status,
                    " (already settled)" if again else "",
                )
        for key, n in counts.items():
            if n and key != "already":
                self._count(key, n)
        self._count("settle_statements", statements)
        logger.info(
            "settled n=%d statements=%d %s",
            len(jobs),
            statements,
            " ".join(f"{k}={n}" for k, n in counts.items()),
        )


def _connection_lost(exc: BaseException) -> bool:
    """What a settle retries (reconnecting): a lost connection, not a lock wait past its bound."""
    return isinstance(exc, DB_UNAVAILABLE) and not lock_wait_timed_out(exc)


def _reconnect(state: RetryCallState) -> None:
    """Before each wait: log the lost connection and close it (the next try reconnects)."""
    outcome = state.outcome
    logger.warning(
        "db_unavailable role=settle attempt=%d error=%s",
        state.attempt_number,
        outcome.exception() if outcome is not None else None,
    )
    close_old_connections()
