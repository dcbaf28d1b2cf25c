"""``manage.py demo`` end to end on a small workload: real worker subprocesses on the test
database, a worker killed with SIGKILL, the reaper, a fenced community, and the report's
exactly-once check — which must pass here, and must fail when its evidence is tampered with.

The demo runs once for the module (the same seeded workload each test used to run again, some
50 s each): its rows are committed, and each test reads them inside its own transaction, rolled
back at its end, so one test's tampering never reaches another. The module's rows are flushed
afterwards, as a transactional test's would be."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from buzz_delivery.workflows.models import Approval, Step
from project.demo.models import DemoRun, StateChange, StatusChange, ToolEffect
from project.demo.report import ReaperTally, RunFacts, WorkerOutcome, build_report
from project.demo.system import build_system_checks, system_facts_from

DELIVERIES = 150

# Each test in a transaction rolled back at its end: the demo's committed rows (the module's
# fixture) stay as the demo left them for the next test.
pytestmark = pytest.mark.django_db


def _facts_from(report: dict) -> RunFacts:
    """Rebuild the report's inputs from a stored report (to recompute it after tampering)."""
    return RunFacts(
        run_id=uuid.UUID(report["run"]),
        community_ids=[uuid.UUID(c["id"]) for c in report["communities"]],
        committed_by_community={uuid.UUID(c["id"]): c["committed"] for c in report["communities"]},
        committed=report["committed"],
        runs=report["workflow_runs"],
        deduplicated=report["producer_retries_deduplicated"],
        fenced_id=None,
        workers=[WorkerOutcome(**w) for w in report["workers"]],
        reaper=ReaperTally(**report["reaper"]),
        seconds=report["seconds"],
    )


def _failed_checks(report: dict) -> list[str]:
    return [c["name"] for c in report["checks"] if not c["passed"]]


def _log_tails(log_dir: Path, lines: int = 15) -> str:
    """The last lines of every worker's log of a demo run (for a failed run's message)."""
    tails = []
    for log in sorted(log_dir.rglob("*.log")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        tails.append(f"--- {log.name}\n" + "\n".join(text))
    return "\n".join(tails)


@pytest.fixture(scope="module")
def demo_run(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[tuple[dict, str]]:
    """One demo run, committed (its workers are processes), shared by the module's tests."""
    tmp_path = tmp_path_factory.mktemp("demo")
    with django_db_blocker.unblock(), pytest.MonkeyPatch.context() as monkeypatch:
        # The workers' logs go to a temporary folder, not the checkout's var/demo/<run>.
        monkeypatch.setenv("BUZZ_DEMO_LOG_DIR", str(tmp_path / "demo"))
        out = io.StringIO()
        try:
            try:
                call_command(
                    "demo",
                    deliveries=DELIVERIES,
                    communities=2,
                    agents=2,
                    concurrency=1,
                    rate=300.0,
                    lease_seconds=3.0,
                    timeout=120.0,
                    seed=7,
                    stdout=out,
                )
            except CommandError as exc:  # say which check and which worker, not only that one failed
                raise AssertionError(f"{exc}\n{out.getvalue()}\n{_log_tails(tmp_path / 'demo')}") from exc
            run = DemoRun.objects.get()
            assert run.passed is True and run.finished_at is not None and run.report is not None
            assert (tmp_path / "demo" / str(run.id)).is_dir()
            yield run.report, out.getvalue()
        finally:
            # What a transactional test's teardown does: the next modules start from empty tables.
            call_command("flush", verbosity=0, interactive=False)


@pytest.fixture
def demo_report(demo_run) -> tuple[dict, str]:
    return demo_run


def test_demo_settles_every_delivery_of_healthy_communities_exactly_once(demo_report):
    report, output = demo_report
    assert _failed_checks(report) == []
    assert report["passed"] is True
    assert "Exactly-once check: passed" in output

    # Counts add up: everything committed is accounted for, per community and in total.
    assert report["committed"] == DELIVERIES
    assert report["status"]["total"] == DELIVERIES
    assert sum(c["committed"] for c in report["communities"]) == DELIVERIES
    for community in report["communities"]:
        assert sum(community["status"].values()) == community["committed"]

    # One community was fenced midway; the other stayed active and settled everything.
    states = sorted(c["state"] for c in report["communities"])
    assert states == ["active", "fenced"]
    (active,) = [c for c in report["communities"] if c["state"] == "active"]
    assert active["status"]["pending"] == active["status"]["claimed"] == 0
    assert (
        active["status"]["finished"] + active["status"]["failed"] + active["status"]["expired"] == active["committed"]
    )

    # The killed worker held leases and the reaper gave them back; the others stopped cleanly.
    (killed,) = [w for w in report["workers"] if w["killed"]]
    assert killed["summary"] is None
    assert report["reclaimed_from_dead_holders"] >= 1
    assert report["reaper"]["reclaimed"] >= report["reclaimed_from_dead_holders"]
    survivors = [w for w in report["workers"] if not w["killed"]]
    assert len(survivors) == 4
    assert all(w["returncode"] == 0 and w["summary"] is not None for w in survivors)
    settled_by_workers = sum(w["summary"]["finished"] + w["summary"]["failed"] for w in survivors)
    terminal = sum(report["status"][s] for s in ("finished", "failed", "expired"))
    assert settled_by_workers + report["reaper"]["exhausted"] + report["reaper"]["expired"] == terminal
    assert report["stale_settles_refused"] == sum(w["summary"]["lease_lost"] for w in survivors)
    assert report["latency_ms"]["p50"] is not None


def test_demo_check_fails_when_the_workers_and_the_database_disagree(demo_report):
    report, _ = demo_report
    # 1. A worker says it settled one more delivery than the database recorded for its leases.
    facts = _facts_from(report)
    worker = next(w for w in facts.workers if not w.killed and w.summary["finished"] > 0)
    worker.summary = {**worker.summary, "finished": worker.summary["finished"] + 1}

    tampered = build_report(facts)

    assert tampered["passed"] is False
    assert _failed_checks(tampered) == [
        "each worker's own counts match the settles the database recorded for its leases",
        "workers' finished + failed + the reaper's terminal moves = terminal deliveries",
    ]

    # 2. A lease is settled by a session that did not claim it (as a stale holder would).
    settle = StatusChange.objects.filter(run_id=report["run"], old_status="claimed", new_status="finished").first()
    (killed,) = [w for w in report["workers"] if w["killed"]]
    StatusChange.objects.filter(pk=settle.pk).update(application_name=killed["application_name"])

    tampered = build_report(_facts_from(report))

    assert tampered["passed"] is False
    assert _failed_checks(tampered) == [
        "every settle was made by the worker holding that lease (same generation it claimed)",
        "each worker's own counts match the settles the database recorded for its leases",
    ]


def test_demo_second_act_checks_each_layer_and_fails_when_the_database_disagrees(demo_report):
    """The second act (workflows, agent runs, journal, compensation, approvals, the gateway):
    every per-layer check passes on a small run, and each fails when its evidence is tampered with."""
    report, output = demo_report
    system = report["system"]
    assert [c["name"] for c in system["checks"] if not c["passed"]] == []
    assert "Exactly-once checks, per layer" in output
    layers = system["layers"]
    assert layers["workflows"]["runs"].get("canceled") == 1 and layers["workflows"]["sub_workflow_runs"] >= 1
    assert layers["workflows"]["steps"].get("skipped", 0) >= 1  # the condition was false somewhere
    assert layers["agents"]["reconciled"] >= 1 and layers["compensation"]["compensated"] >= 1
    assert layers["approvals"]["decided"] >= 1
    assert layers["gateway"]["remote_agent_runs"] == {"completed": 2}
    facts = system_facts_from(system["facts"])
    assert set(facts.killed) == {"workflow", "agent", "remote"}
    assert layers["approvals"]["workflow_approval_steps"] == 1
    assert layers["fence"]["state"] == "fenced" and layers["fence"]["live_runs"] >= 1
    assert facts.fenced_id not in facts.community_ids

    def failed() -> list[str]:
        _, checks = build_system_checks(facts)
        return [c.name for c in checks if not c.passed]

    assert failed() == []

    # 1. A journaled call's tool made its effect twice (as a resume that did not reconcile would).
    effect = ToolEffect.objects.filter(run_id=report["run"], kind="call", tool="search_kb").first()
    duplicate = ToolEffect.objects.create(
        run_id=effect.run_id, key=effect.key, kind="call", tool=effect.tool, worker_pid=effect.worker_pid
    )
    assert failed() == [
        "journal: every journaled call made its effect at most once (a resumed one reconciled, not made again)"
    ]
    duplicate.delete()

    # 2. A compensation ran twice.
    undo = ToolEffect.objects.filter(run_id=report["run"], kind="compensate").first()
    again = ToolEffect.objects.create(
        run_id=undo.run_id, key=undo.key, kind="compensate", tool=undo.tool, worker_pid=undo.worker_pid
    )
    assert failed() == ["compensation: the failed agent run's calls were compensated, each exactly once"]
    again.delete()

    # 3. An approval recorded as decided a second time.
    agent_approvals = Approval.objects.filter(step__isnull=True).values_list("id", flat=True)
    decided = StateChange.objects.filter(
        run_id=report["run"], table="buzz_workflows_approval", new_state="approved", row_id__in=list(agent_approvals)
    ).first()
    decided_twice = StateChange.objects.create(
        run_id=decided.run_id, table=decided.table, row_id=decided.row_id, community_id=decided.community_id,
        old_state="pending", new_state="approved", application_name="someone else", at=decided.at,
    )  # fmt: skip
    assert failed() == [
        "approvals: every approval decided exactly once, by the operator's one decision (a second decision refused)"
    ]
    decided_twice.delete()

    # 4. A step recorded as becoming terminal twice.
    step_move = StateChange.objects.filter(
        run_id=report["run"], table="buzz_workflows_step", new_state="succeeded", community_id__in=facts.community_ids
    ).first()  # (a step of the fenced community is the fence check's, below)
    twice = StateChange.objects.create(
        run_id=step_move.run_id, table=step_move.table, row_id=step_move.row_id,
        community_id=step_move.community_id, old_state="running", new_state="succeeded", at=step_move.at,
    )  # fmt: skip
    assert "workflows: each step became terminal exactly once (the audit of its state)" in failed()
    twice.delete()
    assert failed() == []

    # 5. A step of the fenced community moved after the fence (as a write the fence let through would).
    fenced_step = Step.objects.filter(community_id=facts.fenced_id).first()
    late = StateChange.objects.create(
        run_id=report["run"], table="buzz_workflows_step", row_id=fenced_step.id, community_id=facts.fenced_id,
        old_state="running", new_state="ready", at=datetime.fromisoformat(facts.fenced_at) + timedelta(seconds=1),
    )  # fmt: skip
    assert failed() == [
        "fence: the community fenced midway stayed where the fence found it (no state change, no history "
        "entry after it); the other communities' runs completed"
    ]
    late.delete()

    # 6. The workflow's approval step resumed twice (left waiting a second time).
    sign_off = Step.objects.get(run_id=facts.release_run_id, kind="approval")
    again = StateChange.objects.create(
        run_id=report["run"], table="buzz_workflows_step", row_id=sign_off.id, community_id=sign_off.community_id,
        old_state="waiting", new_state="running", at=decided.at,
    )  # fmt: skip
    assert failed() == [
        "approvals: the workflow's approval step was decided once by the operator and its step resumed once"
    ]
    again.delete()
    assert failed() == []

    # 7. The run the killed remote worker held is settled a second time, by the dead holder (appended
    #    to its history the way the services append; a history never shrinks, so this one comes last).
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_agents_run SET history = buzz_delivery_history_push(history, jsonb_build_object("
            "'event', 'settle', 'status', 'completed', 'generation', 1, 'actor', %s::text, 'at', now())) "
            "WHERE id = %s",
            [facts.kill_holders["remote"], facts.kill_leases["remote"]],
        )
    assert failed() == [
        "gateway: the run held by the killed remote worker was reaped, then settled once by its new holder "
        "(its first call replayed from the journal, made once)",
        "agents: every completed agent run was settled once, by the holder of that lease (its history)",
    ]
