"""What every buzz_delivery management command shares."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser


class StrictOptionsCommand(BaseCommand):
    """A command whose options must be spelled in full.

    argparse's prefix matching is off, so a typo such as ``reap_deliveries --force`` is refused
    instead of being read as Django's ``--force-color`` and running a real reap."""

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        return super().create_parser(prog_name, subcommand, allow_abbrev=False, **kwargs)
