"""The event-loop agent worker's ``async def`` handlers and tools: their statements (the async
ORM, ``sync_to_async`` either way, ``asyncio.to_thread``) run in their run's community scope, as
a plain tool's do, also when runs of different communities interleave on the loop's shared
thread and connection (``usercode.serve_loop``, ``aio_runtime.async_user_code``).

The worker runs in this process (real loop, pool and user threads, each on its own connection),
its new connections logging in as a plain member of the tenant role (no superuser, no
BYPASSRLS) with ``SWITCH_ROLES`` off: what a handler reads of our tables is then exactly what
row-level security lets its community context see. Without the scope its statements ran with
no context: they read no rows (fail closed)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from asgiref.sync import sync_to_async

from buzz_delivery.agents.exceptions import ToolCallFailed
from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import intake_event
from buzz_delivery.agents.tool_threads import noting_threads
from buzz_delivery.testing import CommunityFactory
from tests.agents_support import AGENT
from tests.test_worker_async_scope import new_connections_as, tenant_login  # noqa: F401  (the fixture)

pytestmark = pytest.mark.django_db(transaction=True)

RUNS = 4  # two per community, all in flight at once


def _visible() -> list[str]:
    """The communities of the agent runs this thread's connection may read."""
    return sorted(str(c) for c in AgentRun.objects.values_list("community_id", flat=True))


async def _reads(threads: set[int]) -> list:
    def read() -> list[str]:
        threads.add(threading.get_ident())
        return _visible()

    return [
        await sync_to_async(read)(),
        sorted([str(c) async for c in AgentRun.objects.values_list("community_id", flat=True)]),
        await sync_to_async(_visible, thread_sensitive=False)(),
        await asyncio.to_thread(_visible),
        await _noted_thread(),
    ]


async def _noted_thread() -> list[str]:
    """As the integrations' tools run: their threads noted (which keeps the loop's executor)."""
    with noting_threads(asyncio.get_running_loop()):
        return await asyncio.to_thread(_visible)


def make_handler(barrier: asyncio.Barrier, threads: set[int]):
    async def tool(args: dict, key: str) -> list:
        return await _reads(threads)

    async def handler(ctx):
        seen = []
        for i in range(2):  # every run reads, then waits for all the others to read: interleaved
            seen.append(await _reads(threads))
            seen.append(await ctx.call(f"read{i}", tool, {}))
            await asyncio.wait_for(barrier.wait(), 20)
        return seen

    return handler


def test_async_handlers_and_tools_of_two_communities_interleaved_on_one_loop_each_see_their_own_runs(tenant_login):  # noqa: F811
    communities = [CommunityFactory(), CommunityFactory()]
    runs = [intake_event(c.id, "test", f"e{c.id}{i}", {}, AGENT).run_id for c in communities for i in range(2)]
    threads: set[int] = set()
    worker = AsyncAgentWorker(
        AsyncWorkerConfig(
            handler=make_handler(asyncio.Barrier(RUNS), threads),
            agents=[AGENT],
            communities=[c.id for c in communities],
            exit_when_idle=True,
            accept=False,
            poll_seconds=0.1,
            lease_seconds=15,
            in_flight=RUNS,
            connections=2,
            worker_id="aio-scope",
        )
    )
    with new_connections_as(tenant_login):
        counts = worker.run()
    assert counts["completed"] == RUNS, counts
    assert len(threads) == 1  # sync_to_async: one shared thread (and connection) for every run
    for run_id in runs:
        run = AgentRun.objects.get(id=run_id)
        me = [str(run.community_id)] * 2  # its community's two runs, none of the other's
        assert run.output == [[me] * 5] * 4, run.output


def _leave_open() -> bool:
    from django.db import connection, transaction

    transaction.set_autocommit(False)
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return True


async def leaves_open_on_a_loop_thread(ctx):
    async def tool(args: dict, key: str) -> bool:
        return await asyncio.to_thread(_leave_open)

    try:
        await ctx.call("leave", tool, {})
    except ToolCallFailed as exc:
        return {"failed": str(exc)}
    return {"failed": None}


def test_an_async_tool_whose_thread_leaves_a_transaction_open_fails_as_a_tool_that_raised(community):
    run_id = intake_event(community.id, "test", "open", {}, AGENT).run_id
    worker = AsyncAgentWorker(
        AsyncWorkerConfig(
            handler=leaves_open_on_a_loop_thread,
            agents=[AGENT],
            communities=[community.id],
            exit_when_idle=True,
            poll_seconds=0.1,
            lease_seconds=15,
            worker_id="aio-scope",
        )
    )
    assert worker.run()["completed"] == 1
    failed = AgentRun.objects.get(id=run_id).output["failed"]
    assert failed is not None and "transaction_left_open" in failed and "autocommit was left off" in failed
