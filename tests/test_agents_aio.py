"""The event-loop agent worker (issue 29): async handlers, tools, reconcile hooks and
compensations; many runs in flight on a fixed number of connections, with journal writes,
results, renewals and completions batched per community, each row fenced by its own lease."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from buzz_delivery.agents import acceptance
from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import cancel_agent_run, intake_event, reap_agent_runs
from project.database_url import database_url
from tests import agent_async_handlers as ah
from tests import agent_handlers as h
from tests.agents_support import AGENT, backdate_run_lease, make_claimable, new_run
from tests.citus_support import CITUS_MODE
from tests.pgbouncer_support import pgbouncer  # noqa: F401  (the fixture)
from tests.test_pgbouncer import manage  # noqa: F401  (the fixture)

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    path = tmp_path / "ledger.txt"
    monkeypatch.setenv("AGENT_LEDGER", str(path))
    return path


def in_process(community, handler, **options):
    config = AsyncWorkerConfig(
        handler=handler,
        agents=[AGENT],
        communities=[community.id],
        exit_when_idle=True,
        poll_seconds=0.1,
        lease_seconds=15,
        worker_id="aio-test",
        **options,
    )
    worker = AsyncAgentWorker(config)
    return worker, worker.run()


def states(run_ids):
    return sorted(AgentRun.objects.filter(id__in=run_ids).values_list("state", flat=True))


def test_async_handlers_run_to_completion_with_their_calls_journaled_once(community, ledger):
    run_ids = [new_run(community.id) for _ in range(12)]
    _, counts = in_process(community, ah.three_calls, in_flight=50, connections=2)
    assert counts["completed"] == 12, counts
    assert states(run_ids) == ["completed"] * 12
    entries = JournalEntry.objects.filter(run_id__in=run_ids)
    assert entries.count() == 36 and set(entries.values_list("status", flat=True)) == {"succeeded"}
    calls = [line for line in h.ledger_lines() if line.startswith("call ")]
    assert len(calls) == 36 and len(set(calls)) == 36
    assert counts["batched_items"] > counts["batches"]  # several runs shared a statement
    assert AgentRun.objects.get(id=run_ids[0]).output == {"sum": 6, "agent": "async_three_calls"}


def test_a_plain_handler_runs_on_a_thread_in_the_event_loop_worker(community, ledger):
    run_ids = [new_run(community.id) for _ in range(4)]
    _, counts = in_process(community, h.three_calls, in_flight=8, connections=2)
    assert counts["completed"] == 4, counts
    assert states(run_ids) == ["completed"] * 4
    assert len([line for line in h.ledger_lines() if line.startswith("call ")]) == 12


def marks_its_connection(ctx):
    """A plain handler whose own code opens a Django connection (on its user thread) and names it."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('application_name', %s, false)", [ctx.input["mark"]])
    return {"ok": True}


def test_the_user_codes_connections_are_closed_when_the_event_loop_worker_stops(community, ledger, caplog):
    mark = f"usercode-{time.monotonic_ns()}"
    intake_event(community.id, "test", "mark", {"mark": mark}, AGENT)
    with caplog.at_level("WARNING", logger="buzz_delivery"):
        _, counts = in_process(community, marks_its_connection, in_flight=2, connections=1)
    assert counts["completed"] == 1, counts
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [mark])
        assert cursor.fetchone()[0] == 0  # closed when the worker stopped, not at the process's exit
    assert not [r.getMessage() for r in caplog.records if "connection_close_failed" in r.getMessage()]


def test_an_async_handler_that_fails_is_compensated_by_an_async_compensation_and_fails_alone(community, ledger):
    bad = new_run(community.id, agent=None)
    _, counts = in_process(community, ah.fails_then_compensates, in_flight=4, connections=1)
    assert counts["compensated"] == 1, counts
    run = AgentRun.objects.get(id=bad)
    assert run.state == "failed" and run.failure_code == "handler_error"
    undone = [line for line in h.ledger_lines() if line.startswith("undo ")]
    assert undone == [f"undo {bad}:2:compensate", f"undo {bad}:1:compensate"]


def test_a_poison_run_fails_alone_and_the_worker_goes_on(community, ledger):
    good = [new_run(community.id) for _ in range(3)]
    poison = intake_event(community.id, "test", "poison", {"poison": True}, AGENT).run_id
    _, counts = in_process(community, ah.poison_or_calls, in_flight=10, connections=2)
    assert counts["completed"] == 3 and counts["failed"] == 1 and not counts.get("internal_errors"), counts
    assert states(good) == ["completed"] * 3
    failed = AgentRun.objects.get(id=poison)
    assert (failed.state, failed.failure_code) == ("failed", "handler_error")
    assert "SystemExit" in failed.failure_message


def test_an_acceptance_error_is_counted_and_never_stops_the_worker(community, ledger, monkeypatch):
    calls = []
    real = acceptance.accept_round

    def flaky(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 1:
            raise RuntimeError("the inbox is down")
        return real(*args, **kwargs)

    monkeypatch.setattr(acceptance, "accept_round", flaky)
    run_id = new_run(community.id)
    _, counts = in_process(community, ah.three_calls, in_flight=4, connections=1)
    assert len(calls) >= 2, calls  # the worker went on accepting after the error
    assert counts["accept_errors"] == 1 and counts["completed"] == 1 and not counts.get("internal_errors"), counts
    assert states([run_id]) == ["completed"]


def env_for(ledger, application_name, **extra):
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict, application_name=application_name),
        "BUZZ_MIN_LEASE_SECONDS": "1",
        "AGENT_LEDGER": str(ledger),
        **extra,
    }
    if "AGENT_KILL" not in extra:
        env.pop("AGENT_KILL", None)
    return env


def async_worker_args(community, handler, *options):
    return [
        sys.executable, "manage.py", "run_agent_worker", "--async",
        "--handler", f"tests.agent_async_handlers:{handler}",
        "--agent", AGENT.hex(), "--community", str(community.id), "--exit-when-idle", "--poll-seconds", "0.2",
        "--lease-seconds", "15", *options,
    ]  # fmt: skip


def sample(stop, application_name, community_id, peaks, gate=None):
    """Every 20 ms until ``stop``: the sessions named ``application_name`` and the runs leased;
    ``gate`` (a path) is created once 1,000 runs are leased at once."""
    params = connection.settings_dict
    with psycopg.connect(database_url(params), autocommit=True) as conn:
        while not stop.is_set():
            sessions = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [application_name]
            ).fetchone()[0]
            leased = conn.execute(
                "SELECT count(*) FROM buzz_agents_run WHERE community_id = %s AND state IN ('running', 'waiting_tool')",
                [community_id],
            ).fetchone()[0]
            peaks["sessions"] = max(peaks["sessions"], sessions)
            peaks["leased"] = max(peaks["leased"], leased)
            if gate is not None and leased >= 1000 and not gate.exists():
                gate.write_text("open")
            time.sleep(0.02)


def test_1000_runs_in_flight_in_one_process_never_exceed_the_connection_budget(community, ledger):
    run_ids = [new_run(community.id) for _ in range(1000)]
    name = f"aio-budget-{os.getpid()}"
    peaks = {"sessions": 0, "leased": 0}
    stop = threading.Event()
    gate = ledger.with_suffix(".gate")  # the runs wait for it: all 1,000 are held at once first
    sampler = threading.Thread(target=sample, args=(stop, name, community.id, peaks, gate))
    sampler.start()
    try:
        proc = subprocess.run(
            async_worker_args(community, "three_sleepy_calls", "--in-flight", "1000", "--connections", "4"),
            cwd=ROOT, env=env_for(ledger, name, AGENT_CALL_SECONDS="0.2", AGENT_GATE=str(gate)),
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
    finally:
        stop.set()
        sampler.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["claimed"] == summary["completed"] == 1000, summary
    assert states(run_ids) == ["completed"] * 1000
    assert JournalEntry.objects.filter(run_id__in=run_ids, status="succeeded").count() == 3000
    # The whole process, registry included, on its 4 connections; all 1,000 runs leased at once.
    assert 1 <= peaks["sessions"] <= 4, peaks
    assert peaks["leased"] == 1000, peaks
    assert summary["batched_items"] >= 10 * summary["batches"], summary  # the writes went in batches


def reclaim_all(run_ids):
    """Time passing for a dead holder: its leases lapse, the reaper reclaims, the backoff ends."""
    held = [r for r in run_ids if AgentRun.objects.get(id=r).state in ("running", "waiting_tool")]
    for run_id in held:
        backdate_run_lease(run_id)
    assert reap_agent_runs().reclaimed == len(held)
    for run_id in held:
        make_claimable(run_id)
    return held


def test_a_sigkilled_async_worker_runs_resume_elsewhere_from_the_journal_with_no_call_made_twice(community, ledger):
    run_ids = [new_run(community.id) for _ in range(6)]
    first = subprocess.run(
        async_worker_args(community, "three_calls", "--in-flight", "10", "--connections", "2"),
        cwd=ROOT, env=env_for(ledger, "aio-killed", AGENT_KILL="inside_after_effect:2", AGENT_CALL_SECONDS="0.05"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert reclaim_all(run_ids), "the kill left no run held"
    pending = JournalEntry.objects.filter(run_id__in=run_ids, status="pending").count()
    assert pending >= 1  # at least the call the kill interrupted after its effect
    second = subprocess.run(
        async_worker_args(community, "three_calls", "--in-flight", "10", "--connections", "2"),
        cwd=ROOT, env=env_for(ledger, "aio-second"), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert states(run_ids) == ["completed"] * 6
    made = [line.split()[1] for line in h.ledger_lines() if line.startswith("made ")]
    assert sorted(made) == sorted(f"{r}:{n}" for r in run_ids for n in (1, 2, 3))  # each call once, none twice
    assert JournalEntry.objects.filter(run_id__in=run_ids, status="succeeded").count() == 18


def test_a_cancelled_runs_async_handler_stops_making_calls(community, ledger):
    run_id = new_run(community.id)
    result = {}

    def work():
        result["worker"], result["counts"] = in_process(community, ah.until_cancelled, in_flight=4, connections=2)

    thread = threading.Thread(target=work)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while len([x for x in h.ledger_lines() if x.startswith("tick ")]) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cancel_agent_run(community.id, run_id, reason="stop").__class__.__name__ == "Cancelled"
        at_cancel = len([x for x in h.ledger_lines() if x.startswith("tick ")])
    finally:
        thread.join(timeout=30)
    assert not thread.is_alive()
    time.sleep(0.3)
    ticks = [x for x in h.ledger_lines() if x.startswith("tick ")]
    assert at_cancel >= 3 and len(ticks) <= at_cancel + 1, (at_cancel, len(ticks))  # at most the call in flight
    assert result["counts"]["lost"] == 1, result["counts"]
    assert AgentRun.objects.get(id=run_id).state == "cancelled"
    journaled = JournalEntry.objects.filter(run_id=run_id).count()
    assert journaled <= at_cancel + 1


def test_async_workers_behind_pgbouncer_in_transaction_mode_run_each_call_once(manage, community, ledger):  # noqa: F811
    run_ids = [new_run(community.id) for _ in range(120)]
    args = [
        "run_agent_worker", "--async", "--handler", "tests.agent_async_handlers:three_calls", "--agent", AGENT.hex(),
        "--community", str(community.id), "--exit-when-idle", "--poll-seconds", "0.2", "--lease-seconds", "5",
        "--in-flight", "100", "--connections", "3",
    ]  # fmt: skip
    workers = [manage(f"aio-bouncer-{i}", *args, AGENT_LEDGER=str(ledger), AGENT_CALL_SECONDS="0.05") for i in (0, 1)]
    codes = [w.wait(timeout=120) for w in workers]
    assert codes == [0, 0], "\n".join(w.describe() for w in workers)
    summaries = [w.lines()[-1] for w in workers]
    assert sum(s["completed"] for s in summaries) == sum(s["claimed"] for s in summaries) == 120, summaries
    assert states(run_ids) == ["completed"] * 120
    made = [line.split()[1] for line in h.ledger_lines() if line.startswith("made ")]
    assert sorted(made) == sorted(f"{r}:{n}" for r in run_ids for n in (1, 2, 3))


@pytest.mark.skipif(CITUS_MODE, reason="the pool's backends found through pg_stat_activity")
def test_a_tool_whose_emit_meets_a_failed_pool_connection_leaves_its_run_to_its_lease(community, ledger):
    """The event-loop worker as the thread worker: a runtime statement whose connection fails
    (here a tool's ctx.emit, its pool backend terminated) marks the run lost; the call stays
    pending and the run is neither failed nor compensated (it resumes from its journal)."""
    run_id = new_run(community.id)
    connection.ensure_connection()
    mine = connection.connection.info.backend_pid  # the test's own: kept

    async def handler(ctx):
        async def tool(args, key):
            with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid NOT IN (pg_backend_pid(), %s)"
                    " AND backend_type = 'client backend'",
                    [mine],
                )
            await ctx.emit("a token")
            return {"text": "a token"}

        return await ctx.call("llm", tool, {"q": 1}, compensate=h.undo)

    _, counts = in_process(community, handler, in_flight=2, connections=1)

    assert counts.get("lost") == 1 and not counts.get("failed") and not counts.get("compensated"), (
        counts,
        AgentRun.objects.filter(id=run_id).values_list("failure_code", "failure_message").first(),
    )
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code, run.unwinding) == ("waiting_tool", None, False)
    assert list(JournalEntry.objects.filter(run_id=run_id).values_list("seq", "status")) == [(1, "pending")]
