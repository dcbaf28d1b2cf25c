"""``manage.py run_delivery_worker``: the agent side for one community and target, or for
several (community, target) pairs in one process (SPEC section 7).

Prints one JSON summary line to stdout at exit:
``{"claimed":N,...,"reason":"SIGTERM","exit_code":0}`` and exits with ``exit_code``; logs on
logger ``buzz_delivery.worker``: one INFO line per claim batch and per settle batch (``claimed
n=``, ``settled n=``), one DEBUG line per delivery and transition with ``-v 2`` (``claimed
delivery=``, ``renewed delivery=``, ``settled delivery=``), and always the lines of what went
wrong (``lease_lost``, ``handler_error``, ``settle_error``, ``db_unavailable``), ``started``,
``listening``, ``stopping`` and ``stopped``. Without a ``LOGGING`` config for ``buzz_delivery``
these go to stderr at INFO (:func:`~buzz_delivery.management.base.ensure_console_logging`).
"""

from __future__ import annotations

import argparse
import logging
import textwrap
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError, DjangoHelpFormatter
from django.db import connection

from buzz_delivery.conf import get_settings
from buzz_delivery.management.base import StrictOptionsCommand, ensure_console_logging, warn_missing_communities
from buzz_delivery.management.options import (
    community_target,
    fraction,
    hint_stagger_option,
    int_in,
    lease_seconds_option,
    poll_seconds_option,
    positive_int,
    positive_seconds,
    pubkey_hex,
    uuid_value,
)
from buzz_delivery.models import WorkerKind
from buzz_delivery.services import validation as v
from buzz_delivery.services.validation import MAX_POLL_SECONDS
from buzz_delivery.worker import EXIT_OK, WorkerConfig, load_handler, run_worker, summary_line
from buzz_delivery.worker.registry import Heartbeat
from buzz_delivery.worker.runtime import DEFAULT_HINT_STAGGER, SUMMARY_KEYS

HELP_TEMPLATE = """Run the agent side for a community and target: claim the oldest pending deliveries
(woken early by NOTIFY hints), call the handler, renew each lease in the background, settle.
One process may serve several targets (--target given again) and pairs of other communities
(--pair COMMUNITY:TARGET), with the same handler threads and the same connections: every
--poll-interval a round claims from every pair in turn, one statement per pair; between rounds,
while polls come back full, only those pairs and the pairs a hint named are polled again.

The handler is a dotted path to handler(delivery: WorkflowAgentDelivery) -> object. Return =
finished; raise buzz_delivery.worker.PermanentFailure (or an exception class with
permanent = True) = failed (failure_code = class name); any other exception = retry.
SIGTERM/SIGINT: stop claiming, let in-flight handlers finish and settle within
--shutdown-grace seconds, exit 0; past the grace (or at a second signal) the in-flight leases
are given up (no longer renewed, so they lapse) and the worker exits 3. A handler past
--handler-timeout (or its delivery's expires_at) is no longer renewed and its result dropped.

{summary}"""
# Every key the summary line prints, in its order (summary_line): the counts, then three more.
PRINTED_KEYS = (*SUMMARY_KEYS, "pending_retry", "reason", "exit_code")

SUMMARY_HELP = (
    "Prints one JSON summary line: {" + ", ".join(f'"{key}"' for key in PRINTED_KEYS) + "} (pending_retry: "
    "deliveries waiting out a retry backoff at exit). Logs a started line (and a community_not_found warning "
    "for each named community that does not exist yet: the worker waits for it), one line per claim batch "
    "and per settle batch (to stderr without a LOGGING config); -v 2 adds one per delivery and the traceback "
    "of each handler error."
)
HELP = (
    HELP_TEMPLATE.format(summary=textwrap.fill(SUMMARY_HELP, 95, break_on_hyphens=False))
    + """
Exit codes: 0 clean stop; 1 stopped on an internal error (reason says which); 2 bad
arguments (an unimportable --handler included); 3 stopped with in-flight leases given up
(shutdown grace, or every handler hung)."""
)

MAX_LISTED_PAIRS = 10  # pairs named in the live workers registry's detail line


class _HelpFormatter(DjangoHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Django's option order, with the description's line breaks kept."""


class Command(StrictOptionsCommand):
    help = HELP

    def add_arguments(self, parser: Any) -> None:
        parser.formatter_class = _HelpFormatter
        parser.add_argument("--community", required=True, type=uuid_value, help="Community UUID.")
        parser.add_argument(
            "--target",
            required=True,
            type=pubkey_hex,
            action="append",
            help="Target public key, 64 hex characters; give it again for more targets of --community.",
        )
        parser.add_argument(
            "--pair",
            type=community_target,
            action="append",
            default=[],
            metavar="COMMUNITY:TARGET",
            help="One more (community, target) pair to serve, COMMUNITY_UUID:TARGET_HEX (repeatable).",
        )
        parser.add_argument(
            "--handler", required=True, help="Dotted path of the handler, e.g. myapp.agents:handle_delivery."
        )
        parser.add_argument(
            "--concurrency",
            type=int_in(1, 10_000),
            default=1,
            help="Handlers in flight: threads for a plain handler (1..256), tasks on one event loop for an "
            "async def handler (1..10000); default 1.",
        )
        parser.add_argument(
            "--lease-seconds",
            type=lease_seconds_option,
            default=None,
            help="Lease length in seconds (default: BUZZ_DELIVERY['LEASE_SECONDS']; within the configured bounds).",
        )
        parser.add_argument(
            "--handler-timeout",
            type=positive_seconds,
            default=900.0,
            help="Seconds a handler may run before its lease is no longer renewed and its result is dropped "
            "(default: %(default)s; never past the delivery's expires_at).",
        )
        parser.add_argument(
            "--name",
            default="worker",
            help="This worker's name in the holder identity host:pid:NAME that its claims record "
            "(default: %(default)s).",
        )
        parser.add_argument(
            "--shutdown-grace",
            type=positive_seconds,
            default=30.0,
            help="Seconds a stopping worker waits for in-flight handlers before it gives up their leases "
            "and exits 3 (default: %(default)s).",
        )
        parser.add_argument(
            "--batch-size",
            type=int_in(1, 1000),
            default=None,
            help="Most deliveries claimed per round trip, and most results settled per statement "
            "(1..1000; default: the larger of --concurrency and 50). Claims beyond the idle handler "
            "threads wait in a local queue only while recent handler run times say they start within "
            "a tenth of the lease.",
        )
        parser.add_argument(
            "--poll-interval",
            type=poll_seconds_option,
            default=1.0,
            help=f"Seconds between polls when idle (at most {MAX_POLL_SECONDS:g}; default 1).",
        )
        parser.add_argument(
            "--max-deliveries", type=positive_int, default=None, help="Stop after claiming and settling N deliveries."
        )
        parser.add_argument(
            "--idle-exit",
            type=positive_seconds,
            default=None,
            help="Stop after S seconds with nothing to do (run_agent_worker's --exit-when-idle, a flag, stops at "
            "its first empty poll instead).",
        )
        parser.add_argument(
            "--rate-key",
            default=None,
            help="A key of BUZZ_DELIVERY['RATE_LIMITS']: each community's claims take its units first (one "
            "per delivery), so the workers sharing it claim at most its limit per period.",
        )
        parser.add_argument(
            "--hint-stagger",
            type=hint_stagger_option,
            default=DEFAULT_HINT_STAGGER,
            help="Seconds (0..10; default 0 = off) a pair's wake hints wait before they are claimed while this "
            "worker's last hinted claim of that pair came back empty (another process took the row): "
            "one process takes a trickle at once, the others claim a window of hints with one statement "
            "(docs/performance.md#hint-fan-out).",
        )
        parser.add_argument(
            "--renew-fraction",
            type=fraction,
            default=1 / 3,
            help="Renew each lease after this fraction of its length (0 < F < 1; default 1/3).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:  # the option was checked when parsed; this checks the LEASE_SECONDS default
            lease_seconds = v.lease_seconds(options["lease_seconds"])
        except ValidationError as exc:
            conf = get_settings()
            raise CommandError(
                f"BUZZ_DELIVERY['LEASE_SECONDS'] must be within {conf.min_lease_seconds:g}.."
                f"{conf.max_lease_seconds:g}, got {conf.lease_seconds!r}; run manage.py check",
                returncode=2,
            ) from exc
        try:
            handler = load_handler(options["handler"])
        except ValueError as exc:
            raise CommandError(f"--handler: {exc}", returncode=2) from exc
        verbosity = options["verbosity"]
        ensure_console_logging()
        if verbosity != 1:
            logging.getLogger("buzz_delivery.worker").setLevel(logging.WARNING if verbosity == 0 else logging.DEBUG)
        first, *more_targets = options["target"]
        try:
            config = WorkerConfig(
                community_id=options["community"],
                target_pubkey=first,
                extra_pairs=tuple((options["community"], t) for t in more_targets) + tuple(options["pair"]),
                handler=handler,
                concurrency=options["concurrency"],
                lease_seconds=lease_seconds,
                batch_size=options["batch_size"],
                poll_interval=options["poll_interval"],
                max_deliveries=options["max_deliveries"],
                idle_exit=options["idle_exit"],
                renew_fraction=options["renew_fraction"],
                hint_stagger=options["hint_stagger"],
                handler_timeout=options["handler_timeout"],
                shutdown_grace=options["shutdown_grace"],
                name=options["name"],
                rate_key=options["rate_key"],
            )
        except ValidationError as exc:  # --concurrency above 256 with a plain (threaded) handler
            if "rate_key" in getattr(exc, "message_dict", {}):
                raise CommandError(f"--rate-key: {exc.message_dict['rate_key'][0]}", returncode=2) from exc
            raise CommandError(
                f"--concurrency: {options['concurrency']} handler threads is too many; up to 256 threads for "
                "a plain handler, up to 10000 tasks for an async def handler",
                returncode=2,
            ) from exc
        warn_missing_communities(logging.getLogger("buzz_delivery.worker"), (c for c, _ in config.pairs))
        detail = f"community={config.community_id} target={config.target_pubkey.hex()} handler={options['handler']}"
        if len(config.pairs) > 1:  # every pair, so an operator can find who serves a community
            more = " ".join(f"{c}:{t.hex()[:16]}" for c, t in config.pairs[1:MAX_LISTED_PAIRS])
            rest = len(config.pairs) - MAX_LISTED_PAIRS
            detail += f" pairs={len(config.pairs)} also={more}" + (f" (+{rest} more)" if rest > 0 else "")
        try:
            with Heartbeat(WorkerKind.DELIVERY, "run_delivery_worker", detail):
                summary = run_worker(config)
        finally:
            connection.close()
        self.stdout.write(summary_line(summary))
        if summary.exit_code != EXIT_OK:
            raise CommandError(
                f"worker stopped: reason={summary.reason} abandoned={summary['abandoned']}",
                returncode=summary.exit_code,
            )
