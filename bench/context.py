"""What every scenario gets: the database, a controller connection, the run's knobs and its report."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg

from bench.report import Report


@dataclass
class Bench:
    """``repeats``: runs per figure (the median is reported). ``duration``: seconds per timed
    throughput run. ``workers``: the process counts of the throughput scenarios. ``peers``: the systems
    of the peers scenario."""

    url: str
    conn: psycopg.Connection
    report: Report
    quick: bool
    repeats: int
    duration: float
    workers: tuple[int, ...]
    peers: tuple[str, ...] | None = None  # systems of the peers scenario (None = all)
    peer_jobs: int | None = None  # jobs per drain of the peers scenario's default-size systems

    def scaled(self, full: int, quick: int) -> int:
        """A size for this form of the run."""
        return quick if self.quick else full


FENCE_TRIGGER = """
SELECT tgname FROM pg_trigger
WHERE tgrelid = %s::regclass AND tgname LIKE 'pgtrigger_community_write_fence_%%'
"""
# The tables a delivery's transitions write (issue 31, stage 2): the record, the live queue.
FENCED_TABLES = ("buzz_delivery_delivery_record", "buzz_delivery_delivery_queue")


@contextmanager
def write_fence_disabled(conn: psycopg.Connection) -> Iterator[None]:
    """COMPARISON ONLY: disable the write-fence trigger (only that one) on the delivery tables of
    the benchmark database for the block, and always re-enable it."""
    names = [(table, conn.execute(FENCE_TRIGGER, [table]).fetchone()[0]) for table in FENCED_TABLES]
    for table, name in names:
        conn.execute(f'ALTER TABLE {table} DISABLE TRIGGER "{name}"')
    try:
        yield
    finally:
        for table, name in names:
            conn.execute(f'ALTER TABLE {table} ENABLE TRIGGER "{name}"')
