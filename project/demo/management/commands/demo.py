"""``manage.py demo``: a realistic run of buzz_delivery on this machine, with a report.

Creates communities with agents and workflows, commits deliveries as workflow runs do, runs one
real ``run_delivery_worker`` process per agent plus a stuck one that is killed with SIGKILL
mid-lease, reaps every second, fences one community midway, stops the workers with SIGTERM and
checks that every delivery of a healthy community was settled exactly once. Then the second act
(:mod:`project.demo.system`): workflows, agent runs, approvals, compensation, a cancel, the
gateway, killed workflow, agent and remote workers, a fenced community, with per-layer checks.
The orchestration lives in :mod:`project.demo.scenario`; this command parses options and prints.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path
from typing import IO, Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from rich.console import Console

from project.demo.render import print_report
from project.demo.scenario import DemoError, Scenario, ScenarioOptions


def python_command() -> str:
    """How to run ``manage.py`` with this interpreter, as the user would type it: the path of
    ``sys.executable`` relative to the current folder when it lies under it (the README's
    ``.venv/bin/python``), else its absolute path."""
    executable = Path(sys.executable)
    try:
        shown = str(executable.relative_to(Path.cwd()))
    except ValueError:
        shown = str(executable)
    return f"{shown} manage.py"


def make_console(stream: IO[str]) -> Console:
    """A rich console on ``stream``: the terminal's width on a terminal; elsewhere (a pipe, a
    log file) tables 120 columns wide and text never wrapped, so no sentence breaks midway."""
    if bool(getattr(stream, "isatty", lambda: False)()):
        return Console(file=stream, highlight=False)
    return Console(file=stream, width=120, soft_wrap=True, highlight=False)


def _at_least(low: float, kind: type = int) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    return parse


class Command(BaseCommand):
    help = (
        "Run buzz_delivery on a realistic workload with real worker processes, a killed worker, the "
        "reaper and a fenced community; then workflows, agent runs (in-process and through the "
        "gateway), approvals, a compensation, a cancel, a fenced community and killed workflow, agent "
        "and remote workers; print a report and check exactly-once per layer (exit 1 if a check "
        "fails). About two minutes."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--deliveries", type=_at_least(1), default=3000, help="Deliveries to commit (default 3000)."
        )
        parser.add_argument("--communities", type=_at_least(1), default=4, help="Communities (default 4).")
        parser.add_argument(
            "--agents", type=_at_least(1), default=3, help="Agents (targets) per community (default 3)."
        )
        parser.add_argument(
            "--rate", type=_at_least(1.0, float), default=150.0, help="Deliveries committed per second (default 150)."
        )
        parser.add_argument(
            "--concurrency", type=_at_least(1), default=2, help="Handler threads per worker (default 2)."
        )
        parser.add_argument(
            "--lease-seconds", type=_at_least(1.0, float), default=4.0, help="Workers' lease length (default 4 s)."
        )
        parser.add_argument(
            "--timeout",
            type=_at_least(10.0, float),
            default=180.0,
            help="Give up after this many seconds (default 180).",
        )
        parser.add_argument(
            "--no-system",
            action="store_true",
            help="Skip the second act (workflows, agent runs, approvals): the delivery layer only.",
        )
        parser.add_argument("--seed", type=int, default=None, help="Seed of the workload's random choices.")
        parser.add_argument(
            "--create-superuser",
            action="store_true",
            help="Create the admin user 'admin' with a random password (printed) if it does not exist.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # rich writes whole rendered lines itself: give it the stream under Django's OutputWrapper.
        stream: IO[str] = getattr(self.stdout, "_out", sys.stdout)
        console = make_console(stream)
        scenario = Scenario(
            ScenarioOptions(
                deliveries=options["deliveries"],
                communities=options["communities"],
                agents=options["agents"],
                rate=options["rate"],
                concurrency=options["concurrency"],
                lease_seconds=options["lease_seconds"],
                timeout=options["timeout"],
                seed=options["seed"],
                system=not options["no_system"],
            ),
            console=console,
            verbosity=options["verbosity"],
        )
        self._tenant_isolation_on(console)
        try:
            report = scenario.run()
        except DemoError as exc:
            raise CommandError(str(exc), returncode=2) from exc
        print_report(console, report)
        self._admin_hint(console, options["create_superuser"])
        if not report["passed"]:
            checks = report["checks"] + report.get("system", {}).get("checks", [])
            failed = [c["name"] for c in checks if not c["passed"]]
            raise CommandError(f"the exactly-once check failed: {'; '.join(failed)}", returncode=1)

    def _tenant_isolation_on(self, console: Console) -> None:
        """The demo runs with row-level security on (docs/tenant-isolation.md): switch it on if
        it is off, except on Citus, where it is not supported."""
        from django.db import connection, transaction

        from buzz_delivery import isolation
        from buzz_delivery.services import tenancy

        with connection.cursor() as cursor:
            if isolation.enforced(cursor) or isolation.is_citus(cursor):
                return
        with transaction.atomic(), connection.cursor() as cursor:
            states = isolation.switch(cursor, on=True)
        tenancy.forget()
        console.print(f"tenant isolation: row-level security switched on for {len(states)} tables")

    def _admin_hint(self, console: Console, create: bool) -> None:
        user_model = get_user_model()
        manage = python_command()
        console.print(
            f"\nBrowse the deliveries in the admin: run [bold]{manage} runserver[/bold], then open "
            "http://127.0.0.1:8000/admin/"
        )
        if create and not user_model._default_manager.filter(username="admin").exists():
            password = secrets.token_urlsafe(12)
            user_model._default_manager.create_superuser("admin", "", password)  # type: ignore[attr-defined]
            console.print(f"Log in as [bold]admin[/bold] with password [bold]{password}[/bold] (shown once).")
        elif create:
            console.print("The user 'admin' exists already; log in with its password.")
        else:
            console.print(
                f"To log in, create a user: [bold]{manage} createsuperuser[/bold] "
                "(or run the demo with --create-superuser)."
            )
