"""What every buzz_delivery management command shares."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any

from django.core.management.base import BaseCommand, CommandParser


class StrictOptionsCommand(BaseCommand):
    """A command whose options must be spelled in full.

    argparse's prefix matching is off, so a typo such as ``reap_deliveries --force`` is refused
    instead of being read as Django's ``--force-color`` and running a real reap."""

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        return super().create_parser(prog_name, subcommand, allow_abbrev=False, **kwargs)


class StopRequest:
    """A stop flag that a signal handler may set.

    ``threading.Event.set()`` takes a lock that the interrupted main thread may be holding (inside
    ``Event.wait``), so calling it from a signal handler can deadlock the process; this sets a
    plain attribute, and :meth:`wait` sleeps in short slices to notice it."""

    SLICE_SECONDS = 0.1

    def __init__(self) -> None:
        self._requested = False
        self.reason = ""

    def set(self, reason: str = "") -> None:
        self.reason = self.reason or reason
        self._requested = True

    def is_set(self) -> bool:
        return self._requested

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, less if a stop is requested; returns :meth:`is_set`."""
        deadline = time.monotonic() + timeout
        while not self._requested and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, self.SLICE_SECONDS))
        return self._requested


def ensure_console_logging(name: str = "buzz_delivery") -> None:
    """Give logger ``name`` a stderr handler at INFO when no LOGGING config reaches it.

    Without one Python prints only WARNING and above (its last-resort handler), so a worker
    started in a project without ``LOGGING`` said nothing until something went wrong. A
    project's own handlers (on this logger, a parent or the root) are left alone."""
    logger = logging.getLogger(name)
    if logger.hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def warn_missing_communities(logger: logging.Logger, community_ids: Iterable[uuid.UUID]) -> list[uuid.UUID]:
    """Log a WARNING for each of ``community_ids`` that does not exist (one fleet-scoped read,
    :func:`~buzz_delivery.services.missing_communities`); returns those. A worker still starts:
    it may legitimately come up before its community is provisioned, and then waits for it. A
    database that cannot be read yet is logged and skipped: the worker's own loops wait for it."""
    from django.db import DatabaseError

    from buzz_delivery.services import missing_communities

    try:
        missing = missing_communities(list(community_ids))
    except DatabaseError as exc:
        logger.warning("community_check_failed error=%s", str(exc).strip()[:200])
        return []
    for community in missing:
        logger.warning("community_not_found community=%s: no such community; the worker waits for it", community)
    return missing
