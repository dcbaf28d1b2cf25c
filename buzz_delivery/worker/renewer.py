"""Background lease renewal (SPEC sections 4.4 and 7).

One thread renews every lease the worker holds, each ``every`` seconds after it was granted or
last renewed (a fraction of the lease length, so one or two missed renewals still leave time).
A renewal that returns ``LeaseLost`` marks the lease lost: the handler keeps running, but its
result is dropped (the settle would return ``LeaseLost`` anyway). The thread uses its own
Django connection and closes it when it stops.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import InterfaceError, OperationalError, close_old_connections, connections

from buzz_delivery import services
from buzz_delivery.services import Lease, LeaseLost

logger = logging.getLogger("buzz_delivery.worker")

DB_RETRY_SECONDS = 1.0
# Errors of a lost or refused database connection: log, close the connection, carry on.
DB_UNAVAILABLE = (OperationalError, InterfaceError)


@dataclass(slots=True)
class HeldLease:
    """A lease the worker holds: the current ``lease``, when to renew it next (monotonic
    seconds) and whether it was lost."""

    lease: Lease
    due: float
    lost: bool = False
    renewals: int = field(default=0)


class LeaseRenewer(threading.Thread):
    """Renews held leases every ``every`` seconds (monotonic clock; the database judges expiry)
    for ``lease_seconds``; calls ``on_renewed()`` after each renewal. Stops on :meth:`shutdown`."""

    def __init__(self, *, lease_seconds: float, every: float, on_renewed: Callable[[], None]) -> None:
        super().__init__(name="buzz-delivery-renewer", daemon=True)
        self.lease_seconds = lease_seconds
        self.every = every
        self._on_renewed = on_renewed
        self._held: dict[uuid.UUID, HeldLease] = {}
        self._cond = threading.Condition()
        self._stopping = False

    def hold(self, lease: Lease) -> HeldLease:
        """Start renewing ``lease``."""
        held = HeldLease(lease=lease, due=time.monotonic() + self.every)
        with self._cond:
            self._held[lease.delivery_id] = held
            self._cond.notify()
        return held

    def release(self, delivery_id: uuid.UUID) -> HeldLease | None:
        """Stop renewing; returns the final state (its ``lost`` flag is settled from then on)."""
        with self._cond:
            return self._held.pop(delivery_id, None)

    def shutdown(self) -> None:
        """Ask the thread to stop and wait for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self.join()

    def _due(self) -> list[HeldLease] | None:
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                due = [h for h in self._held.values() if h.due <= now and not h.lost]
                if due:
                    return due
                upcoming = [h.due for h in self._held.values() if not h.lost]
                self._cond.wait(timeout=(min(upcoming) - now) if upcoming else None)
            return None

    def _renew(self, held: HeldLease) -> None:
        lease = held.lease
        try:
            outcome = services.renew_delivery(lease, self.lease_seconds)
        except DB_UNAVAILABLE as exc:
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
            if self._held.get(lease.delivery_id) is not held:
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
            logger.info(
                "renewed delivery=%s generation=%d lease_until=%s",
                lease.delivery_id,
                lease.lease_generation,
                outcome.lease_until.isoformat(),
            )
            self._on_renewed()

    def run(self) -> None:
        try:
            while (due := self._due()) is not None:
                for held in due:
                    self._renew(held)
        finally:
            connections.close_all()
