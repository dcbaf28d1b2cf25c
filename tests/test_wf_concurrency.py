"""The engine under real concurrency (SPEC section 11): threads and processes settling one
send_message step's deliveries at once, with the reaper; approvals decided by two operators at
once; the orchestrator as a real process (``run_workflow_worker``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from django.db import connection, connections

from buzz_delivery import services
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.models import Approval, Run, Step
from buzz_delivery.workflows.services import AlreadyDecided, Decided, decide_approval, get_run
from buzz_delivery.workflows.testing import diamond, function_step, run_until_idle, send_step
from project.database_url import database_url
from tests.conftest import BARRIER_TIMEOUT
from tests.wf_support import start

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.django_db(transaction=True)


def env() -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "BUZZ_MIN_LEASE_SECONDS": "1",
        "PYTHONPATH": str(ROOT),
    }


def in_threads(n: int, target) -> list:
    barrier = threading.Barrier(n, timeout=BARRIER_TIMEOUT)
    results: list = [None] * n

    def body(i: int) -> None:
        try:
            barrier.wait()
            results[i] = target(i)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_concurrent_settles_advance_the_run_exactly_once(community):
    workflow = WorkflowFactory(community=community)
    targets = [random32() for _ in range(24)]
    run = start(workflow, {"steps": [send_step("send", targets), function_step("after", depends_on=["send"])]})
    run_until_idle(community.id)
    claims = [services.claim_delivery(community.id, t, lease_seconds=30) for t in targets]

    def settle(i: int) -> list:
        return [
            services.finish_delivery(c.lease, "finished" if j % 5 else "failed")
            for j, c in enumerate(claims)
            if j % 6 == i
        ]

    results = in_threads(6, settle)
    assert sum(len(r) for r in results) == 24
    step = Step.objects.get(run_id=run.pk, key="send")
    failed = WorkflowAgentDelivery.objects.filter(run_id=run.pk, status="failed").count()
    assert (step.delivered_terminal, step.delivered_failed) == (24, failed)
    assert step.state == "failed"  # tolerate_failures = 0
    after = Step.objects.get(run_id=run.pk, key="after")
    assert after.state == "canceled" and Run.objects.get(pk=run.pk).state == "failed"
    assert Run.objects.get(pk=run.pk).steps_left == 0


def test_two_operators_deciding_at_once_one_wins_and_the_step_resumes_once(community):
    workflow = WorkflowFactory(community=community)
    run = start(
        workflow,
        {
            "steps": [
                {"key": "ok", "kind": "approval", "deadline_seconds": 600},
                function_step("after", depends_on=["ok"]),
            ]
        },
    )
    run_until_idle(community.id)
    approval = Approval.objects.get(run_id=run.pk)
    results = in_threads(
        2, lambda i: decide_approval(community.id, approval.id, ["approved", "rejected"][i], f"operator-{i}")
    )
    assert sorted(type(r).__name__ for r in results) == ["AlreadyDecided", "Decided"]
    winner = next(r for r in results if isinstance(r, Decided))
    loser = next(r for r in results if isinstance(r, AlreadyDecided))
    assert (loser.state, loser.decided_by) == (winner.state, winner.decided_by)
    step = Step.objects.get(run_id=run.pk, key="ok")
    assert step.state == ("succeeded" if winner.state == "approved" else "failed")
    after = Step.objects.get(run_id=run.pk, key="after")
    if winner.state == "approved":
        assert (after.state, after.deps_done) == ("ready", 1)  # resumed exactly once
    else:  # a rejection fails the step; under on_error fail_run the run fails
        assert after.state == "canceled" and Run.objects.get(pk=run.pk).state == "failed"


def start_process(*args: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=env(), stdout=stdout, stderr=subprocess.PIPE, text=True
    )


def test_a_send_to_200_targets_settled_by_8_processes_and_the_reaper_completes_once(community):
    workflow = WorkflowFactory(community=community)
    targets = [random32() for _ in range(200)]
    run = start(
        workflow,
        {
            "steps": [
                send_step("send", targets, tolerate_failures=200),
                function_step(
                    "after", "echo", depends_on=["send"], input={"n": {"$ref": "steps.send.output.delivered"}}
                ),
            ]
        },
    )
    orchestrator = start_process(
        "manage.py",
        "run_workflow_worker",
        "--community",
        str(community.id),
        "--poll-interval",
        "5",
        "--lease-seconds",
        "5",
    )
    deadline = time.monotonic() + 30
    while WorkflowAgentDelivery.objects.filter(run_id=run.pk).count() < 200:
        assert time.monotonic() < deadline, "the orchestrator did not commit the deliveries"
        time.sleep(0.1)
    reaper = start_process("manage.py", "reap_deliveries", "--loop", "--interval", "0.3")
    settlers = [
        start_process("-m", "tests.wf_settler", str(community.id), ",".join(t.hex() for t in targets[i::8]), str(i))
        for i in range(8)
    ]
    for p in settlers:
        out, err = p.communicate(timeout=150)
        assert p.returncode == 0, err
    reaper.send_signal(signal.SIGTERM)
    reaper.communicate(timeout=30)
    # The last settle made "after" ready; its NOTIFY wakes the orchestrator well before its 5 s poll,
    # but a loaded machine (Citus) may take more than 4 s to claim and run it: a SIGTERM before
    # that leaves the run running and the test failed on the state, not on the wake.
    deadline = time.monotonic() + 60
    while Run.objects.get(pk=run.pk).state == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    orchestrator.send_signal(signal.SIGTERM)
    out, err = orchestrator.communicate(timeout=60)
    assert orchestrator.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["reason"], summary["errors"], summary["claimed"]) == ("SIGTERM", 0, 2)

    rows = WorkflowAgentDelivery.objects.filter(run_id=run.pk)
    assert rows.count() == 200 and not rows.exclude(status__in=["finished", "failed", "expired"]).exists()
    step = Step.objects.get(run_id=run.pk, key="send")
    assert step.delivered_terminal == 200
    assert step.delivered_failed == rows.exclude(status="finished").count()
    assert step.state == "succeeded"
    assert step.output == {"delivered": 200 - step.delivered_failed, "failed": step.delivered_failed}
    after = Step.objects.get(run_id=run.pk, key="after")
    assert (after.state, after.attempts, after.deps_done) == ("succeeded", 1, 1)
    assert after.output == {"n": 200 - step.delivered_failed}
    final = Run.objects.get(pk=run.pk)
    assert (final.state, final.steps_left) == ("succeeded", 0)


def test_the_orchestrator_process_runs_diamonds_of_all_communities_and_drains_on_sigterm(community):
    from buzz_delivery.testing import CommunityFactory

    runs = [start(WorkflowFactory(community=c), diamond()) for c in (community, CommunityFactory())]
    proc = start_process("manage.py", "run_workflow_worker", "--all", "--poll-interval", "0.2")
    deadline = time.monotonic() + 30
    while not all(get_run(r.community_id, r.pk).state == "succeeded" for r in runs):
        assert time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else "runs did not finish"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["reason"], summary["claimed"], summary["succeeded"], summary["exit_code"]) == ("SIGTERM", 8, 8, 0)


def test_reap_workflow_steps_command_prints_a_summary_and_is_guarded(community):
    out = subprocess.run(
        [sys.executable, "manage.py", "reap_workflow_steps", "--json"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    summary = json.loads(out.strip())
    assert summary["outcome"] == "ok" and summary["reclaimed"] == 0
