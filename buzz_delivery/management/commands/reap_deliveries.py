"""``manage.py reap_deliveries``: the reaper for cron or as a long-lived process (SPEC section 8).

Also defines :class:`MaintenanceCommand`, the cron-safe frame shared with ``prune_deliveries``:
the overlap guard (a lease row, :mod:`buzz_delivery.services.runlock`, renewed on a timer by a
background thread and checked between chunks of batches), bounded batches, ``--dry-run``, one
machine-readable summary line, exit codes, ``--loop`` with graceful shutdown on SIGTERM/SIGINT, and ``-v 0..3``.
"""

from __future__ import annotations

import json
import logging
import shlex
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError, CommandParser
from django.db import DatabaseError, close_old_connections

from buzz_delivery import services
from buzz_delivery.exceptions import BuzzDeliveryError
from buzz_delivery.management.base import StopRequest, StrictOptionsCommand
from buzz_delivery.management.options import positive_int, positive_seconds, run_lease_seconds
from buzz_delivery.services.runlock import (
    LeaseBusy,
    RunLeaseKeeper,
    acquire_run_lease,
    release_run_lease,
    renew_run_lease,
)

logger = logging.getLogger("buzz_delivery.commands")

# Exit codes besides 0 (done, or another run is active). Usage errors exit 2 (argparse).
EXIT_FAILED = 1
EXIT_USAGE = 2  # bad arguments (argparse) or settings
EXIT_LEASE_LOST = 3
# Batches between two checks of the run lease (it is renewed on a timer in between). Must exceed
# the number of statements one service call runs when it finds nothing (reap: 2, prune: 3), or a
# chunk never looks finished.
RENEW_EVERY_BATCHES = 10


class LeaseLostError(Exception):
    """The run lease lapsed and another run took it over: this run must stop at once."""


class MaintenanceCommand(StrictOptionsCommand):
    """A cron-safe maintenance command. Subclasses set :attr:`job` and implement
    :meth:`run_chunk` (one bounded call of their service) and :meth:`empty_counts`."""

    job = ""
    supports_loop = False
    default_lease_seconds = 120.0

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--batch-size",
            type=positive_int,
            default=None,
            help="Rows per statement, each its own short transaction (default: BUZZ_DELIVERY['BATCH_SIZE'], 1000).",
        )
        parser.add_argument(
            "--max-batches",
            type=positive_int,
            default=None,
            help="Stop after this many statements (default: until nothing is left).",
        )
        parser.add_argument("--dry-run", action="store_true", help="Count what would be done; write nothing.")
        parser.add_argument("--json", action="store_true", help="Print the summary line as JSON instead of key=value.")
        parser.add_argument(
            "--lease-seconds",
            type=run_lease_seconds,
            default=self.default_lease_seconds,
            help="How long the overlap guard holds if this run dies (1..86400); renewed every third of it "
            "while the run is alive (default: %(default)s).",
        )
        if self.supports_loop:
            parser.add_argument(
                "--loop",
                action="store_true",
                help="Run forever, one pass every --interval seconds; SIGTERM/SIGINT stop it after the current batch.",
            )
            parser.add_argument(
                "--interval",
                type=positive_seconds,
                default=30.0,
                help="Seconds between passes with --loop (default: %(default)s).",
            )

    # --- to implement -----------------------------------------------------------

    def empty_counts(self) -> dict[str, int]:
        """The summary's counters, all zero, in print order."""
        raise NotImplementedError

    def run_chunk(self, options: dict[str, Any], max_batches: int | None, dry_run: bool) -> tuple[dict[str, int], int]:
        """One bounded call of the service: (counts to add up, batches run)."""
        raise NotImplementedError

    # Counters that are a state of the database, not work done: the last chunk's value wins.
    snapshot_counts: tuple[str, ...] = ("skipped_fenced", "skipped_busy")

    # --- frame ------------------------------------------------------------------------

    def handle(self, *args: Any, **options: Any) -> None:
        self.verbosity = options["verbosity"]
        if self.verbosity >= 3:
            logging.getLogger("buzz_delivery").setLevel(logging.DEBUG)
        self.stop = StopRequest()
        if not options.get("loop"):
            self.run_pass(options, raise_errors=True)
            return
        with self.stop_on_signals():
            while not self.stop.is_set():
                self.run_pass(options, raise_errors=False)
                close_old_connections()
                self.stop.wait(options["interval"])
        self.progress(f"{self.job}: {self.stop.reason} received; stopped after the current batch")
        self.progress(f"{self.job}: stopped on signal")

    @contextmanager
    def stop_on_signals(self) -> Iterator[None]:
        """SIGTERM and SIGINT set :attr:`stop`; the loop finishes the current batch and exits 0."""

        def request_stop(signum: int, frame: object) -> None:
            # Only set a flag: writing or taking a lock here can deadlock the interrupted thread.
            self.stop.set(signal.Signals(signum).name)

        previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def run_pass(self, options: dict[str, Any], *, raise_errors: bool) -> None:
        """One run: take the guard, work in chunks, release, print the summary line."""
        started = time.monotonic()
        try:
            summary = self.guarded_run(options)
        except LeaseLostError as exc:
            logger.warning("%s: %s", self.job, exc)
            self.emit({"outcome": "lease_lost"}, started, options)
            if raise_errors:
                raise CommandError(f"{self.job}: {exc}", returncode=EXIT_LEASE_LOST) from exc
            return
        except ValidationError as exc:
            # Bad options or settings: every pass would fail the same way, so even --loop stops.
            self.emit({"outcome": "error", "error": type(exc).__name__}, started, options)
            raise CommandError(f"{self.job}: {'; '.join(exc.messages)}", returncode=EXIT_USAGE) from exc
        except (DatabaseError, BuzzDeliveryError) as exc:
            logger.exception("%s failed", self.job)
            self.emit({"outcome": "error", "error": type(exc).__name__}, started, options)
            if raise_errors:
                raise CommandError(f"{self.job} failed: {exc}", returncode=EXIT_FAILED) from exc
            return
        self.emit(summary, started, options)

    def guarded_run(self, options: dict[str, Any]) -> dict[str, Any]:
        dry_run = options["dry_run"]
        if dry_run:  # writes nothing, so it needs (and takes) no lease
            counts, batches = self.run_chunk(options, options["max_batches"], True)
            return {"outcome": "ok", **counts, "batches": batches, "dry_run": True}
        lease = acquire_run_lease(self.job, options["lease_seconds"])
        if isinstance(lease, LeaseBusy):
            until = lease.lease_until.isoformat() if lease.lease_until else None
            self.progress(f"{self.job}: another run is active (holder {lease.holder}, until {until}); nothing done")
            return {"outcome": "busy", "reason": "another_run_active", "holder": lease.holder, "lease_until": until}
        self.progress(f"{self.job}: took the run lease as {lease.holder}")
        keeper = RunLeaseKeeper(lease, options["lease_seconds"]).start()
        try:
            counts, batches = self.work_in_chunks(options, keeper)
        finally:
            keeper.stop()
            if not release_run_lease(lease):
                logger.warning("%s: the run lease had already been taken over at release", self.job)
        return {"outcome": "stopped" if self.stop.is_set() else "ok", **counts, "batches": batches, "dry_run": False}

    def work_in_chunks(self, options: dict[str, Any], keeper: RunLeaseKeeper) -> tuple[dict[str, int], int]:
        """Call :meth:`run_chunk` with at most :data:`RENEW_EVERY_BATCHES` batches at a time,
        checking (and renewing) the lease in between, until the service runs out of work,
        ``--max-batches`` is spent, or a stop was requested. Raises :class:`LeaseLostError` when
        the keeper or the check finds the lease lost."""
        totals = self.empty_counts()
        batches = 0
        limit = options["max_batches"]
        while True:
            budget = RENEW_EVERY_BATCHES if limit is None else min(RENEW_EVERY_BATCHES, limit - batches)
            counts, ran = self.run_chunk(options, budget, False)
            batches += ran
            for key, value in counts.items():
                totals[key] = value if key in self.snapshot_counts else totals[key] + value
            self.progress(f"{self.job}: {ran} batches: " + " ".join(f"{k}={v}" for k, v in counts.items()), level=2)
            if keeper.lost or renew_run_lease(keeper.lease, options["lease_seconds"]) is None:
                keeper.mark_lost()
                raise LeaseLostError("the run lease lapsed and was taken over; stopped to avoid overlapping runs")
            if ran < budget or (limit is not None and batches >= limit) or self.stop.is_set():
                return totals, batches

    # --- output ---------------------------------------------------------------------

    def progress(self, message: str, level: int = 2) -> None:
        """A human line on stderr at verbosity >= ``level`` (stdout keeps the summary only)."""
        if self.verbosity >= level:
            self.stderr.write(message, style_func=lambda text: text)

    def emit(self, summary: dict[str, Any], started: float, options: dict[str, Any]) -> None:
        """Print the one summary line (key=value, or JSON with ``--json``) at verbosity >= 1."""
        summary = {**summary, "duration_ms": round((time.monotonic() - started) * 1000)}
        if not options["dry_run"]:
            self.record_run(summary)
        if self.verbosity < 1:
            return
        if options["json"]:
            line = json.dumps(summary, separators=(",", ":"))
        else:
            line = " ".join(f"{key}={self.kv_value(value)}" for key, value in summary.items())
        style = self.style.SUCCESS if summary["outcome"] in ("ok", "busy", "stopped") else self.style.ERROR
        self.stdout.write(style(line))

    def record_run(self, summary: dict[str, Any]) -> None:
        """Tally this pass for the metrics (``buzz_maintenance_runs_total``); a failure to do so
        is logged and never changes the run's outcome or exit code."""
        try:
            services.record_maintenance_run(self.job, summary)
        except (DatabaseError, BuzzDeliveryError) as exc:
            logger.warning("%s: could not record the run for the metrics: %s", self.job, exc)
            close_old_connections()

    @staticmethod
    def kv_value(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if value is None:
            return "none"
        return shlex.quote(str(value))


class Command(MaintenanceCommand):
    help = (
        "Reap lapsed leases fleet-wide: claimed deliveries whose lease ran out go back to pending "
        "(or end failed/expired), in bounded batches. Safe to run every minute from cron: a run "
        "that finds another one active prints outcome=busy and exits 0. Prints one summary line "
        "(reclaimed, exhausted, expired, skipped_fenced, skipped_busy, batches, dry_run, duration_ms). "
        "Exit codes: 0 done or busy, 1 failed, 2 bad arguments or settings (even with --loop), "
        "3 lease lost mid-run. SPEC section 8."
    )
    job = "reap_deliveries"
    supports_loop = True

    def empty_counts(self) -> dict[str, int]:
        return {"reclaimed": 0, "exhausted": 0, "expired": 0, "skipped_fenced": 0, "skipped_busy": 0}

    def guarded_run(self, options: dict[str, Any]) -> dict[str, Any]:
        """The reap, then (a run that held the guard) the live workers registry's pruning: rows
        of worker processes whose heartbeat stopped more than ``PRUNE_AFTER_SECONDS`` ago."""
        summary = super().guarded_run(options)
        if summary["outcome"] in ("ok", "stopped") and not options["dry_run"]:
            pruned = services.prune_stale_workers()
            if pruned:  # a progress line (-v 2), not an INFO log line: cron mails what reaches stderr
                self.progress(f"{self.job}: pruned {pruned} stale workers from the registry")
        return summary

    def run_chunk(self, options: dict[str, Any], max_batches: int | None, dry_run: bool) -> tuple[dict[str, int], int]:
        result = services.reap(batch_size=options["batch_size"], max_batches=max_batches, dry_run=dry_run)
        counts = {
            "reclaimed": result.reclaimed,
            "exhausted": result.exhausted,
            "expired": result.expired,
            "skipped_fenced": result.skipped_fenced,
            "skipped_busy": result.skipped_busy,
        }
        return counts, result.batches
