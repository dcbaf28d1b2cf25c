"""Agent runs with real processes (SPEC 12): the crash matrix (worker subprocesses killed by
SIGKILL at each point of a 3-call run), compensation taken over after a kill, the intake race of
8 processes, and two workers racing for a run whose approval was decided."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.db import connection

from buzz_delivery.agents.models import AgentRun, IntakeKey, JournalEntry
from buzz_delivery.agents.services import claim_agent_runs, reap_agent_runs
from buzz_delivery.workflows.services import decide_approval
from project.database_url import database_url
from tests import agent_handlers as h
from tests.agents_support import AGENT, backdate_run_lease, make_claimable, new_run

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    path = tmp_path / "ledger.txt"
    monkeypatch.setenv("AGENT_LEDGER", str(path))
    return path


def worker(community, handler, ledger, *options, kill=None, timeout=60, handler_module="tests.agent_handlers"):
    """Run ``run_agent_worker`` to idle (or to its death); returns (returncode, summary or None)."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "BUZZ_MIN_LEASE_SECONDS": "1",
        "AGENT_LEDGER": str(ledger),
    }
    env.pop("AGENT_KILL", None)
    if kill:
        env["AGENT_KILL"] = kill
    proc = subprocess.run(
        [
            sys.executable, "manage.py", "run_agent_worker", "--handler", f"{handler_module}:{handler}",
            "--agent", AGENT.hex(), "--community", str(community.id), "--exit-when-idle",
            "--poll-seconds", "0.2", "--lease-seconds", "15", *options,
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    summary = json.loads(proc.stdout.splitlines()[-1]) if proc.returncode == 0 else None
    return proc.returncode, summary, proc.stderr


def reclaim(run_id):
    """Time passing for a dead holder: its lease lapses, the reaper reclaims, the backoff ends."""
    backdate_run_lease(run_id)
    assert reap_agent_runs().reclaimed == 1
    make_claimable(run_id)


CRASH_POINTS = [
    "before:1", "before:2", "before:3",
    "inside_before_effect:1", "inside_before_effect:3",
    "inside_after_effect:1", "inside_after_effect:2",
    "after:1", "after:3",
]  # fmt: skip


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_worker_killed_at_any_point_of_a_3_call_run_resumes_without_making_a_recorded_call_twice(
    community, ledger, point
):
    run_id = new_run(community.id)
    code, _, err = worker(community, "three_calls", ledger, kill=point)
    assert code == -9, err
    stage, n = point.split(":")
    recorded_before = int(n) - (0 if stage == "after" else 1)  # calls with a recorded success
    assert JournalEntry.objects.filter(run_id=run_id, status="succeeded").count() == recorded_before
    journaled = JournalEntry.objects.filter(run_id=run_id).count()
    assert journaled == (recorded_before if stage in ("before", "after") else recorded_before + 1)
    reclaim(run_id)
    code, summary, err = worker(community, "three_calls", ledger)
    assert code == 0, err
    assert summary["completed"] == 1
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.output["sum"]) == ("completed", 6)
    calls = [line for line in h_lines(ledger) if line.startswith("call")]
    assert calls == [f"call {run_id}:{k}" for k in (1, 2, 3)]  # each effect exactly once
    assert list(JournalEntry.objects.filter(run_id=run_id).values_list("status", flat=True)) == ["succeeded"] * 3


def h_lines(ledger):
    return ledger.read_text().splitlines() if ledger.exists() else []


def test_an_uncertain_call_without_reconcile_is_compensated_after_the_kill(community, ledger):
    run_id = new_run(community.id)
    code, _, _ = worker(community, "three_calls_no_reconcile", ledger, kill="inside_after_effect:2")
    assert code == -9
    reclaim(run_id)
    code, summary, err = worker(community, "three_calls_no_reconcile", ledger)
    assert code == 0 and summary["compensated"] == 1, err
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == ("failed", "uncertain_call")
    assert [x for x in h_lines(ledger) if x.startswith("undo")] == [
        f"undo {run_id}:2:compensate",
        f"undo {run_id}:1:compensate",
    ]


def test_compensation_3_2_1_once_each_even_when_the_compensating_worker_is_killed_midway(community, ledger):
    run_id = new_run(community.id)
    code, _, _ = worker(community, "four_calls_fail", ledger, kill="undo:2")
    assert code == -9
    statuses = dict(JournalEntry.objects.filter(run_id=run_id).values_list("seq", "compensation_status"))
    assert statuses == {1: None, 2: "compensating", 3: "compensated", 4: None}
    reclaim(run_id)
    code, summary, err = worker(community, "four_calls_fail", ledger)
    assert code == 0 and summary["compensated"] == 1, err
    assert [x for x in h_lines(ledger) if x.startswith("undo")] == [f"undo {run_id}:{n}:compensate" for n in (3, 2, 1)]
    assert [x for x in h_lines(ledger) if x.startswith("call")] == [f"call {run_id}:{n}" for n in (1, 2, 3)]
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code, run.unwinding) == ("failed", "tool_call_failed", True)


def _intake_children(community, event_id, payloads, start_at):
    env = {**os.environ, "DATABASE_URL": database_url(connection.settings_dict)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.agents_intake_child",
                str(community.id),
                "slack",
                event_id,
                json.dumps(p),
                AGENT.hex(),
                str(start_at),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in payloads
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        results.append(json.loads(out.splitlines()[-1]))
    return results


def test_eight_processes_intaking_the_same_event_create_one_run_and_all_get_its_id(community):
    results = _intake_children(community, "ev-race", [{"text": "hi"}] * 8, time.time() + 4)
    run_ids = {r["run_id"] for r in results}
    assert len(run_ids) == 1
    assert sorted(r["outcome"] for r in results) == ["Created"] + ["Duplicate"] * 7
    assert AgentRun.objects.filter(community_id=community.id).count() == 1
    assert IntakeKey.objects.filter(community_id=community.id).count() == 1
    (run_id,) = run_ids
    results = _intake_children(community, "ev-race", [{"text": "other"}] * 2, time.time() + 2)
    assert [r["outcome"] for r in results] == ["IdempotencyConflict"] * 2
    assert {r["run_id"] for r in results} == {run_id}
    assert AgentRun.objects.filter(community_id=community.id).count() == 1


def test_eight_processes_with_two_payloads_leave_one_run_and_nothing_half_written(community):
    payloads = [{"text": "a"}] * 4 + [{"text": "b"}] * 4
    results = _intake_children(community, "ev-mixed", payloads, time.time() + 4)
    assert len({r["run_id"] for r in results}) == 1
    outcomes = sorted(r["outcome"] for r in results)
    assert outcomes.count("Created") == 1
    assert outcomes.count("Duplicate") == 3 and outcomes.count("IdempotencyConflict") == 4
    assert AgentRun.objects.filter(community_id=community.id).count() == 1
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM buzz_agents_intake_key k LEFT JOIN buzz_agents_run r"
            " ON r.community_id = k.community_id AND r.id = k.run_id WHERE r.id IS NULL"
        )
        assert cursor.fetchone()[0] == 0


def test_two_workers_racing_for_a_decided_approval_resume_it_exactly_once(community, ledger):
    run_id = new_run(community.id)
    code, summary, err = worker(community, "approve_then_call", ledger)
    assert code == 0 and summary["parked"] == 1, err
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.lease_until) == ("waiting_approval", None)
    decide_approval(community.id, run.approval_id, "approved", "alice")
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "AGENT_LEDGER": str(ledger),
    }
    cmd = [
        sys.executable, "manage.py", "run_agent_worker", "--handler", "tests.agent_handlers:approve_then_call",
        "--agent", AGENT.hex(), "--community", str(community.id), "--exit-when-idle", "--poll-seconds", "0.1",
    ]  # fmt: skip
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    summaries = [json.loads(p.communicate(timeout=60)[0].splitlines()[-1]) for p in procs]
    assert sum(s["completed"] for s in summaries) == 1
    assert sum(s["claimed"] for s in summaries) == 1
    assert [x for x in h_lines(ledger) if x.startswith("resumed")] == [f"resumed {run_id}"]
    assert AgentRun.objects.get(id=run_id).output == {"decision": "approved", "calls": [1, 2]}
    assert claim_agent_runs(community.id, [AGENT], worker_id="late") == []


def test_sigterm_drains_the_in_flight_run_and_prints_the_summary(community, ledger, tmp_path):
    new_run(community.id)
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "AGENT_LEDGER": str(ledger),
    }
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "run_agent_worker", "--handler", "tests.agent_handlers:three_calls",
         "--agent", AGENT.hex(), "--community", str(community.id), "--poll-seconds", "0.1"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.time() + 30
    while AgentRun.objects.filter(community_id=community.id, state="completed").count() < 1:
        assert time.time() < deadline
        time.sleep(0.1)
    proc.terminate()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert json.loads(out.splitlines()[-1])["completed"] == 1


def test_h_module_is_importable():
    assert callable(h.three_calls)


def test_the_heartbeat_thread_renews_and_tells_a_cancelled_handler(community):
    from buzz_delivery.agents.runtime import Context, Heartbeat
    from buzz_delivery.agents.services import cancel_agent_run

    run_id = new_run(community.id)
    (claim,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    ctx = Context(claim)
    beat = Heartbeat(every=0.1, lease_seconds=30)
    beat.hold(ctx)
    beat.start()
    try:
        deadline = time.time() + 20
        while beat.renewed < 2:
            assert time.time() < deadline
            time.sleep(0.05)
        assert AgentRun.objects.get(id=run_id).heartbeat_at > claim.run.heartbeat_at
        cancel_agent_run(community.id, run_id)
        while not ctx.cancelled:
            assert time.time() < deadline
            time.sleep(0.05)
        assert ctx.lost.is_set()
    finally:
        beat.stop.set()
        beat.join(5)


def test_reap_agent_runs_command_reclaims_and_prints_its_summary(community):
    import io

    from django.core.management import call_command

    run_id = new_run(community.id)
    claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    backdate_run_lease(run_id)
    out = io.StringIO()
    call_command("reap_agent_runs", stdout=out)
    assert "reclaimed" in out.getvalue()
    assert AgentRun.objects.get(id=run_id).state == "pending"


def test_run_agent_worker_refuses_a_bad_handler_with_exit_2(community, ledger):
    code, _, err = worker(community, "no_such_handler", ledger)
    assert code == 2, err


def test_sigterm_with_a_hung_handler_gives_the_run_up_at_the_end_of_the_grace_and_exits_3(community, ledger):
    run_id = new_run(community.id)
    env = {**os.environ, "DATABASE_URL": database_url(connection.settings_dict), "AGENT_LEDGER": str(ledger)}
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "run_agent_worker", "--handler", "tests.agent_handlers:hangs",
         "--agent", AGENT.hex(), "--community", str(community.id), "--poll-seconds", "0.1",
         "--shutdown-grace", "1"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.time() + 30
    while f"entered {run_id}" not in h.ledger_lines():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.terminate()
    # The 1 s grace and the exit, not the hung handler (it never returns): 60 s leaves a loaded
    # machine room (communicate raises TimeoutExpired past it).
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert json.loads(out.splitlines()[-1])["abandoned"] == 1
    assert AgentRun.objects.get(id=run_id).state == "running"  # its lease lapses; the reaper reclaims it


@pytest.mark.parametrize("end", ["cancel", "exhausted"])
def test_a_cancelled_or_exhausted_run_is_compensated_3_2_1_once_each_across_a_killed_worker(community, ledger, end):
    """Real worker processes: the first is killed (SIGKILL) right after undoing entry 2; the
    next one takes over and finishes the undo; each compensation's effect happens once."""
    from buzz_delivery.agents.services import cancel_agent_run

    run_id = new_run(community.id, max_attempts=1)
    code, _, err = worker(community, "three_calls", ledger, "--max-runs", "1", kill="after:3")
    assert code == -9, err  # all three calls made and recorded, then the holder died
    if end == "cancel":
        cancel_agent_run(community.id, run_id)
    else:
        backdate_run_lease(run_id)
        assert reap_agent_runs().unwinding == 1
    ledger.with_suffix(".killed").unlink()  # arm the second kill
    code, _, err = worker(community, "three_calls", ledger, kill="undo:2")
    assert code == -9, err
    statuses = dict(JournalEntry.objects.filter(run_id=run_id).values_list("seq", "compensation_status"))
    assert statuses == {1: None, 2: "compensating", 3: "compensated"}
    backdate_run_lease(run_id)
    assert reap_agent_runs().reclaimed == 1  # an unwinding run is reclaimed whatever its attempts
    make_claimable(run_id)
    code, summary, err = worker(community, "three_calls", ledger)
    assert code == 0 and summary["compensated"] == 1, err
    assert [x for x in h_lines(ledger) if x.startswith("undo")] == [f"undo {run_id}:{n}:compensate" for n in (3, 2, 1)]
    assert [x for x in h_lines(ledger) if x.startswith("call")] == [f"call {run_id}:{n}" for n in (1, 2, 3)]
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == (
        ("cancelled", "cancelled") if end == "cancel" else ("failed", "attempts_exhausted")
    )


@pytest.mark.parametrize("mode", [[], ["--async"]])
def test_a_failed_runs_log_line_names_its_failure_code(community, ledger, mode):
    """``failed run=...`` said that a run failed but not why: the line names the code it recorded."""
    run_id = new_run(community.id)
    code, summary, err = worker(community, "fails_with_code", ledger, *mode)
    assert code == 0, err
    assert summary["failed"] == 1, summary
    assert AgentRun.objects.get(id=run_id).failure_code == "quota_spent"
    assert f"failed run={run_id} code='quota_spent'" in err, err
