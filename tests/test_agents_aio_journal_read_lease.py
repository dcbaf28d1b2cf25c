"""The agent workers' journal read after a claim is retried while the run is held: a run whose
lease lapsed meanwhile must never start its handler (the event-loop worker's renewals failed or
hung too: the database was out of reach for the worker, not only for the read; the thread worker
renews nothing before its handler starts).

Real locks and a real ``pg_terminate_backend``: the journal's table is locked so each read waits
and is terminated, the runs table is locked so the renewals wait (the worker cannot renew), until
the run's lease lapsed on the database clock; then only the journal's lock is released. Before
the fix the event-loop worker's retries ran for a full ``lease_seconds`` from the task's start (not
from the claim or the last renewal), and the thread worker's last retry (started within a third of
the lease) was taken whenever it returned: the read that came through after the lapse started
the handler on a lease the database no longer honoured (another worker may claim the run)."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.db import connection

from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig
from project.database_url import database_url
from tests.agents_support import AGENT
from tests.test_agents_aio_journal_read import MADE, fetch, resumed_runs

pytestmark = pytest.mark.django_db(transaction=True)

STARTED: list[int] = []  # the lease generation of each handler start


async def recording(ctx):
    STARTED.append(ctx.lease.lease_generation)
    return await ctx.call("fetch", fetch, {"q": 2})


def recording_on_a_thread(ctx):
    STARTED.append(ctx.lease.lease_generation)
    return ctx.call("fetch", fetch, {"q": 2})


def _blocked_journal_readers(admin, holders):
    return [
        pid
        for (pid,) in admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND query ILIKE %s AND pid <> ALL(%s)",
            ["%buzz_agents_journal%", holders],
        ).fetchall()
    ]


@pytest.mark.parametrize("kind", ["event-loop", "threads"])
@pytest.mark.parametrize("terminations", [2, 0], ids=["retried", "the-claims-own-read"])
def test_a_journal_read_retried_past_the_lease_does_not_start_the_handler(community, settings, kind, terminations):
    """``terminations`` 0: no read fails, the first (the event-loop worker's: the claim's own, in
    one statement for the claim's resumed runs) only waits past the lapse."""
    settings.BUZZ_DELIVERY = {**getattr(settings, "BUZZ_DELIVERY", {}), "MIN_LEASE_SECONDS": 1}
    STARTED.clear()
    MADE.clear()
    (run_id,) = resumed_runs(community.id)
    url = database_url(connection.settings_dict)
    options = dict(
        agents=[AGENT], communities=[community.id], exit_when_idle=True, poll_seconds=0.1, lease_seconds=2,
        worker_id=f"{kind}-lapse", accept=False,
    )  # fmt: skip
    if kind == "event-loop":
        worker = AsyncAgentWorker(AsyncWorkerConfig(handler=recording, connections=4, **options))
    else:
        worker = AgentWorker(WorkerConfig(handler=recording_on_a_thread, listen=False, concurrency=1, **options))
    counts: dict = {}
    with (
        psycopg.connect(url, autocommit=True) as admin,
        psycopg.connect(url) as journal_lock,
        psycopg.connect(url) as runs_lock,
    ):
        journal_lock.execute("LOCK TABLE buzz_agents_journal IN ACCESS EXCLUSIVE MODE")
        holders = [journal_lock.info.backend_pid, runs_lock.info.backend_pid, admin.info.backend_pid]
        runner = threading.Thread(target=lambda: counts.update(worker.run()))
        runner.start()
        try:
            safety = time.monotonic() + 60  # against a hang only: nothing below is timed
            while not _blocked_journal_readers(admin, holders):  # the claim committed; its read waits
                assert time.monotonic() < safety, "no journal read waited on the lock"
                time.sleep(0.02)
            runs_lock.execute("LOCK TABLE buzz_agents_run IN ACCESS EXCLUSIVE MODE")  # renewals wait now
            (generation,) = runs_lock.execute(
                "SELECT lease_generation FROM buzz_agents_run WHERE id = %s", [run_id]
            ).fetchone()
            terminated = 0
            while True:  # reads terminated (each retried), the next left waiting past the lapse
                assert time.monotonic() < safety, "the lease never lapsed"
                (lapsed,) = runs_lock.execute(
                    "SELECT lease_until < clock_timestamp() FROM buzz_agents_run WHERE id = %s", [run_id]
                ).fetchone()
                readers = _blocked_journal_readers(admin, holders)
                if lapsed and readers and terminated >= terminations:
                    break  # a read waits now, after the lapse: let it through
                for pid in readers[: max(terminations - terminated, 0)]:
                    admin.execute("SELECT pg_terminate_backend(%s::integer)", [pid])
                    terminated += 1
                time.sleep(0.02)
            journal_lock.rollback()  # the journal is readable again; the runs table still locked
            while not (STARTED or counts or worker.counts["lost"]):
                assert time.monotonic() < safety, "the run neither started nor was given up"
                time.sleep(0.02)
        finally:
            journal_lock.rollback()
            runs_lock.rollback()
            worker.stop()
            runner.join()
    assert generation not in STARTED, (
        f"the handler started on generation {generation} after its lease lapsed ({counts or worker.counts})"
    )


def test_a_thread_worker_stopped_while_a_journal_read_is_retried_starts_no_handler_after_it_returned(community):
    """The thread worker stopped (grace 0) while a run's journal read is retried: the run is not
    held yet, so giving the held runs up did not reach it, and once ``run()`` had returned (the
    heartbeat stopped, the summary written) the read came through and the handler started with
    nobody renewing its lease or counting it. Now the thread starts no handler once the worker
    gave its runs up: the run is left to its lease."""
    STARTED.clear()
    MADE.clear()
    resumed_runs(community.id)
    url = database_url(connection.settings_dict)
    worker = AgentWorker(
        WorkerConfig(
            handler=recording_on_a_thread, agents=[AGENT], communities=[community.id], poll_seconds=0.1,
            lease_seconds=15, worker_id="threads-stop", accept=False, listen=False, concurrency=1, shutdown_grace=0,
        )
    )  # fmt: skip
    counts: dict = {}
    with psycopg.connect(url, autocommit=True) as admin, psycopg.connect(url) as journal_lock:
        journal_lock.execute("LOCK TABLE buzz_agents_journal IN ACCESS EXCLUSIVE MODE")
        holders = [journal_lock.info.backend_pid, admin.info.backend_pid]
        runner = threading.Thread(target=lambda: counts.update(worker.run()))
        runner.start()
        try:
            safety = time.monotonic() + 60  # against a hang only: nothing below is timed
            terminated = 0
            while True:  # the first read terminated; its retry waits on the lock
                assert time.monotonic() < safety, "no journal read waited on the lock"
                readers = _blocked_journal_readers(admin, holders)
                if readers and terminated:
                    break
                for pid in readers:
                    admin.execute("SELECT pg_terminate_backend(%s::integer)", [pid])
                    terminated += 1
                time.sleep(0.02)
            (agent_thread,) = [t for t in threading.enumerate() if t.name == "agent-0"]
            worker.stop()
            runner.join()  # run() returned: its runs were given up
        finally:
            journal_lock.rollback()
            runner.join()
        agent_thread.join()
    assert STARTED == [], f"a handler started after the worker had returned ({counts})"
    assert MADE == []
