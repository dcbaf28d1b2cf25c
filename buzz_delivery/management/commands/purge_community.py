"""``manage.py purge_community ID``: empty a fenced community and mark it tombstone (SPEC section 5).

Exit codes: 0 done (or cancelled at the prompt, or nothing to purge); 2 bad arguments (argparse;
``call_command`` raises ``CommandError`` with returncode 1); 3 no such community; 4 the community
is not fenced; 5 no confirmation possible (stdin is not a terminal and ``--yes`` is missing).
"""

from __future__ import annotations

import sys
import uuid
from typing import Any

from django.apps import apps
from django.core.management.base import CommandError, CommandParser

from buzz_delivery import services
from buzz_delivery.conf import get_settings
from buzz_delivery.exceptions import CommunityNotFound, LifecycleError
from buzz_delivery.management.base import StrictOptionsCommand
from buzz_delivery.management.options import int_in, uuid_value
from buzz_delivery.models import Community
from buzz_delivery.services import tenancy
from buzz_delivery.services.lifecycle import MAX_PURGE_BATCH

NOT_FOUND = 3
NOT_FENCED = 4
NO_CONFIRMATION = 5


class Command(StrictOptionsCommand):
    help = (
        "Delete every row of a fenced community, table by table in deletion-catalog order and in "
        "batches, then mark it tombstone (the community row is kept). Prints the rows per table."
    )
    stealth_options = ("stdin",)

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("community_id", type=uuid_value, help="Id (UUID) of a fenced community.")
        parser.add_argument("--dry-run", action="store_true", help="Count the rows per table; delete nothing.")
        parser.add_argument("--yes", action="store_true", help="Do not ask for confirmation.")
        parser.add_argument(
            "--batch-size",
            type=int_in(1, MAX_PURGE_BATCH),
            default=None,
            help=f"Rows per DELETE, each in its own transaction (1..{MAX_PURGE_BATCH}; "
            "default: BUZZ_DELIVERY['BATCH_SIZE'], 1000).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        community_id: uuid.UUID = options["community_id"]
        verbosity: int = options["verbosity"]
        stdin = options.get("stdin") or sys.stdin

        with tenancy.fleet():  # an operator's read (SPEC 13)
            community = Community.objects.filter(id=community_id).first()
        if community is None:
            raise CommandError(f"no community with id {community_id}", returncode=NOT_FOUND)
        if community.deletion_state == "tombstone":
            self.stdout.write(f"Community {community_id} is already tombstone: nothing to purge.")
            return
        if community.deletion_state != "fenced":
            raise CommandError(
                f"community {community_id} is {community.deletion_state}, not fenced: move it forward "
                "with services.advance_community (active -> quiescing -> fenced) first",
                returncode=NOT_FENCED,
            )

        present = self._purge(community_id, dry_run=True)
        if options["dry_run"]:
            self._table(present.deleted, "rows", verbosity)
            self.stdout.write(
                f"Dry run: {present.total} rows of community {community_id} would be deleted; nothing written."
            )
            return
        if not options["yes"]:
            self._table(present.deleted, "rows", verbosity)
            if not stdin.isatty():
                raise CommandError(
                    "refusing to purge without confirmation: stdin is not a terminal; pass --yes",
                    returncode=NO_CONFIRMATION,
                )
            self.stdout.write(
                f"Delete these {present.total} rows of community {community_id} and mark it tombstone? "
                "This cannot be undone. Type 'yes' to continue: ",
                ending="",
            )
            self.stdout.flush()
            if stdin.readline().strip().lower() != "yes":
                self.stdout.write("Purge cancelled; nothing deleted.")
                return

        size = options["batch_size"] or get_settings().batch_size
        result = self._purge(community_id, batch_size=size)
        self._table(result.deleted, "deleted", verbosity)
        self.stdout.write(
            self.style.SUCCESS(
                f"Purged community {community_id}: {result.total} rows deleted in {result.batches} batches "
                f"of at most {size}; it is now tombstone."
            )
        )

    def _purge(self, community_id: uuid.UUID, **kwargs: Any) -> services.PurgeResult:
        try:
            return services.purge_community(community_id, **kwargs)
        except CommunityNotFound as exc:
            raise CommandError(str(exc), returncode=NOT_FOUND) from exc
        except LifecycleError as exc:
            raise CommandError(str(exc), returncode=NOT_FENCED) from exc

    def _table(self, counts: dict[str, int], heading: str, verbosity: int) -> None:
        if verbosity < 1:
            return
        rows = [(apps.get_model(label)._meta.db_table, count) for label, count in counts.items()]
        width = max(len("table"), *(len(table) for table, _ in rows))
        self.stdout.write(f"{'table':<{width}}  {heading:>10}")
        for table, count in rows:
            self.stdout.write(f"{table:<{width}}  {count:>10}")
