"""``manage.py demo`` end to end on a small workload: real worker subprocesses on the test
database, a worker killed with SIGKILL, the reaper, a fenced community, and the report's
exactly-once check — which must pass here, and must fail when its evidence is tampered with."""

from __future__ import annotations

import io
import uuid

import pytest
from django.core.management import call_command

from project.demo.models import DemoRun, StatusChange
from project.demo.report import ReaperTally, RunFacts, WorkerOutcome, build_report

DELIVERIES = 150

pytestmark = pytest.mark.django_db(transaction=True)


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


@pytest.fixture
def demo_report() -> tuple[dict, str]:
    out = io.StringIO()
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
    run = DemoRun.objects.get()
    assert run.passed is True and run.finished_at is not None and run.report is not None
    return run.report, out.getvalue()


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
