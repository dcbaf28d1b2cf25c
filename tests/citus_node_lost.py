"""Citus: the real fault of a worker's connection lost inside a transaction (the worker restarted,
its backend terminated), timed right before the coordinator's COMMIT, which then fails with
``XX000`` ("could not commit transaction for shard N on at least one active node"), psycopg's
``InternalError``. For the tests of what the services and the gateway make of it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from unittest import mock

import psycopg
import pytest
from django.db import connection

from project.database_url import database_url
from tests.citus_support import CITUS_MODE, with_database, worker_urls

# The marks of a node-lost test module: real transactions, on a Citus cluster only.
PYTESTMARK = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CITUS_MODE, reason="a Citus coordinator's COMMIT failing for a lost worker connection"),
]


def terminate_worker_backends() -> None:
    """Terminates every client backend of the test database on the worker nodes."""
    name = connection.settings_dict["NAME"]
    for url in worker_urls(database_url(connection.settings_dict)):
        with psycopg.connect(with_database(url, name), autocommit=True) as worker:
            worker.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            )


@dataclass
class NodeLoss:
    seen: list[str] = field(default_factory=list)  # the statements that named ``after``
    lost: int = 0  # how many COMMITs the workers were lost before (0 or 1)


@contextmanager
def workers_lost_before_commit(after: str | None = None) -> Iterator[NodeLoss]:
    """Within it, the first COMMIT of this process's connection (``after``: the first once a
    statement containing ``after`` ran) finds the worker nodes' backends terminated. On leaving,
    the connection, which met the lost node, is closed: a fresh one from there."""
    commit = connection._commit
    loss = NodeLoss()

    def note(execute, sql, params, many, context):
        if after is not None and after in sql:
            loss.seen.append(sql)
        return execute(sql, params, many, context)

    def lose_the_workers_then_commit():
        if not loss.lost and (after is None or loss.seen):
            loss.lost += 1
            terminate_worker_backends()
        return commit()

    try:
        with ExitStack() as stack:
            if after is not None:
                stack.enter_context(connection.execute_wrapper(note))
            stack.enter_context(mock.patch.object(connection, "_commit", lose_the_workers_then_commit))
            yield loss
    finally:
        connection.close()
