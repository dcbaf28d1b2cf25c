"""``manage.py run_task_worker``: run the ``django.tasks`` tasks of a
:class:`~buzz_delivery.tasks.DeliveryBackend` (its queues are deliveries of its community).

It is ``run_delivery_worker`` with the task runner as its handler: the same fenced leases,
background renewal, batched settles, SIGTERM drain, live workers registry and summary line."""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError
from django.db import connection

from buzz_delivery.management.base import StrictOptionsCommand, ensure_console_logging, warn_missing_communities
from buzz_delivery.management.options import (
    int_in,
    lease_seconds_option,
    poll_seconds_option,
    positive_int,
    positive_seconds,
)
from buzz_delivery.models import WorkerKind
from buzz_delivery.services.validation import MAX_POLL_SECONDS
from buzz_delivery.tasks.checks import INSTALL_HINT
from buzz_delivery.worker import EXIT_OK, WorkerConfig, run_worker, summary_line
from buzz_delivery.worker.registry import Heartbeat

HELP = """Run the tasks enqueued through a buzz_delivery.tasks.DeliveryBackend: claim them from the inbox
(higher priority first, oldest first within one), run each task found in this process's registry
of @task functions (the installed apps' tasks modules and OPTIONS["MODULES"] are imported at
start; a stored path is never imported), record its return value or error, settle. Async tasks
run through async_to_sync (their sync_to_async calls in the handler thread). SIGTERM/SIGINT:
stop claiming, let running tasks finish within --shutdown-grace seconds and exit 0; past it
their leases are given up (the tasks run again elsewhere once the leases lapse) and the worker
exits 3. Prints run_delivery_worker's JSON summary line. A backend whose OPTIONS["COMMUNITY"]
names no community is logged (community_not_found, a warning) and waited for."""


class Command(StrictOptionsCommand):
    help = HELP

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--backend", default="default", help="Alias in TASKS (default: %(default)s).")
        parser.add_argument(
            "--queue",
            action="append",
            default=None,
            help="A queue to serve (repeatable; default: every queue of the backend's QUEUES).",
        )
        parser.add_argument("--concurrency", type=int_in(1, 256), default=1, help="Task threads (default 1).")
        parser.add_argument(
            "--poll-interval",
            type=poll_seconds_option,
            default=1.0,
            help=f"Seconds between polls (at most {MAX_POLL_SECONDS:g}; default 1).",
        )
        parser.add_argument("--max-tasks", type=positive_int, default=None, help="Stop after N tasks.")
        parser.add_argument(
            "--idle-exit",
            type=positive_seconds,
            default=None,
            help="Stop after S idle seconds (run_agent_worker's --exit-when-idle, a flag, stops at its first "
            "empty poll instead).",
        )
        parser.add_argument(
            "--task-timeout",
            type=positive_seconds,
            default=900.0,
            help="Seconds a task may run before its lease is no longer renewed (default: %(default)s).",
        )
        parser.add_argument("--name", default="tasks", help="This worker's name in its holder identity.")
        parser.add_argument(
            "--shutdown-grace",
            type=positive_seconds,
            default=30.0,
            help="Seconds a stopping worker waits for running tasks before it gives up their leases "
            "and exits 3 (default: %(default)s).",
        )
        parser.add_argument(
            "--lease-seconds",
            type=lease_seconds_option,
            default=None,
            help="Lease length in seconds: how soon a task of a worker that died runs again "
            "(default: BUZZ_DELIVERY['LEASE_SECONDS']; within the configured bounds).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:  # here, not at the top: --help works without the framework (Django 5.2, no backport)
            from buzz_delivery.tasks import compat, registry
            from buzz_delivery.tasks.backend import DeliveryBackend
            from buzz_delivery.tasks.runner import TaskRunner
        except ImportError as missing:
            what = f"No module named {missing.name!r}" if isinstance(missing, ModuleNotFoundError) else str(missing)
            raise CommandError(f"{what}: {INSTALL_HINT}", returncode=2) from None
        try:
            backend = compat.task_backends[options["backend"]]
        except Exception as exc:
            raise CommandError(f"--backend: {exc}", returncode=2) from exc
        if not isinstance(backend, DeliveryBackend):
            raise CommandError(
                f"--backend: TASKS[{options['backend']!r}] is a {type(backend).__module__}."
                f"{type(backend).__qualname__}, not a buzz_delivery.tasks.DeliveryBackend: set its "
                '"BACKEND" to "buzz_delivery.tasks.DeliveryBackend" and its OPTIONS["COMMUNITY"] (docs/tasks.md)',
                returncode=2,
            )
        queues = options["queue"] or backend.worker_queues()
        unknown = [q for q in queues if backend.queues and q not in backend.queues]
        if unknown:
            raise CommandError(f"--queue: not in the backend's QUEUES: {', '.join(unknown)}", returncode=2)
        try:
            shared = backend.shared_targets()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc), returncode=2) from None
        if shared:  # its claims would take, and fail, the other backend's tasks
            raise CommandError(f"--backend: {shared[0]}", returncode=2)
        registry.discover(backend.options.get("MODULES") or ())
        ensure_console_logging()
        if options["verbosity"] != 1:
            level = logging.WARNING if options["verbosity"] == 0 else logging.DEBUG
            logging.getLogger("buzz_delivery.worker").setLevel(level)
        community = backend.community_id
        warn_missing_communities(logging.getLogger("buzz_delivery.worker"), [community])
        first, *more = [backend.target_for(q) for q in queues]
        config = WorkerConfig(
            community_id=community,
            target_pubkey=first,
            extra_pairs=tuple((community, t) for t in more),
            handler=TaskRunner(backend),
            concurrency=options["concurrency"],
            poll_interval=options["poll_interval"],
            max_deliveries=options["max_tasks"],
            idle_exit=options["idle_exit"],
            handler_timeout=options["task_timeout"],
            name=options["name"],
            shutdown_grace=options["shutdown_grace"],
            lease_seconds=options["lease_seconds"],
        )
        detail = f"community={community} backend={backend.alias} queues={','.join(queues)}"
        try:
            with Heartbeat(WorkerKind.DELIVERY, "run_task_worker", detail):
                summary = run_worker(config)
        finally:
            connection.close()
        self.stdout.write(summary_line(summary))
        if summary.exit_code != EXIT_OK:
            raise CommandError(f"worker stopped: reason={summary.reason}", returncode=summary.exit_code)
