"""A handler thread's connection wrapper, looked up once per thread (issue 31 stage 4), must
still be the one the thread's handlers use: the delivery's community scope (and the
transaction guard) goes on it.

A handler that replaces its thread's default connection (``connections["default"] = ...``,
or a ``UserConnection`` lane entered and never left) and leaves it replaced ran its own later
statements unscoped: its own doing. The next delivery on that thread, of any community, must
not: with the wrapper kept from the thread's start, its scope went on the old wrapper while its
handler's ORM read through the new one, with no community context (a tenant login subject to
RLS then reads no rows, a login that is not reads every community's)."""

from __future__ import annotations

import pytest
from django.db import DEFAULT_DB_ALIAS, connection, connections

from buzz_delivery.testing import CommunityFactory, DeliveryFactory, WorkflowRunFactory, random32
from buzz_delivery.worker import WorkerConfig, run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def _context() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT coalesce(current_setting('buzz.community_id', true), '')")
        return cursor.fetchone()[0]


def test_the_next_delivery_after_a_handler_replaced_its_threads_connection_runs_in_its_community():
    community = CommunityFactory()
    target = random32()
    run = WorkflowRunFactory(community=community)
    for _ in range(2):
        DeliveryFactory(binding__run=run, binding__target_pubkey=target)
    seen: list[str] = []
    replaced: list[object] = []

    def handler(delivery: object) -> None:
        if not replaced:  # the first delivery: replace the thread's default connection, leave it so
            replaced.append(connections[DEFAULT_DB_ALIAS])
            connections[DEFAULT_DB_ALIAS] = connections.create_connection(DEFAULT_DB_ALIAS)
            return
        try:
            seen.append(_context())
        finally:
            replaced[0].close()  # type: ignore[attr-defined]  (on its own thread)

    summary = run_worker(
        WorkerConfig(
            community_id=community.id,
            target_pubkey=target,
            handler=handler,
            concurrency=1,  # one handler thread: the second delivery runs where the first replaced
            max_deliveries=2,
            poll_interval=0.1,
        ),
        handle_signals=False,
    )
    assert summary["finished"] == 2, summary
    assert seen == [str(community.id)]
