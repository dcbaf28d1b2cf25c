"""``prune_gateway_replays``: delete NIP-98 event ids older than the auth window (SPEC section 14).

Safe to run from cron every few minutes: a recorded id whose event is older than the window can
never be admitted again, so deleting it reopens nothing. Prints one JSON summary line.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from buzz_delivery.gateway.conf import get_settings
from buzz_delivery.gateway.replay import prune_seen_events


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


class Command(BaseCommand):
    help = "Delete recorded NIP-98 event ids older than the gateway's auth window (in batches)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than",
            type=_positive_float,
            default=None,
            help="seconds to keep (default and minimum: BUZZ_GATEWAY['AUTH_WINDOW_SECONDS'])",
        )
        parser.add_argument("--batch-size", type=int, default=1000, help="rows per DELETE (default 1000)")

    def handle(self, *args: Any, **options: Any) -> None:
        window = get_settings().auth_window_seconds
        keep = options["older_than"] if options["older_than"] is not None else window
        if keep < window:
            raise CommandError(
                f"--older-than {keep:g} is shorter than the auth window ({window:g} s): replays would be admitted",
                returncode=2,
            )
        if not 1 <= options["batch_size"] <= 100_000:
            raise CommandError("--batch-size must be within 1..100000", returncode=2)
        deleted = prune_seen_events(keep_seconds=keep, batch_size=options["batch_size"])
        self.stdout.write(json.dumps({"deleted": deleted, "keep_seconds": keep}))
