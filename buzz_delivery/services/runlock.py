"""The overlap guard of the maintenance commands (SPEC section 8): a named lease row.

A run takes the lease for its job name with one statement, keeps it renewed on a timer from a
background thread (:class:`RunLeaseKeeper`: every third of its length, so a batch that stalls
does not let the lease lapse while this run is alive) and releases it at the end. Every
statement is its own short transaction and nothing is held on the database session between
them (no session-level advisory lock), so the guard works behind a transaction-pooling
connection pooler such as PgBouncer. A run that crashes does
not release its lease; the lease lapses by itself ``ttl_seconds`` after its last renewal,
judged by the database clock. Rows live in ``buzz_delivery_maintenance_lease``
(:class:`buzz_delivery.models.MaintenanceLease`).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from django.db import close_old_connections, connection, connections

from buzz_delivery.models import MaintenanceLease
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all

logger = logging.getLogger("buzz_delivery.commands")

LEASE_TABLE = MaintenanceLease._meta.db_table
HOLDER_MAX_CHARS = 200

# Takes a free or lapsed lease; a live lease of another holder leaves the row alone and
# returns nothing. ``now()`` is the database clock.
ACQUIRE_IF_FREE_OR_LAPSED = f"""
INSERT INTO {LEASE_TABLE} AS l (name, holder, lease_until, acquired_at)
VALUES (%(name)s, %(holder)s, now() + make_interval(secs => %(ttl)s), now())
ON CONFLICT (name) DO UPDATE
    SET holder = EXCLUDED.holder, lease_until = EXCLUDED.lease_until, acquired_at = EXCLUDED.acquired_at
    WHERE l.lease_until < now()
RETURNING l.lease_until
"""

RENEW_IF_STILL_HELD = f"""
UPDATE {LEASE_TABLE} AS l
SET lease_until = now() + make_interval(secs => %(ttl)s)
WHERE l.name = %(name)s AND l.holder = %(holder)s AND l.lease_until >= now()
RETURNING l.lease_until
"""

RELEASE_IF_HELD = f"DELETE FROM {LEASE_TABLE} AS l WHERE l.name = %(name)s AND l.holder = %(holder)s RETURNING 1"

CURRENT_HOLDER = f"SELECT l.holder, l.lease_until FROM {LEASE_TABLE} AS l WHERE l.name = %(name)s"


@dataclass(frozen=True, slots=True)
class RunLease:
    """A held maintenance lease: job ``name``, this run's ``holder`` token and the deadline
    ``lease_until`` (database clock) after which another run may take it over."""

    name: str
    holder: str
    lease_until: dt.datetime


@dataclass(frozen=True, slots=True)
class LeaseBusy:
    """Another run holds the lease: its ``holder`` token and ``lease_until`` (either may be
    None when the row vanished between the attempt and the look-up)."""

    name: str
    holder: str | None
    lease_until: dt.datetime | None


def new_holder() -> str:
    """A holder token unique to this run: ``host:pid:random``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def _ttl(ttl_seconds: float) -> float:
    return v.seconds_in_range(ttl_seconds, "ttl_seconds", 1, 86_400)


def _name(name: object, field: str = "name") -> str:
    text = v.optional_text(name, field, 100) or ""
    if not text.strip():
        raise v.invalid(field, "must not be blank")
    return text


def _held(lease: object) -> RunLease:
    if not isinstance(lease, RunLease):
        raise v.invalid("lease", f"must be a RunLease, not {type(lease).__name__}")
    _name(lease.name, "lease.name")
    v.optional_text(lease.holder, "lease.holder", HOLDER_MAX_CHARS)
    return lease


def acquire_run_lease(name: str, ttl_seconds: float, *, holder: str | None = None) -> RunLease | LeaseBusy:
    """Take the lease ``name`` for ``ttl_seconds`` (1..86,400) if it is free or has lapsed.

    Returns the :class:`RunLease` on success, or :class:`LeaseBusy` naming the current holder.
    ``holder`` defaults to :func:`new_holder`. One statement, one transaction.
    Raises ``ValidationError`` (field ``name`` / ``ttl_seconds``) before any SQL.
    """
    name = _name(name)
    token = v.optional_text(holder, "holder", HOLDER_MAX_CHARS) or new_holder()
    rows = fetch_all(ACQUIRE_IF_FREE_OR_LAPSED, {"name": name, "holder": token, "ttl": _ttl(ttl_seconds)})
    if rows:
        return RunLease(name=name, holder=token, lease_until=rows[0][0])
    current = fetch_all(CURRENT_HOLDER, {"name": name})
    if current:
        return LeaseBusy(name=name, holder=current[0][0], lease_until=current[0][1])
    return LeaseBusy(name=name, holder=None, lease_until=None)


def renew_run_lease(lease: RunLease, ttl_seconds: float) -> RunLease | None:
    """Extend a held lease to ``now() + ttl_seconds``. Returns the renewed :class:`RunLease`,
    or None when the lease was lost (it lapsed and another run took it, or it was released):
    the caller must then stop, because another run may be working."""
    lease = _held(lease)
    rows = fetch_all(RENEW_IF_STILL_HELD, {"name": lease.name, "holder": lease.holder, "ttl": _ttl(ttl_seconds)})
    if not rows:
        return None
    return RunLease(name=lease.name, holder=lease.holder, lease_until=rows[0][0])


def release_run_lease(lease: RunLease) -> bool:
    """Give the lease back. True if this run still held it; False if it had been taken over."""
    lease = _held(lease)
    return bool(fetch_all(RELEASE_IF_HELD, {"name": lease.name, "holder": lease.holder}))


class RunLeaseKeeper:
    """Keeps a held :class:`RunLease` renewed on a timer: a daemon thread renews it every
    ``ttl_seconds / 3`` seconds on its own database connection (one short statement each time,
    so it works behind a transaction pooler) until :meth:`stop`.

    :attr:`lost` becomes True when a renewal finds the lease gone (it lapsed and another run
    took it, or it was released), or when no renewal succeeded for ``ttl_seconds`` (the
    database was unreachable, so the lease must be presumed lapsed). The run must then stop.
    """

    def __init__(self, lease: RunLease, ttl_seconds: float) -> None:
        self.ttl_seconds = _ttl(ttl_seconds)
        self.every = self.ttl_seconds / 3
        self._lease = lease
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"buzz-run-lease-{lease.name}", daemon=True)

    @property
    def lease(self) -> RunLease:
        """The lease as last renewed."""
        return self._lease

    @property
    def lost(self) -> bool:
        """True once the lease is lost (see the class docstring)."""
        return self._lost.is_set()

    def mark_lost(self) -> None:
        """Record that the run found its lease lost by itself."""
        self._lost.set()

    def start(self) -> RunLeaseKeeper:
        """Start the renewing thread; returns ``self``.

        Inside the caller's transaction (``transaction.atomic()``) no thread starts: the lease row
        is not visible to another connection until that transaction commits, so a thread could
        only find it "lost". The caller then renews it itself between batches (as the
        maintenance commands do), on its own connection."""
        if connection.in_atomic_block:
            return self
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing and wait for the thread (at most one renewal's time)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        renewed_at = time.monotonic()
        try:
            while not self._stop.wait(self.every):
                try:
                    renewed = renew_run_lease(self._lease, self.ttl_seconds)
                except Exception as exc:  # DatabaseError above all: retry until the lease would lapse
                    logger.warning("%s: could not renew the run lease: %s", self._lease.name, exc)
                    close_old_connections()
                    if time.monotonic() - renewed_at >= self.ttl_seconds:
                        logger.error(
                            "%s: no renewal for %gs; presuming the run lease lost", self._lease.name, self.ttl_seconds
                        )
                        self._lost.set()
                        return
                    continue
                if renewed is None:
                    logger.error("%s: the run lease lapsed and was taken over", self._lease.name)
                    self._lost.set()
                    return
                self._lease = renewed
                renewed_at = time.monotonic()
        finally:
            connections.close_all()


@contextmanager
def run_lease(name: str, ttl_seconds: float) -> Iterator[RunLease | LeaseBusy]:
    """``with run_lease("reap_deliveries", 120) as lease:`` — yields :class:`RunLease`, kept
    renewed on a timer by a :class:`RunLeaseKeeper` while the block runs and released on exit
    (even on error), or :class:`LeaseBusy` (nothing to release)."""
    lease = acquire_run_lease(name, ttl_seconds)
    if not isinstance(lease, RunLease):
        yield lease
        return
    keeper = RunLeaseKeeper(lease, ttl_seconds).start()
    try:
        yield lease
    finally:
        keeper.stop()
        release_run_lease(lease)
