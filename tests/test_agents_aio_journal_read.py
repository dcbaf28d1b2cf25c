"""The event-loop worker claims runs in one statement and reads the journals of the resumed ones
in a second (the thread worker: each run's, after its claim). A database failure between the two
(here: the backend that reads the journal is terminated, a real ``pg_terminate_backend`` while
the read waits on a lock another connection holds) must not strand the runs it claimed: before,
they stayed ``running`` under a lease nobody renewed or worked, their attempt spent, and a run on
its last attempt ended ``attempts_exhausted`` once the lease lapsed. Now the read is retried on a
fresh connection (the event-loop worker: when the claim's read fails, the runs start all the same
with their journals unknown and each reads its own in its task) before the handler runs."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.db import connection

from buzz_delivery.agents import services as s
from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import reap_agent_runs
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig
from project.database_url import database_url
from tests.agents_support import AGENT, backdate_run_lease, make_claimable, new_run

pytestmark = pytest.mark.django_db(transaction=True)

MADE: list[str] = []


def fetch(args, key):
    MADE.append(key)
    return {"page": args["q"]}


async def replaying(ctx):
    first = await ctx.call("fetch", fetch, {"q": 1})
    second = await ctx.call("fetch", fetch, {"q": 2})
    return {"pages": [first["page"], second["page"]], "replayed": ctx.replayed}


def resumed_runs(community_id, n=1):
    """``n`` runs on their last attempt (max_attempts=2) whose first holder journaled and
    recorded call 1, then died: reclaimed by the reaper, claimable again, ``tool_calls_used`` 1."""
    run_ids = [new_run(community_id, max_attempts=2) for _ in range(n)]
    claims = s.claim_agent_runs(community_id, [AGENT], worker_id="first", limit=n, lease_seconds=30)
    assert sorted(c.lease.run_id for c in claims) == sorted(run_ids)
    for c in claims:
        journaled = s.journal_call(c.lease, "fetch", {"q": 1})
        assert isinstance(journaled, s.Journaled)
        assert isinstance(s.record_call_result(c.lease, journaled.seq, ok=True, output={"page": 1}), s.Recorded)
        backdate_run_lease(c.lease.run_id)
    assert reap_agent_runs().reclaimed == n
    for run_id in run_ids:
        make_claimable(run_id)
    return run_ids


def terminate_the_journal_readers(url, holder_pid, times, done, terminated):
    """Wait for a backend blocked on the journal lock (the worker's read, after its claim) and
    terminate it, ``times`` times; then let ``done`` release the lock."""
    try:
        with psycopg.connect(url, autocommit=True) as admin:
            deadline = time.monotonic() + 60
            while len(terminated) < times and time.monotonic() < deadline:
                rows = admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND query ILIKE %s AND pid NOT IN (pg_backend_pid(), %s)"
                    " AND pid <> ALL(%s)",
                    ["%buzz_agents_journal%", holder_pid, terminated],
                ).fetchall()
                for (pid,) in rows[: times - len(terminated)]:
                    admin.execute("SELECT pg_terminate_backend(%s::integer)", [pid])  # Citus adds a bigint form
                    terminated.append(pid)
                time.sleep(0.02)
    finally:
        done.set()


def replaying_on_a_thread(ctx):
    first = ctx.call("fetch", fetch, {"q": 1})
    second = ctx.call("fetch", fetch, {"q": 2})
    return {"pages": [first["page"], second["page"]], "replayed": ctx.replayed}


def worker_of(kind, community):
    options = dict(
        agents=[AGENT], communities=[community.id], exit_when_idle=True, poll_seconds=0.1, lease_seconds=15,
        worker_id=f"{kind}-strand", accept=False,
    )  # fmt: skip
    if kind == "event-loop":
        return AsyncAgentWorker(AsyncWorkerConfig(handler=replaying, connections=2, **options))
    return AgentWorker(WorkerConfig(handler=replaying_on_a_thread, listen=False, **options))


@pytest.mark.parametrize("kind", ["event-loop", "threads"])
@pytest.mark.parametrize("times", [1, 2], ids=["first-read", "and-its-retry"])
def test_a_journal_read_that_fails_after_the_claim_leaves_no_run_stranded(community, kind, times):
    """``times`` 2: the read's retry (the event-loop worker: the run's own read after the
    claim's) is terminated too, and retried again. The thread worker reads each run's journal
    on its own after its claim, and left the run stranded the same way."""
    MADE.clear()
    (run_id,) = resumed_runs(community.id)
    url = database_url(connection.settings_dict)
    done, terminated = threading.Event(), []
    with psycopg.connect(url) as holder:  # a transaction holding the journal's table lock
        holder.execute("LOCK TABLE buzz_agents_journal IN ACCESS EXCLUSIVE MODE")
        pid = holder.info.backend_pid
        watcher = threading.Thread(target=terminate_the_journal_readers, args=(url, pid, times, done, terminated))
        watcher.start()
        releaser = threading.Thread(target=lambda: (done.wait(90), holder.rollback()))
        releaser.start()
        worker = worker_of(kind, community)
        try:
            counts = worker.run()
        finally:
            done.set()
            watcher.join()
            releaser.join()
    assert len(terminated) == times, "no journal read waited on the lock"
    if AgentRun.objects.get(id=run_id).lease_until is not None:  # left held (stranded): time passing
        backdate_run_lease(run_id)
        reap_agent_runs()  # its lease lapsed on its last attempt: failed, attempts_exhausted
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code, run.attempts) == ("completed", None, 1), (run.failure_message, counts)
    assert run.output == {"pages": [1, 2], "replayed": 1}
    assert counts["claimed"] == 1 and counts["completed"] == 1, counts
    assert len(MADE) == 1  # call 1 replayed from the journal, only call 2 made
    assert list(JournalEntry.objects.filter(run_id=run_id).order_by("seq").values_list("seq", "status")) == [
        (1, "succeeded"),
        (2, "succeeded"),
    ]


class Statements:
    """Every statement any thread's Django connection sends (the worker's pool threads)."""

    def __init__(self, monkeypatch):
        from django.db.backends import utils

        self.sent: list[str] = []
        lock = threading.Lock()
        real = utils.CursorWrapper._execute

        def counted(cursor, sql, params, *ignored):
            with lock:
                self.sent.append(sql)
            return real(cursor, sql, params, *ignored)

        monkeypatch.setattr(utils.CursorWrapper, "_execute", counted)


def test_the_journals_of_a_claims_resumed_runs_are_read_in_one_statement_and_none_for_fresh_runs(
    community, monkeypatch
):
    """The happy path keeps its statements: one claim, one journal read for its resumed runs."""
    MADE.clear()
    resumed = resumed_runs(community.id, 10)
    fresh = [new_run(community.id) for _ in range(10)]
    statements = Statements(monkeypatch)
    worker = AsyncAgentWorker(
        AsyncWorkerConfig(
            handler=replaying, agents=[AGENT], communities=[community.id], exit_when_idle=True,
            poll_seconds=0.1, lease_seconds=15, worker_id="aio-count", connections=2, accept=False,
        )
    )  # fmt: skip
    counts = worker.run()
    assert counts["claimed"] == counts["completed"] == 20, counts
    reads = [q for q in statements.sent if 'FROM "buzz_agents_journal"' in q]
    assert len(reads) == 1, reads
    assert sorted(AgentRun.objects.filter(id__in=resumed + fresh).values_list("state", flat=True)) == ["completed"] * 20
    assert len(MADE) == 10 + 20  # the resumed runs' call 1 replayed
