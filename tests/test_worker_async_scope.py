"""An ``async def`` delivery handler's statements (the async ORM, ``sync_to_async`` either way,
``asyncio.to_thread``) run in its delivery's community scope, as a plain handler's ORM
statements do, also when handlers of different communities interleave on the worker's shared
executor thread and connection (``buzz_delivery.usercode``, "async def handlers").

The worker runs in this process (real handler, loop, executor and settler threads, each on its
own connection), its new connections logging in as a plain member of the tenant role
(no superuser, no BYPASSRLS) with ``SWITCH_ROLES`` off: what a handler reads and writes of our
tables is then exactly what row-level security lets its community context see. Without the
scope its statements ran with no context: they read no rows (fail closed) and wrote none."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Iterator

import pytest
from asgiref.sync import sync_to_async
from django.db import connection, connections, transaction
from django.test import override_settings
from django.utils import timezone

from buzz_delivery import isolation
from buzz_delivery.models import Event, WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory, DeliveryFactory, WorkflowRunFactory, random32
from buzz_delivery.worker import WorkerConfig, run_worker

pytestmark = pytest.mark.django_db(transaction=True)

LOGIN = "buzz_test_async_tenant_login"


@pytest.fixture(scope="module")
def tenant_login(django_db_setup, django_db_blocker) -> Iterator[str]:
    """A LOGIN role that is a plain member of the tenant role: RLS binds it."""
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(
            f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{LOGIN}') THEN "
            f"CREATE ROLE {LOGIN} LOGIN NOSUPERUSER NOBYPASSRLS; END IF; END $$"
        )
        cursor.execute(f"GRANT {isolation.roles().tenant} TO {LOGIN}")
    yield LOGIN


@contextlib.contextmanager
def new_connections_as(role: str) -> Iterator[None]:
    """Every connection opened in the block (the worker's threads') logs in as ``role``; this
    test's own connection, open already, stays the superuser's."""
    connection.ensure_connection()
    settings = connections.settings["default"]  # the dict each thread's wrapper is made from
    user = settings["USER"]
    settings["USER"] = role
    try:
        with override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": False}):
            yield
    finally:
        settings["USER"] = user


def two_communities(target: bytes, n: int = 1) -> tuple[list, list]:
    """Two communities with ``n`` deliveries each to ``target``; returns each one's deliveries
    (serve them all: the worker claims them in any order)."""
    return tuple(  # type: ignore[return-value]
        [DeliveryFactory(binding__run=run, binding__target_pubkey=target) for _ in range(n)]
        for run in (WorkflowRunFactory(community=CommunityFactory()) for _ in range(2))
    )


def serve(deliveries: list, target: bytes, handler: object, concurrency: int) -> dict:
    communities = sorted({d.community_id for d in deliveries}, key=str)
    return run_worker(
        WorkerConfig(
            community_id=communities[0],
            target_pubkey=target,
            extra_pairs=tuple((c, target) for c in communities[1:]),
            handler=handler,  # type: ignore[arg-type]
            concurrency=concurrency,
            max_deliveries=len(deliveries),
            poll_interval=0.1,
            idle_exit=20,
        ),
        handle_signals=False,
    )


def _distinct_communities() -> list[str]:
    return sorted(str(c) for c in WorkflowAgentDelivery.objects.values_list("community_id", flat=True).distinct())


def test_an_async_handler_reads_its_own_community_rows_and_none_of_another_s(tenant_login):
    target = random32()
    mine, theirs = two_communities(target)
    seen: dict[str, list] = {}

    async def handler(delivery):
        me = delivery.community_id
        other = theirs[0] if me == mine[0].community_id else mine[0]
        seen[str(me)] = [
            await WorkflowAgentDelivery.objects.acount(),
            (await WorkflowAgentDelivery.objects.aget(pk=delivery.pk)).community_id == me,
            await WorkflowAgentDelivery.objects.filter(pk=other.pk).aexists(),
            await sync_to_async(_distinct_communities)(),
            await sync_to_async(_distinct_communities, thread_sensitive=False)(),
            await asyncio.to_thread(_distinct_communities),
        ]

    with new_connections_as(tenant_login):
        summary = serve([mine[0], theirs[0]], target, handler, concurrency=1)
    assert summary["finished"] == 2, summary
    for community in (mine[0].community_id, theirs[0].community_id):
        me = [str(community)]
        assert seen[str(community)] == [1, True, False, me, me, me]


def test_async_handlers_of_two_communities_interleaved_on_the_shared_thread_each_see_their_own(tenant_login):
    target = random32()
    mine, theirs = two_communities(target, 2)
    deliveries = mine + theirs
    barrier = asyncio.Barrier(len(deliveries))  # (bound to the worker's loop on first use)
    threads: set[int] = set()
    seen: dict[str, list] = {}

    def read() -> list[str]:
        threads.add(threading.get_ident())
        return _distinct_communities()

    async def handler(delivery):
        rows = seen.setdefault(str(delivery.pk), [])
        for _ in range(3):  # every handler reads, then waits for all the others to read: interleaved
            rows.append(await sync_to_async(read)())
            ids = WorkflowAgentDelivery.objects.values_list("community_id", flat=True)
            rows.append(sorted([str(c) async for c in ids]))
            await asyncio.wait_for(barrier.wait(), 20)

    with new_connections_as(tenant_login):
        summary = serve(deliveries, target, handler, concurrency=len(deliveries))
    assert summary["finished"] == 4, summary
    assert len(threads) == 1  # one shared thread (and connection) for every community's handlers
    for delivery in deliveries:
        me = str(delivery.community_id)
        assert seen[str(delivery.pk)] == [[me], [me, me]] * 3


def _event(community_id) -> dict:
    return {
        "community_id": community_id,
        "event_id": random32(),
        "created_at": timezone.now(),
        "kind": 1,
        "pubkey": random32(),
        "content": "written by an async handler",
        "tags": [],
    }


def test_an_async_handler_s_write_lands_in_its_community_and_one_into_another_is_refused(tenant_login):
    target = random32()
    mine, theirs = two_communities(target)
    outcome: dict[str, str] = {}

    async def handler(delivery):
        me = delivery.community_id
        other = theirs[0].community_id if me == mine[0].community_id else mine[0].community_id
        await Event.objects.acreate(**_event(me))
        try:
            await Event.objects.acreate(**_event(other))
        except Exception as exc:  # refused by the other community's row-level security
            outcome[str(me)] = type(exc).__name__

    before = {c: Event.objects.filter(community_id=c).count() for c in (mine[0].community_id, theirs[0].community_id)}
    with new_connections_as(tenant_login):
        summary = serve([mine[0], theirs[0]], target, handler, concurrency=2)
    assert summary["finished"] == 2, summary
    for community in before:
        assert Event.objects.filter(community_id=community).count() == before[community] + 1
        assert outcome[str(community)] == "ProgrammingError"  # new row violates row-level security policy


def test_a_transaction_an_async_handler_leaves_open_fails_its_delivery_and_reaches_no_other(tenant_login):
    target = random32()
    mine, theirs = two_communities(target)
    left, reader = mine[0], theirs[0]
    opened = asyncio.Event()  # (bound to the worker's loop on first use)
    seen: list = []

    def open_and_write(community_id) -> None:
        transaction.set_autocommit(False)
        Event.objects.create(**_event(community_id))

    async def handler(delivery):
        if delivery.pk == left.pk:
            await sync_to_async(open_and_write)(delivery.community_id)  # and never commits
            opened.set()
            return
        await asyncio.wait_for(opened.wait(), 20)
        seen.append(await sync_to_async(_distinct_communities)())  # the same thread, right after
        seen.append(await Event.objects.filter(content="written by an async handler").acount())

    events = Event.objects.filter(community_id=left.community_id).count()
    with new_connections_as(tenant_login):
        summary = serve([left, reader], target, handler, concurrency=2)
    assert summary["finished"] == 1 and summary["failed"] == 1, summary
    assert WorkflowAgentDelivery.objects.get(pk=left.pk).failure_code == "transaction_left_open"
    assert seen == [[str(reader.community_id)], 0]
    assert Event.objects.filter(community_id=left.community_id).count() == events  # rolled back


def test_a_statement_sent_to_the_handlers_threads_from_outside_any_handler_s_context_is_refused(tenant_login):
    """A task of the handler's started in an empty context (no delivery's community) runs its
    ``sync_to_async`` statement on the same threads: refused with a clear error, not read unscoped."""
    target = random32()
    mine, _ = two_communities(target)
    raised: list[str] = []

    async def stray() -> int:
        return await WorkflowAgentDelivery.objects.acount()

    async def handler(delivery):
        try:
            await asyncio.get_running_loop().create_task(stray(), context=contextvars.Context())
        except Exception as exc:
            raised.append(f"{type(exc).__name__}: {exc}")
        assert await WorkflowAgentDelivery.objects.acount() == 1  # its own statements still run

    with new_connections_as(tenant_login):
        summary = serve(mine, target, handler, concurrency=1)
    assert summary["finished"] == 1, summary
    assert len(raised) == 1 and raised[0].startswith("NoTenantScope: a statement of an async handler's thread"), raised


def _set_statement_timeout_and_read() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SET statement_timeout = '50s'")  # a session statement: the call is cleaned after
    return _distinct_communities()


def test_another_community_s_session_clean_up_leaves_an_async_handler_s_aiterator_reading(tenant_login):
    """``aiterator()`` reads a server-side cursor a chunk per call on the shared thread; a call
    of another community's handler in between that ran a session statement is cleaned after
    (its session state discarded) without closing that cursor: the first handler reads on, its
    own rows only, and the other's setting does not stay on the connection."""
    target = random32()
    mine, theirs = two_communities(target, 3)
    first_chunk, cleaned = asyncio.Event(), asyncio.Event()  # (bound to the worker's loop on first use)
    seen: dict[str, list] = {}

    def timeout() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SHOW statement_timeout")
            return cursor.fetchone()[0]

    async def handler(delivery):
        if delivery.pk == mine[0].pk:
            rows = seen.setdefault("reader", [])
            try:
                async for row in WorkflowAgentDelivery.objects.order_by("pk").aiterator(chunk_size=1):
                    rows.append(str(row.community_id))
                    first_chunk.set()
                    await asyncio.wait_for(cleaned.wait(), 20)
            except Exception as exc:
                rows.append(f"{type(exc).__name__}: {exc}")
        elif delivery.pk == theirs[0].pk:
            await asyncio.wait_for(first_chunk.wait(), 20)
            seen["other"] = await sync_to_async(_set_statement_timeout_and_read)()
            seen["timeout"] = [await sync_to_async(timeout)()]
            cleaned.set()

    with new_connections_as(tenant_login):
        summary = serve(mine + theirs, target, handler, concurrency=len(mine + theirs))
    assert summary["finished"] == 6, summary
    assert seen["reader"] == [str(mine[0].community_id)] * 3
    assert seen["other"] == [str(theirs[0].community_id)]
    assert seen["timeout"] != ["50s"]


def test_the_worker_stops_although_a_call_an_async_handler_abandoned_still_runs_on_its_threads():
    """A handler that gave up waiting for its ``asyncio.to_thread`` call (``wait_for``) leaves it
    running on the loop's pool: the worker still stops once its deliveries are done (the pool's
    threads are waited for a bounded time, ``usercode.CLOSE_WAIT_SECONDS``), not when the call ends."""
    target = random32()
    mine, _ = two_communities(target)
    release = threading.Event()

    async def handler(delivery):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.to_thread(release.wait, 120), 0.2)

    summaries: list[dict] = []
    worker = threading.Thread(target=lambda: summaries.append(serve(mine, target, handler, concurrency=1)))
    worker.start()
    try:
        worker.join(60)  # (the call ends only once released, below)
        assert not worker.is_alive()
        assert summaries[0]["finished"] == 1, summaries
    finally:
        release.set()
        worker.join()


def _sleeping_backends(marker: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE state = 'active' AND query LIKE %s AND pid <> pg_backend_pid()",
            [f"%{marker}%"],
        )
        return cursor.fetchone()[0]


def test_a_statement_an_async_handler_abandoned_is_cancelled_when_the_worker_stops():
    """The statement of a call a handler gave up waiting for (``wait_for`` around
    ``sync_to_async``) still runs on the shared thread when the worker stops: past the
    close's wait it is cancelled on the server, so the thread ends (the process's exit joins it)
    and its backend is not left running."""
    target = random32()
    mine, _ = two_communities(target)
    marker = f"abandoned_{random32().hex()[:12]}"

    def sleep() -> None:
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT pg_sleep(120) AS {marker}")

    async def handler(delivery):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sync_to_async(sleep)(), 0.5)

    try:
        summary = serve(mine, target, handler, concurrency=1)
        assert summary["finished"] == 1, summary
        for _ in range(100):  # (the server ends a cancelled statement at once; a few polls at most)
            if _sleeping_backends(marker) == 0:
                break
            threading.Event().wait(0.1)
        assert _sleeping_backends(marker) == 0
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE query LIKE %s AND pid <> pg_backend_pid()",
                [f"%{marker}%"],
            )
