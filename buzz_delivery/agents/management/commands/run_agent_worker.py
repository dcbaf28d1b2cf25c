"""``manage.py run_agent_worker``: run agent handlers over claimed agent runs (SPEC 12 "Runtime").

Prints one JSON summary line to stdout at exit: ``{"claimed","completed","failed",
"compensated","compensation_failed","parked","lost","timed_out","abandoned","woken","accepted",
"accept_errors","renewed","db_errors","internal_errors"}``. A run's handler never stops the
worker: whatever it raises (``SystemExit`` included), returns or leaves on its connection ends
that run (a failure code on the run); ``db_errors`` counts polls the database failed (the worker
reconnects and goes on; with ``--exit-when-idle`` it stops, exit 0, once polls have not reached
the database for 5 s or three poll intervals);
``internal_errors`` (exit 1) counts loop threads the worker itself lost.

Acceptance (issue 29, on unless ``--no-accept``): the deliveries addressed to the ``--agent`` keys
in the served communities are claimed in batches and accepted into runs
(:mod:`buzz_delivery.agents.acceptance`), so no inbox of your own is needed; the event-loop
worker (``--async``) accepts the same way, on its pool's connections."""

from __future__ import annotations

import dataclasses
import logging
import signal
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError
from django.db import connection

from buzz_delivery.agents.conf import get_settings
from buzz_delivery.agents.loop_worker import (
    DEFAULT_CONNECTIONS,
    DEFAULT_IN_FLIGHT,
    MAX_CONNECTIONS,
    MAX_IN_FLIGHT,
    AsyncAgentWorker,
    AsyncWorkerConfig,
)
from buzz_delivery.agents.worker import MAX_POLL_SECONDS, WORKER_ID_MAX_CHARS, AgentWorker, WorkerConfig
from buzz_delivery.conf import get_settings as core_settings
from buzz_delivery.management.base import StrictOptionsCommand, ensure_console_logging, warn_missing_communities
from buzz_delivery.management.options import (
    int_in,
    lease_seconds_option,
    name_option,
    poll_seconds_option,
    positive_int,
    positive_seconds,
    pubkey_hex,
    uuid_value,
)
from buzz_delivery.models import WorkerKind
from buzz_delivery.services import validation as v
from buzz_delivery.services.leases import MAX_CLAIM_BATCH
from buzz_delivery.worker import load_handler
from buzz_delivery.worker.registry import Heartbeat
from buzz_delivery.worker.runtime import MAX_THREADS


class Command(StrictOptionsCommand):
    help = (
        "Claim agent runs of the given agents (--agent, repeatable) in the given communities "
        "(--community, repeatable; none = every active community with claimable runs) and run "
        "handler(ctx) -> output for each: ctx.call journals tool calls, ctx.request_approval parks "
        "the run. Deliveries addressed to the agents are accepted into runs first (claimed in batches, "
        "each accepted in its own transaction; --no-accept: leave them to an inbox of your own). "
        "Heartbeats in a background thread; LISTENs on buzz_agents to claim new runs at once. "
        "SIGTERM/SIGINT: stop claiming, let in-flight runs reach a resting point within "
        "--shutdown-grace, then give the rest up (their leases lapse). Exit codes: 0 clean stop, "
        "1 internal error, 2 bad arguments (an unimportable --handler included), 3 runs abandoned at the "
        "end of the grace. A --community that does not exist is logged (community_not_found, a warning) "
        "and waited for."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--handler", required=True, help="Dotted path to handler(ctx) -> output.")
        parser.add_argument("--agent", action="append", required=True, type=pubkey_hex, help="Agent key, 64 hex.")
        parser.add_argument("--community", action="append", default=[], type=uuid_value, help="Community UUID.")
        parser.add_argument(
            "--concurrency",
            type=int_in(1, MAX_THREADS),
            default=1,
            help=f"Handler threads (1..{MAX_THREADS}, as the other workers' threads; default 1).",
        )
        parser.add_argument(
            "--lease-seconds",
            type=lease_seconds_option,
            default=None,
            help="Run lease length in seconds (default: BUZZ_AGENTS['LEASE_SECONDS']; within the core's lease "
            "bounds, BUZZ_DELIVERY['MIN_LEASE_SECONDS']..['MAX_LEASE_SECONDS']).",
        )
        parser.add_argument(
            "--poll-seconds",
            "--poll-interval",  # the delivery, workflow and task workers' name for it
            dest="poll_seconds",
            type=poll_seconds_option,
            default=1.0,
            help=f"Sleep between empty polls (at most {MAX_POLL_SECONDS:g}; default 1). --poll-interval is "
            "the same option, as the other workers spell it.",
        )
        parser.add_argument("--max-runs", type=positive_int, default=None, help="Stop after this many claims.")
        parser.add_argument(
            "--exit-when-idle",
            action="store_true",
            help="Stop (exit 0) at the first poll that finds nothing to claim or accept, or once polls have "
            "not reached the database for 5 s; no LISTEN connection then. Not the other workers' --idle-exit "
            "SECONDS, which waits that long with nothing to do: this flag waits for nothing.",
        )
        parser.add_argument(
            "--worker-id",
            type=name_option(WORKER_ID_MAX_CHARS),
            default=None,
            help=f"Recorded on claims (1..{WORKER_ID_MAX_CHARS} characters, not blank; default host:pid).",
        )
        parser.add_argument(
            "--shutdown-grace", type=positive_seconds, default=30.0, help="Drain time after SIGTERM (default 30)."
        )
        parser.add_argument(
            "--handler-timeout",
            type=positive_seconds,
            default=None,
            help="Give a run up (stop renewing its lease) when its handler runs longer (default: no limit).",
        )
        parser.add_argument("--no-listen", action="store_true", help="Poll only (no LISTEN connection).")
        parser.add_argument(
            "--async",
            dest="use_async",
            action="store_true",
            help="The event-loop worker: async def handlers (plain ones run on threads), --in-flight runs "
            "at once on --connections database connections, journal writes batched per community.",
        )
        parser.add_argument(
            "--in-flight",
            type=int_in(1, MAX_IN_FLIGHT),
            default=None,
            help=f"--async: runs held at once (1..{MAX_IN_FLIGHT}, default {DEFAULT_IN_FLIGHT}).",
        )
        parser.add_argument(
            "--connections",
            type=int_in(1, MAX_CONNECTIONS),
            default=None,
            help=f"--async: the runtime's DB connections (1..{MAX_CONNECTIONS}, default {DEFAULT_CONNECTIONS}).",
        )
        parser.add_argument(
            "--no-accept",
            action="store_true",
            help="Do not accept the deliveries addressed to the agents into runs (an inbox of your own does).",
        )
        parser.add_argument(
            "--accept-batch",
            type=int_in(1, MAX_CLAIM_BATCH),
            default=50,
            help=f"Most deliveries claimed per agent and round (1..{MAX_CLAIM_BATCH}, default 50).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        ensure_console_logging()
        try:  # the option was checked when parsed; this checks the LEASE_SECONDS default
            lease = v.lease_seconds(options["lease_seconds"] or get_settings().lease_seconds)
        except ValidationError as exc:
            core = core_settings()
            raise CommandError(
                f"BUZZ_AGENTS['LEASE_SECONDS'] must be within {core.min_lease_seconds:g}.."
                f"{core.max_lease_seconds:g} seconds, got {get_settings().lease_seconds:g}; run manage.py check",
                returncode=2,
            ) from exc
        try:
            handler: Any = load_handler(options["handler"])
        except Exception as exc:
            raise CommandError(f"--handler: {exc}", returncode=2) from exc
        if options["community"]:
            warn_missing_communities(logging.getLogger("buzz_delivery.agents"), options["community"])
            # The check's connection is not the worker's: left open, it sat idle beside the
            # event-loop worker's --connections (one session over its budget) for the whole run.
            connection.close()
        registry = Heartbeat(WorkerKind.AGENT, "run_agent_worker", "")
        if options["use_async"]:
            worker: Any = AsyncAgentWorker(
                AsyncWorkerConfig(
                    handler=handler,
                    agents=options["agent"],
                    communities=options["community"],
                    in_flight=options["in_flight"] or DEFAULT_IN_FLIGHT,
                    connections=options["connections"] or DEFAULT_CONNECTIONS,
                    lease_seconds=lease,
                    poll_seconds=options["poll_seconds"],
                    max_runs=options["max_runs"],
                    exit_when_idle=options["exit_when_idle"],
                    worker_id=options["worker_id"] or "",  # "": host:pid (the config's default_worker_id)
                    shutdown_grace=options["shutdown_grace"],
                    handler_timeout=options["handler_timeout"],
                    listen=not options["no_listen"],
                    registry=registry.identity,
                    accept=not options["no_accept"],
                    accept_batch=options["accept_batch"],
                )
            )
        elif options["in_flight"] or options["connections"]:
            raise CommandError("--in-flight and --connections go with --async", returncode=2)
        else:
            worker = AgentWorker(
                WorkerConfig(
                    handler=handler,
                    agents=options["agent"],
                    communities=options["community"],
                    concurrency=options["concurrency"],
                    lease_seconds=lease,
                    poll_seconds=options["poll_seconds"],
                    max_runs=options["max_runs"],
                    exit_when_idle=options["exit_when_idle"],
                    worker_id=options["worker_id"] or "",  # "": host:pid (the config's default_worker_id)
                    shutdown_grace=options["shutdown_grace"],
                    handler_timeout=options["handler_timeout"],
                    listen=not options["no_listen"],
                    accept=not options["no_accept"],
                    accept_batch=options["accept_batch"],
                )
            )
        signal.signal(signal.SIGTERM, worker.stop)
        signal.signal(signal.SIGINT, worker.stop)
        communities = ",".join(str(c) for c in options["community"]) or "any"
        detail = f"worker_id={worker.config.worker_id} agents={len(options['agent'])} communities={communities}"
        if options["use_async"]:  # registered through the worker's own connections (its budget)
            registry.identity = dataclasses.replace(registry.identity, detail=detail)
            worker.config.registry = registry.identity
            counts = worker.run()
        else:
            with Heartbeat(WorkerKind.AGENT, "run_agent_worker", detail):
                counts = worker.run()
        self.stdout.write(worker.summary_line())
        if counts.get("internal_errors"):
            raise CommandError("stopped on an internal error", returncode=1)
        if counts.get("abandoned"):
            raise CommandError(f"{counts['abandoned']} runs abandoned at the end of the grace", returncode=3)
