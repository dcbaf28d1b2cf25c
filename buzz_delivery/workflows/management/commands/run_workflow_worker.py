"""``manage.py run_workflow_worker``: the workflow orchestrator (SPEC section 11).

Claims ready steps of one community (``--community``) or of all (``--all``), runs them with
lease renewal, wakes on NOTIFY with a polling fallback, drains on SIGTERM/SIGINT. Logs the
function names it knows at start, and a ``community_not_found`` warning when ``--community``
names no community (yet: the worker starts all the same and waits for it). Prints one JSON
summary line at exit (:data:`PRINTED_KEYS`; ``not_registered``: ``{function name: steps}`` that
named a function this worker does not have; ``awaited``: ``async def`` function steps awaited on
the event loop, ``--async-concurrency`` at once). Exit codes: 0 clean stop, 1 internal error,
2 bad arguments, 3 in-flight steps abandoned after the grace.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError
from django.db import connection

from buzz_delivery.management.base import StrictOptionsCommand, ensure_console_logging, warn_missing_communities
from buzz_delivery.management.options import (
    int_in,
    lease_seconds_option,
    poll_seconds_option,
    positive_int,
    positive_seconds,
    uuid_value,
)
from buzz_delivery.models import WorkerKind
from buzz_delivery.services import validation as v
from buzz_delivery.services.validation import MAX_POLL_SECONDS
from buzz_delivery.worker.registry import Heartbeat
from buzz_delivery.workflows.conf import get_settings
from buzz_delivery.workflows.orchestrator import (
    DEFAULT_ASYNC_CONCURRENCY,
    DEFAULT_BATCH_SIZE,
    EXIT_OK,
    MAX_ASYNC_CONCURRENCY,
    SUMMARY_KEYS,
    OrchestratorConfig,
    run_orchestrator,
    summary_line,
)
from buzz_delivery.workflows.registry import registered_names

# Every key the summary line prints, in its order (Orchestrator.summary): the counts, then three more.
PRINTED_KEYS = (*SUMMARY_KEYS, "not_registered", "reason", "exit_code")
HELP = (
    "Run the workflow orchestrator: claim the ready steps of one community (--community) or of all (--all), run "
    "them with lease renewal, wake on NOTIFY with a polling fallback, drain on SIGTERM/SIGINT. Logs the function "
    "names it knows at start, and a community_not_found warning when --community names no community (yet: the "
    "worker starts all the same and waits for it). Prints one JSON summary line at exit: {"
    + ", ".join(f'"{key}"' for key in PRINTED_KEYS)
    + "} (not_registered: {function name: steps} that named a function this worker does not have; awaited: "
    "async def function steps awaited on the event loop, --async-concurrency at once). Exit codes: 0 clean "
    "stop, 1 internal error, 2 bad arguments, 3 in-flight steps abandoned after the grace."
)


class Command(StrictOptionsCommand):
    help = HELP

    def add_arguments(self, parser: Any) -> None:
        scope = parser.add_mutually_exclusive_group(required=True)
        scope.add_argument("--community", type=uuid_value, help="Run the steps of this community only.")
        scope.add_argument("--all", action="store_true", help="Run the steps of every community.")
        parser.add_argument("--concurrency", type=int_in(1, 256), default=4, help="Step threads (default 4).")
        parser.add_argument(
            "--async-concurrency",
            type=int_in(1, MAX_ASYNC_CONCURRENCY),
            default=DEFAULT_ASYNC_CONCURRENCY,
            help=(
                "async def function steps awaited at once on the event loop, with no database connection each "
                f"(default {DEFAULT_ASYNC_CONCURRENCY})."
            ),
        )
        parser.add_argument(
            "--batch-size",
            type=int_in(1, 1000),
            default=None,
            help=f"Most steps per claim and per completion statement (default max(concurrency, {DEFAULT_BATCH_SIZE})).",
        )
        parser.add_argument(
            "--lease-seconds",
            type=lease_seconds_option,
            default=None,
            help="Step lease length (default BUZZ_WORKFLOWS['LEASE_SECONDS']).",
        )
        parser.add_argument(
            "--poll-interval",
            type=poll_seconds_option,
            default=1.0,
            help=f"Seconds between polls when idle (at most {MAX_POLL_SECONDS:g}; default 1).",
        )
        parser.add_argument(
            "--idle-exit",
            type=positive_seconds,
            default=None,
            help="Stop after S seconds with nothing to do (run_agent_worker's --exit-when-idle, a flag, stops at "
            "its first empty poll instead).",
        )
        parser.add_argument("--max-steps", type=positive_int, default=None, help="Stop after claiming N steps.")
        parser.add_argument(
            "--shutdown-grace",
            type=positive_seconds,
            default=30.0,
            help="Seconds to let in-flight steps finish when stopping (default 30).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        lease = options["lease_seconds"]
        if lease is None:  # --lease-seconds was checked when parsed; the setting is checked here
            try:
                lease = v.lease_seconds(get_settings().lease_seconds)
            except ValidationError as exc:
                raise CommandError(
                    f"BUZZ_WORKFLOWS['LEASE_SECONDS'] {exc.messages[0].removeprefix('lease_seconds: ')}", returncode=2
                ) from None
        ensure_console_logging()
        if options["verbosity"] != 1:
            logging.getLogger("buzz_delivery.workflows").setLevel(
                logging.WARNING if options["verbosity"] == 0 else logging.DEBUG
            )
        names = registered_names()
        if options["community"] is not None:
            warn_missing_communities(logging.getLogger("buzz_delivery.workflows"), [options["community"]])
        logging.getLogger("buzz_delivery.workflows").info(
            "functions_registered count=%d names=%s", len(names), ",".join(names[:50])
        )
        config = OrchestratorConfig(
            community_id=options["community"],
            concurrency=options["concurrency"],
            async_concurrency=options["async_concurrency"],
            batch_size=options["batch_size"],
            lease_seconds=lease,
            poll_interval=options["poll_interval"],
            idle_exit=options["idle_exit"],
            max_steps=options["max_steps"],
            shutdown_grace=options["shutdown_grace"],
        )
        try:
            with Heartbeat(WorkerKind.WORKFLOW, "run_workflow_worker", f"community={config.community_id or 'all'}"):
                summary = run_orchestrator(config)
        finally:
            connection.close()
        self.stdout.write(summary_line(summary))
        if summary["exit_code"] != EXIT_OK:
            raise CommandError(f"workflow worker stopped: reason={summary['reason']}", returncode=summary["exit_code"])
