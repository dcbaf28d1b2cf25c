"""A handler thread reads its default connection wrapper for each delivery (a handler may have
replaced it: tests/test_worker_thread_connection.py) without going through asgiref's ``Local``
each time (``connections[...]`` asks asyncio for a running loop first: ~0.7-2 µs a delivery,
issue 31): :func:`buzz_delivery.worker.runtime.thread_connection_lookup`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import DEFAULT_DB_ALIAS, connections
from django.utils.connection import BaseConnectionHandler

from buzz_delivery.testing import CommunityFactory, DeliveryFactory, WorkflowRunFactory, random32
from buzz_delivery.worker import WorkerConfig, run_worker
from buzz_delivery.worker.runtime import thread_connection_lookup


def _in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a new plain thread (its connection wrappers closed after); returns or raises its result."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:
            out.append(("raised", exc))
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    kind, value = out[0]
    if kind == "raised":
        raise value
    return value


def test_the_lookup_returns_the_threads_wrapper_and_follows_a_replacement_and_a_removal():
    def scenario() -> list[bool]:
        lookup = thread_connection_lookup()
        first = lookup()
        seen = [first is connections[DEFAULT_DB_ALIAS]]
        replacement = connections.create_connection(DEFAULT_DB_ALIAS)
        connections[DEFAULT_DB_ALIAS] = replacement  # what a handler may do, and leave so
        seen.append(lookup() is replacement)
        del connections[DEFAULT_DB_ALIAS]
        fresh = lookup()  # created as connections[...] creates it, and kept for the thread
        seen += [fresh is not replacement and fresh is not first, fresh is connections[DEFAULT_DB_ALIAS]]
        return seen

    assert _in_thread(scenario) == [True, True, True, True]


def test_the_lookup_is_per_thread():
    def scenario() -> bool:
        lookup = thread_connection_lookup()
        mine = lookup()
        other = _in_thread(lambda: connections[DEFAULT_DB_ALIAS])
        return lookup() is mine and other is not mine

    assert _in_thread(scenario)


def test_a_replaced_connection_handler_local_is_followed(monkeypatch: pytest.MonkeyPatch):
    def scenario() -> bool:
        lookup = thread_connection_lookup()
        old = lookup()
        from asgiref.local import Local

        monkeypatch.setattr(connections, "_connections", Local(connections.thread_critical))
        new = lookup()
        return new is not old and new is connections[DEFAULT_DB_ALIAS]

    assert _in_thread(scenario)


def test_an_unknown_local_or_a_running_loop_falls_back_to_connections():
    class Opaque:  # an asgiref that keeps its storage otherwise
        def __init__(self, db: Any) -> None:
            self.default = db

    def unknown() -> bool:
        db = connections[DEFAULT_DB_ALIAS]
        real = connections._connections
        connections._connections = Opaque(db)
        try:
            lookup = thread_connection_lookup()
        finally:
            connections._connections = real
        return lookup() is connections[DEFAULT_DB_ALIAS] and getattr(lookup, "__name__", "") == "_default_connection"

    async def in_loop() -> str:
        return getattr(thread_connection_lookup(), "__name__", "")

    assert _in_thread(unknown)
    assert _in_thread(lambda: asyncio.run(in_loop())) == "_default_connection"


@pytest.mark.django_db(transaction=True)
def test_a_drain_looks_the_handler_threads_connection_up_through_asgiref_once_per_thread(
    monkeypatch: pytest.MonkeyPatch,
):
    community = CommunityFactory()
    target = random32()
    run = WorkflowRunFactory(community=community)
    for _ in range(12):
        DeliveryFactory(binding__run=run, binding__target_pubkey=target)
    lookups: list[str] = []
    getitem = BaseConnectionHandler.__getitem__

    def counted(self: Any, alias: str) -> Any:
        if threading.current_thread().name.startswith("buzz-delivery-handler"):
            lookups.append(alias)
        return getitem(self, alias)

    monkeypatch.setattr(BaseConnectionHandler, "__getitem__", counted)
    summary = run_worker(
        WorkerConfig(
            community_id=community.id,
            target_pubkey=target,
            handler=lambda delivery: None,  # no statement of its own (the ORM looks connections up)
            concurrency=2,
            max_deliveries=12,
            poll_interval=0.1,
        ),
        handle_signals=False,
    )
    assert summary["finished"] == 12, summary
    # Two per thread (one at its start, one by ``connections.close_all()`` at its end), not one
    # per delivery as well (12 + 2 before).
    assert len(lookups) <= 4, lookups
