"""``manage.py prune_deliveries --older-than 30d``: delete old terminal deliveries (SPEC section 8).

Retention, by example::

    prune_deliveries --older-than 30d                        # finished, failed, expired after 30 days
    prune_deliveries --older-than 30d --retain failed=90d    # ... but keep failed rows 90 days
    prune_deliveries --older-than 7d --status finished       # only finished rows, after 7 days

``--status`` (repeatable) picks which terminal statuses are pruned (default: all three);
``--retain STATUS=AGE`` (repeatable) gives one of them its own age instead of
``--older-than``. Ages are a whole number and a unit: ``3600s``, ``90m``, ``12h``, ``30d``.
Age is judged against ``finished_at`` with the database clock. Pending and claimed rows are
never deleted; rows of a community that is not active are skipped and counted.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
from typing import Any

from django.core.management.base import CommandError, CommandParser

from buzz_delivery.management.commands.reap_deliveries import MaintenanceCommand
from buzz_delivery.services.pruner import PRUNABLE_STATUSES, prune_deliveries

AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
AGE_PATTERN = re.compile(r"^\s*(\d+)\s*([smhd])\s*$")
MAX_AGE = dt.timedelta(days=36_500)


def parse_age(text: str) -> dt.timedelta:
    """argparse ``type=``: ``"30d"``, ``"12h"``, ``"90m"`` or ``"3600s"`` -> a positive timedelta."""
    match = AGE_PATTERN.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age like 30d, 12h, 90m or 3600s")
    age = dt.timedelta(seconds=int(match[1]) * AGE_UNITS[match[2]])
    if not dt.timedelta(0) < age <= MAX_AGE:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0s and at most {MAX_AGE.days}d")
    return age


def parse_retention(text: str) -> tuple[str, dt.timedelta]:
    """argparse ``type=``: ``"failed=90d"`` -> ``("failed", timedelta(days=90))``."""
    status, sep, age = text.partition("=")
    status = status.strip()
    if not sep or status not in PRUNABLE_STATUSES:
        statuses = ", ".join(PRUNABLE_STATUSES)
        raise argparse.ArgumentTypeError(f"{text!r} is not STATUS=AGE with STATUS one of {statuses}")
    return status, parse_age(age)


class Command(MaintenanceCommand):
    help = (
        "Delete terminal deliveries (finished, failed, expired) whose finished_at is older than "
        "--older-than (database clock), in batches, each its own short transaction. --status picks the "
        "statuses (default all), --retain STATUS=AGE gives one status its own age. Rows of a community "
        "that is not active are skipped and counted (skipped_fenced). Prints one summary line. "
        "Exit codes: 0 done or another run active, 1 failed, 2 bad arguments or settings, 3 lease lost mid-run."
    )
    job = "prune_deliveries"

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than",
            type=parse_age,
            required=True,
            metavar="AGE",
            help="Minimum age since finished_at, e.g. 30d, 12h, 90m, 3600s.",
        )
        parser.add_argument(
            "--status",
            action="append",
            choices=PRUNABLE_STATUSES,
            dest="statuses",
            help="A terminal status to prune (repeatable; default: all of them).",
        )
        parser.add_argument(
            "--retain",
            action="append",
            type=parse_retention,
            default=[],
            metavar="STATUS=AGE",
            help="Keep rows of STATUS for AGE instead of --older-than, e.g. failed=90d (repeatable).",
        )
        super().add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        statuses = options["statuses"] or list(PRUNABLE_STATUSES)
        retention = {status: options["older_than"] for status in dict.fromkeys(statuses)}
        for status, age in options["retain"]:
            if status not in retention:
                raise CommandError(f"--retain {status}=...: {status} is not among the pruned statuses", returncode=2)
            retention[status] = age
        options["retention"] = retention
        super().handle(*args, **options)

    def empty_counts(self) -> dict[str, int]:
        return {"deleted": 0, **{status: 0 for status in PRUNABLE_STATUSES}, "skipped_fenced": 0}

    def run_chunk(self, options: dict[str, Any], max_batches: int | None, dry_run: bool) -> tuple[dict[str, int], int]:
        result = prune_deliveries(
            options["retention"], batch_size=options["batch_size"], max_batches=max_batches, dry_run=dry_run
        )
        counts = {
            "deleted": result.total,
            **{status: result.deleted.get(status, 0) for status in PRUNABLE_STATUSES},
            "skipped_fenced": result.skipped_fenced,
        }
        return counts, result.batches
