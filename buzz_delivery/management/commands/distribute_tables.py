"""``manage.py distribute_tables``: distribute the tables on a Citus coordinator (SPEC section 15).

Idempotent. Exit codes: 0 done (or nothing left to do); 2 bad arguments; 3 Citus is not
installed in the database (nothing changed). See docs/scale-out.md.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from buzz_delivery import scaleout
from buzz_delivery.management.base import StrictOptionsCommand
from buzz_delivery.management.options import int_in

NO_CITUS = 3


class Command(StrictOptionsCommand):
    help = (
        "On a Citus coordinator: distribute buzz_delivery_community by id and every "
        "community-scoped table by community_id, colocated with it, and delegate the plan-cached "
        "lease functions to the community's worker (one transaction; running it again distributes "
        "nothing twice). Run it after every migrate."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", default="default", help="Database alias (default: default).")
        parser.add_argument(
            "--shard-count",
            type=int_in(1, 64_000),
            default=None,
            help="Shards of the colocation group (default: Citus's citus.shard_count).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            result = scaleout.distribute_tables(options["database"], shard_count=options["shard_count"])
        except scaleout.CitusNotAvailable as exc:
            raise CommandError(str(exc), returncode=NO_CITUS) from exc
        for table in result.distributed:
            self.stdout.write(f"distributed {table}")
        for table in result.already:
            self.stdout.write(f"already distributed {table}")
        for function in result.delegated:
            self.stdout.write(f"delegated {function}")
        self.stdout.write(
            f"{len(result.distributed)} distributed now, {len(result.already)} already; "
            f"{result.foreign_keys} foreign keys recreated; {len(result.delegated)} functions delegated"
        )
