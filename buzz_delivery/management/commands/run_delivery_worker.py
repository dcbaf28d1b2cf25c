"""``manage.py run_delivery_worker``: the agent side for one community and target (SPEC section 7).

Prints one JSON summary line to stdout at exit:
``{"claimed":N,"finished":N,"failed":N,"retried":N,"lease_lost":N,"renewed":N}``; logs every
transition on logger ``buzz_delivery.worker`` (first words ``claimed``, ``renewed``,
``settled``, ``lease_lost``, ``handler_error``, ``stopping``, ``stopped``; also ``listening``
and ``db_unavailable``).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError, DjangoHelpFormatter
from django.db import connection

from buzz_delivery.conf import get_settings
from buzz_delivery.management.base import StrictOptionsCommand
from buzz_delivery.management.options import fraction, int_in, positive_int, positive_seconds, pubkey_hex, uuid_value
from buzz_delivery.services import validation as v
from buzz_delivery.worker import WorkerConfig, load_handler, run_worker, summary_line

HELP = """Run the agent side for one community and target: claim the oldest pending deliveries
(woken early by NOTIFY hints), call the handler, renew each lease in the background, settle.

The handler is a dotted path to handler(delivery: WorkflowAgentDelivery) -> object. Return =
finished; raise buzz_delivery.worker.PermanentFailure (or an exception class with
permanent = True) = failed (failure_code = class name); any other exception = retry.
SIGTERM/SIGINT: stop claiming, let in-flight handlers finish and settle, exit 0. Prints one
JSON summary line: {"claimed","finished","failed","retried","lease_lost","renewed"}."""


class _HelpFormatter(DjangoHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Django's option order, with the description's line breaks kept."""


class Command(StrictOptionsCommand):
    help = HELP

    def add_arguments(self, parser: Any) -> None:
        parser.formatter_class = _HelpFormatter
        parser.add_argument("--community", required=True, type=uuid_value, help="Community UUID.")
        parser.add_argument("--target", required=True, type=pubkey_hex, help="Target public key, 64 hex characters.")
        parser.add_argument(
            "--handler", required=True, help="Dotted path of the handler, e.g. myapp.agents:handle_delivery."
        )
        parser.add_argument(
            "--concurrency", type=int_in(1, 256), default=1, help="Handler threads (1..256; default 1)."
        )
        parser.add_argument(
            "--lease-seconds",
            type=positive_seconds,
            default=None,
            help="Lease length in seconds (default: BUZZ_DELIVERY['LEASE_SECONDS']; within the configured bounds).",
        )
        parser.add_argument(
            "--batch-size",
            type=int_in(1, 1000),
            default=None,
            help="Most deliveries claimed per round trip (1..1000; default: --concurrency). "
            "Never more than the idle handler threads.",
        )
        parser.add_argument(
            "--poll-interval", type=positive_seconds, default=1.0, help="Seconds between polls when idle (default 1)."
        )
        parser.add_argument(
            "--max-deliveries", type=positive_int, default=None, help="Stop after claiming and settling N deliveries."
        )
        parser.add_argument(
            "--idle-exit", type=positive_seconds, default=None, help="Stop after S seconds with nothing to do."
        )
        parser.add_argument(
            "--renew-fraction",
            type=fraction,
            default=1 / 3,
            help="Renew each lease after this fraction of its length (0 < F < 1; default 1/3).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            lease_seconds = v.lease_seconds(options["lease_seconds"])
        except ValidationError as exc:
            conf = get_settings()
            raise CommandError(
                f"--lease-seconds must be within {conf.min_lease_seconds:g}..{conf.max_lease_seconds:g} "
                f"(BUZZ_DELIVERY bounds), got {options['lease_seconds'] or conf.lease_seconds:g}"
            ) from exc
        try:
            handler = load_handler(options["handler"])
        except ValueError as exc:
            raise CommandError(f"--handler: {exc}") from exc
        verbosity = options["verbosity"]
        if verbosity != 1:
            logging.getLogger("buzz_delivery.worker").setLevel(logging.WARNING if verbosity == 0 else logging.DEBUG)
        config = WorkerConfig(
            community_id=options["community"],
            target_pubkey=options["target"],
            handler=handler,
            concurrency=options["concurrency"],
            lease_seconds=lease_seconds,
            batch_size=options["batch_size"],
            poll_interval=options["poll_interval"],
            max_deliveries=options["max_deliveries"],
            idle_exit=options["idle_exit"],
            renew_fraction=options["renew_fraction"],
        )
        try:
            summary = run_worker(config)
        finally:
            connection.close()
        self.stdout.write(summary_line(summary))
