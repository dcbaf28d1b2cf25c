"""Scaffolding of the tenant-lock tests: rows of a community held by a real long transaction
(another session), and the sessions waiting for a lock."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from django.db import connection

from project.database_url import database_url
from tests.test_worker_tenant_locks import backends_waiting_for_a_lock

__all__ = ["a_move_can_get_stuck", "backends_waiting_for_a_lock", "identity_held", "rows_held"]


@contextmanager
def rows_held(model: Any, community_id: uuid.UUID, *ids: Any) -> Iterator[Callable[[], None]]:
    """A transaction of another session holding the rows ``ids`` of ``model`` in the community
    (``FOR UPDATE``, each in router form); yields ``release()``, which ends it (rolled back,
    changing nothing), as leaving the block does."""
    holder = psycopg.connect(database_url(connection.settings_dict))

    def release() -> None:
        if not holder.closed:
            holder.rollback()
            holder.close()

    try:
        for row_id in ids:
            holder.execute(
                f"SELECT 1 FROM {model._meta.db_table} WHERE community_id = %s AND id = %s FOR UPDATE",
                [community_id, row_id],
            )
        yield release
    finally:
        release()


@contextmanager
def identity_held(community_id: uuid.UUID, run_id: uuid.UUID, step_key: str) -> Iterator[Callable[[], None]]:
    """A transaction of another session holding the delivery-identity lock of (``run_id``,
    ``step_key``) in the community (the advisory lock a send takes before its step row:
    :func:`~buzz_delivery.services.lock_delivery_identity`; a claim, which skips locked step
    rows, does not take it); yields ``release()``, which ends it, as leaving the block does."""
    from buzz_delivery.triggers import IDENTITY_LOCK_NAMESPACE

    holder = psycopg.connect(database_url(connection.settings_dict))

    def release() -> None:
        if not holder.closed:
            holder.rollback()
            holder.close()

    try:
        holder.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
            [IDENTITY_LOCK_NAMESPACE, f"{community_id}/{run_id}/{step_key}"],
        )
        yield release
    finally:
        release()


def a_move_can_get_stuck(community: Any) -> None:
    """The rows :func:`~tests.test_worker_tenant_locks.move_stuck_behind_a_long_transaction`
    needs in ``community``: an event (its long transaction writes it) and a workflow run (the
    probe of a queued write writes it)."""
    from buzz_delivery.testing import EventFactory, WorkflowRunFactory

    EventFactory(community=community)
    WorkflowRunFactory(community=community)
