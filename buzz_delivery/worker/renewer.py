"""Background lease renewal (SPEC sections 4.4 and 7).

One thread renews every lease the worker holds, each ``every`` seconds after it was granted or
last renewed (a fraction of the lease length, so one or two missed renewals still leave time).
A renewal that returns ``LeaseLost`` marks the lease lost: the handler keeps running, but its
result is dropped (the settle would return ``LeaseLost`` anyway). The thread uses its own
Django connection and closes it when it stops.

A worker may serve several communities, and one thread renews them all: a renewal waits for a
lock at most :func:`lock_wait_ms` (``lock_timeout``). One that waited longer (its community's
rows are locked: a lifecycle move of that community waiting behind a long transaction of the
community's own code, say) changed nothing; that community's renewals are then left for
:func:`busy_retry_seconds` and the others go on, so what one community holds never lets the
leases of another lapse.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import InterfaceError, OperationalError, close_old_connections, connections

from buzz_delivery import services
from buzz_delivery.lockwaits import tried_last
from buzz_delivery.services import Lease, LeaseLost
from buzz_delivery.services.db import lock_wait_timed_out, lock_waits_bounded

logger = logging.getLogger("buzz_delivery.worker")

DB_RETRY_SECONDS = 1.0
# Errors of a lost or refused database connection: log, close the connection, carry on.
DB_UNAVAILABLE = (OperationalError, InterfaceError)
# The longest a renewal or a settle waits for a lock: this fraction of the lease, at most
# LOCK_WAIT_MAX_SECONDS. Past it the statement is cancelled (it changed nothing) and its
# community waits for busy_retry_seconds, so the other communities of the worker go on.
LOCK_WAIT_LEASE_FRACTION = 0.1
LOCK_WAIT_MAX_SECONDS = 1.0


def lock_wait_ms(lease_seconds: float) -> int:
    """Milliseconds a renewal or settle of a worker with leases of ``lease_seconds`` may wait
    for a lock (``lock_timeout``): a tenth of the lease, at most a second (at least 1 ms)."""
    return max(1, int(min(lease_seconds * LOCK_WAIT_LEASE_FRACTION, LOCK_WAIT_MAX_SECONDS) * 1000))


def busy_retry_seconds(lease_seconds: float) -> float:
    """Seconds a community whose renewal or settle waited past :func:`lock_wait_ms` is left
    before its next try: a third of the lease (a renewal round), at most
    :data:`DB_RETRY_SECONDS`; each try costs the other communities one bounded wait at most."""
    return min(lease_seconds / 3, DB_RETRY_SECONDS)


@dataclass(slots=True)
class HeldLease:
    """A lease the worker holds: the current ``lease``, when to renew it next and its handler
    ``deadline`` (monotonic seconds; None = none), whether it was lost, and whether its handler
    ran past the deadline (``timed_out``: no longer renewed, the lease lapses)."""

    lease: Lease
    due: float
    deadline: float | None = None
    lost: bool = False
    timed_out: bool = False
    renewals: int = field(default=0)

    @property
    def renewing(self) -> bool:
        return not (self.lost or self.timed_out)


def _key(lease: Lease) -> tuple[int, int]:
    # The id's int: a tuple of ints hashes in C (a UUID hashes through a Python method, and a
    # lease is looked up three times per delivery).
    return (lease.delivery_id.int, lease.lease_generation)


class LeaseRenewer(threading.Thread):
    """Renews held leases every ``every`` seconds (monotonic clock; the database judges expiry)
    for ``lease_seconds``; calls ``on_renewed()`` after each renewal. Stops on :meth:`shutdown`."""

    def __init__(
        self,
        *,
        lease_seconds: float,
        every: float,
        on_renewed: Callable[[], None],
        on_timed_out: Callable[[HeldLease], None] = lambda held: None,
        bound_lock_waits: bool = True,
    ) -> None:
        super().__init__(name="buzz-delivery-renewer", daemon=True)
        self.lease_seconds = lease_seconds
        self.every = every
        self._on_renewed = on_renewed
        self._on_timed_out = on_timed_out
        # Keyed by (delivery, generation): after an operator requeue the same worker may hold a
        # newer lease on the same delivery while the old handler still runs; each holder
        # releases only its own lease.
        self._held: dict[tuple[int, int], HeldLease] = {}
        # The held leases whose handler ran past its deadline (``timed_out``), by the same key:
        # the dispatcher asks how many on every round, which counted every held lease (a batch
        # of claims ahead: ~70 a round) under the lock (issue 31). Changed under ``_lock`` only.
        self._hung: dict[tuple[int, int], HeldLease] = {}
        # The condition's own lock, also taken bare where nothing waits or is notified (hold,
        # set_deadline, release: per delivery; a Condition's ``with`` is a Python call).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._stopping = False
        # When the thread's wait ends (monotonic seconds; inf = it waits to be notified; -inf =
        # it is not waiting): a new lease or deadline wakes it only if it is due before that, so
        # a burst of claims does not wake it once per claim.
        self._wakes_at = -math.inf
        # ``bound_lock_waits``: False for a worker serving one community (no other community's
        # leases to hold up; its statements keep their one-statement fast path).
        self._lock_wait_ms = lock_wait_ms(lease_seconds) if bound_lock_waits else None
        self._busy_retry = min(every, busy_retry_seconds(lease_seconds))
        # Communities (by their id's int) whose renewal waited past the lock bound, until when
        # (monotonic) their renewals are left alone. Read and written by the thread only.
        self._busy: dict[int, float] = {}

    def _notify_if_before(self, when: float | None) -> None:
        """Wake the thread if ``when`` comes before its current wait ends (call under ``_cond``)."""
        if when is not None and when < self._wakes_at:
            self._wakes_at = -math.inf
            self._cond.notify()

    def hold(self, lease: Lease, deadline: float | None = None) -> HeldLease:
        """Start renewing ``lease`` (one entry per delivery and generation) until it is released
        or, if given, until ``deadline`` (monotonic seconds) passes: then it is marked
        ``timed_out``, ``on_timed_out(held)`` is called, and it is no longer renewed."""
        held = HeldLease(lease=lease, due=time.monotonic() + self.every, deadline=deadline)
        with self._cond:
            self._held[_key(lease)] = held
            self._notify_if_before(min(held.due, deadline) if deadline is not None else held.due)
        return held

    def hold_many(self, leases: list[Lease]) -> None:
        """:meth:`hold` each of ``leases`` (no deadline yet), under one lock."""
        if not leases:
            return
        due = time.monotonic() + self.every
        with self._lock:
            held = self._held
            for lease in leases:
                held[(lease.delivery_id.int, lease.lease_generation)] = HeldLease(lease=lease, due=due)
            self._notify_if_before(due)

    def set_deadline(self, lease: Lease, deadline: float | None) -> None:
        """Give a held lease its handler deadline (monotonic seconds; None = none), set when
        its handler starts: a claim waiting in the worker's local queue is renewed, but its
        handler's time has not begun. No effect on a lease that is not held."""
        key = (lease.delivery_id.int, lease.lease_generation)  # _key(lease), without the call
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                held.deadline = deadline
                if deadline is not None and deadline < self._wakes_at:  # _notify_if_before, inline
                    self._wakes_at = -math.inf
                    self._cond.notify()

    def release(self, lease: Lease) -> HeldLease | None:
        """Stop renewing ``lease`` (this delivery at this generation only; a newer lease of the
        same delivery keeps being renewed). Returns the final state, or None if not held."""
        key = (lease.delivery_id.int, lease.lease_generation)  # _key(lease), without the call
        with self._lock:
            held = self._held.pop(key, None)
            if self._hung:  # (a hung handler's lease: almost never)
                self._hung.pop(key, None)
            return held

    def timed_out_count(self) -> int:
        """Held leases whose handler is still running past its deadline (not renewed)."""
        return len(self._hung)  # one read of a dict's size: no lock to take

    def timed_out_delivery_ids(self) -> set[uuid.UUID]:
        """Deliveries whose handler in this process still runs past its deadline."""
        if not self._hung:  # (almost always: checked per claim batch)
            return set()
        with self._lock:
            return {h.lease.delivery_id for h in self._hung.values()}

    def shutdown(self) -> None:
        """Ask the thread to stop and wait for it."""
        with self._cond:
            self._stopping = True
            self._wakes_at = -math.inf
            self._cond.notify()
        self.join()

    def _due(self) -> tuple[list[HeldLease], list[HeldLease]] | None:
        """Wait for work: (leases to renew now, leases whose deadline just passed)."""
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                # A lost lease's handler can hang too: its deadline counts all the same.
                late = [
                    h for h in self._held.values() if not h.timed_out and h.deadline is not None and h.deadline <= now
                ]
                for held in late:
                    held.timed_out = True
                    self._hung[_key(held.lease)] = held
                due = [h for h in self._held.values() if h.renewing and h.due <= now]
                if due or late:
                    return due, late
                upcoming = [h.due for h in self._held.values() if h.renewing]
                upcoming += [h.deadline for h in self._held.values() if not h.timed_out and h.deadline is not None]
                self._wakes_at = min(upcoming) if upcoming else math.inf
                self._cond.wait(timeout=(self._wakes_at - now) if upcoming else None)
                self._wakes_at = -math.inf
            return None

    def _renew(self, held: HeldLease) -> None:
        lease = held.lease
        community = lease.community_id.int
        busy_until = self._busy.get(community)
        if busy_until is not None:
            if busy_until > time.monotonic():
                with self._cond:
                    held.due = max(held.due, busy_until)  # its community's turn comes then
                return
            del self._busy[community]
        try:
            with lock_waits_bounded(self._lock_wait_ms):
                outcome = services.renew_delivery(lease, self.lease_seconds)
        except DB_UNAVAILABLE as exc:
            if lock_wait_timed_out(exc):
                self._skip_community(held, community)
                return
            logger.warning("db_unavailable role=renewer delivery=%s error=%s", lease.delivery_id, exc)
            close_old_connections()
            with self._cond:
                held.due = time.monotonic() + min(self.every, DB_RETRY_SECONDS)
            return
        except Exception:
            # Never let the renewer thread die: every held lease would lapse unnoticed.
            logger.exception("worker_error role=renewer delivery=%s: renew raised", lease.delivery_id)
            with self._cond:
                held.due = time.monotonic() + min(self.every, DB_RETRY_SECONDS)
            return
        with self._cond:
            if self._held.get(_key(lease)) is not held:
                return  # released (settling) while we renewed: the settle decides
            if isinstance(outcome, LeaseLost):
                held.lost = True
            else:
                held.lease = outcome.lease
                held.renewals += 1
                held.due = time.monotonic() + self.every
        if isinstance(outcome, LeaseLost):
            logger.warning(
                "lease_lost delivery=%s generation=%d during=renew", lease.delivery_id, lease.lease_generation
            )
        else:
            logger.debug(
                "renewed delivery=%s generation=%d lease_until=%s",
                lease.delivery_id,
                lease.lease_generation,
                outcome.lease_until.isoformat(),
            )
            self._on_renewed()

    def _skip_community(self, held: HeldLease, community: int) -> None:
        """``held``'s renewal waited past the lock bound (and changed nothing): leave its
        community's renewals for :attr:`_busy_retry` seconds (the lease lapses if its community
        stays locked longer than the lease has left). ``held`` goes last in the renewal order: the
        community's next try starts with another of its leases, so one locked delivery row (a
        long transaction holding it) does not keep the community's other leases from ever being
        renewed (each try costs one bounded wait, as before)."""
        retry_at = time.monotonic() + self._busy_retry
        self._busy[community] = retry_at
        with self._cond:
            held.due = retry_at
            tried_last(self._held, _key(held.lease))
        logger.warning(
            "renew_lock_wait community=%s delivery=%s: waited past %s ms for a lock (a lifecycle move "
            "of its community, or a long transaction); its renewals wait %.2fs, the others go on",
            held.lease.community_id,
            held.lease.delivery_id,
            self._lock_wait_ms,
            self._busy_retry,
        )

    def run(self) -> None:
        try:
            while (work := self._due()) is not None:
                due, late = work
                for held in late:
                    lease = held.lease
                    logger.warning(
                        "handler_timeout delivery=%s generation=%d: past its deadline; handing it back "
                        "(retry), no longer renewed, its result will be dropped",
                        lease.delivery_id,
                        lease.lease_generation,
                    )
                    with lock_waits_bounded(self._lock_wait_ms):  # its settle: one lock wait at most
                        self._on_timed_out(held)
                for held in due:
                    self._renew(held)
        finally:
            connections.close_all()
