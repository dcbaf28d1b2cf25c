"""Liveness of the orchestrators (issue 28): with K = 1, 2 and 4 ``run_workflow_worker``
processes, no step stays claimed longer than one poll interval (plus scheduling slack) without
its function starting; a claim no step thread can start soon is handed back, never held and
renewed for work nobody does. Measured from each step's own history (the claim of the attempt
that ran, database clock) to its function's first line (host clock: one machine)."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from buzz_delivery.services import Cause
from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.services import publish_definition, start_run
from buzz_delivery.workflows.testing import diamond, function_step
from tests.test_wf_concurrency import ROOT, env

pytestmark = pytest.mark.django_db(transaction=True)

POLL = 0.5
SLACK = 1.0  # scheduling on a loaded 2-core machine


def orchestrators(community, k: int, log, concurrency: int) -> list[subprocess.Popen]:
    args = [
        sys.executable, "-m", "tests.wf_poison_worker", "--community", str(community.id),
        "--concurrency", str(concurrency), "--poll-interval", str(POLL), "--lease-seconds", "30", "-v", "0",
    ]  # fmt: skip
    environ = {**env(), "BUZZ_TEST_LIVENESS_LOG": str(log)}
    return [
        subprocess.Popen(args, cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(k)
    ]


def stop(procs: list[subprocess.Popen]) -> list[dict]:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    summaries = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        summaries.append(json.loads(out.strip().splitlines()[-1]))
    return summaries


def start_runs(workflow, n: int, input: dict | None = None) -> list:
    return [
        start_run(workflow.community_id, workflow.id, input or {}, cause=Cause.event(os.urandom(32))).pk
        for _ in range(n)
    ]


def wait_done(community, ids: list, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while Run.objects.filter(community_id=community.id, run_id__in=ids, state="succeeded").count() < len(ids):
        assert time.monotonic() < deadline, f"runs not done within {timeout} s"
        time.sleep(0.05)


def claim_to_start(community, log) -> dict[tuple[str, str], float]:
    """Seconds from the claim of the attempt that ran to its function's start, per (run, step)."""
    started: dict[tuple[str, str], float] = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        started.setdefault((entry["run"], entry["key"]), entry["at"])
    delays = {}
    for step in Step.objects.filter(community_id=community.id, state="succeeded"):
        [claim] = [e for e in step.history if e["event"] == "claim" and e["generation"] == step.lease_generation]
        claimed_at = dt.datetime.fromisoformat(claim["at"]).timestamp()
        delays[(str(step.run_id), step.key)] = started[(str(step.run_id), step.key)] - claimed_at
    return delays


@pytest.mark.parametrize("k", [1, 2, 4])
def test_no_step_stays_claimed_past_a_poll_interval_without_running(community, tmp_path, k):
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, diamond("liveness.record"))
    log = tmp_path / "started.jsonl"
    procs = orchestrators(community, k, log, concurrency=2)
    try:
        ids = []
        for wave in range(3):  # repeated: bursts with pauses between them
            batch = start_runs(workflow, 25)
            wait_done(community, batch)
            ids += batch
            time.sleep(0.2 * wave)
    finally:
        summaries = stop(procs)

    delays = claim_to_start(community, log)
    assert len(delays) == 4 * len(ids)
    worst = max(delays.items(), key=lambda item: item[1])
    assert worst[1] <= POLL + SLACK, f"K={k}: {worst} claimed {worst[1]:.2f} s before it ran"
    assert sum(s["errors"] for s in summaries) == 0


def released(steps) -> bool:
    return any(entry["event"] == "release" for history in steps.values_list("history", flat=True) for entry in history)


def test_claims_queued_behind_a_slow_step_are_handed_back_not_held(community, tmp_path):
    """Fails on main: the orchestrator queued the fast steps it claimed behind its only thread's
    slow step and held them (running, renewable) until that step ended; now they are handed
    back within a poll interval (ready for any orchestrator) and run once the thread is free."""
    fast_wf, slow_wf = WorkflowFactory(community=community), WorkflowFactory(community=community)
    publish_definition(community.id, fast_wf.id, {"steps": [function_step("f", "liveness.record")]})
    slow_step = function_step("s", "liveness.record", input={"sleep": {"$ref": "input.sleep"}})
    publish_definition(community.id, slow_wf.id, {"steps": [slow_step]})
    log = tmp_path / "started.jsonl"
    procs = orchestrators(community, 1, log, concurrency=1)
    try:
        warm = start_runs(fast_wf, 20)  # it learns that steps are fast: it claims ahead
        wait_done(community, warm)
        # The slow step first: it starts on the only thread; the fast ones, ready right after, are
        # claimed ahead (the thread has not been on its step long yet) and queue behind it.
        (slow,) = start_runs(slow_wf, 1, {"sleep": 6})
        fast = start_runs(fast_wf, 20)
        deadline = time.monotonic() + POLL + SLACK + 1.5
        fast_steps = Step.objects.filter(community_id=community.id, run_id__in=fast)
        while fast_steps.filter(state="running").exists() or not released(fast_steps):
            states = sorted(fast_steps.values_list("state", flat=True))
            assert time.monotonic() < deadline, f"the fast steps stayed claimed behind the slow one: {states}"
            time.sleep(0.05)
        assert Run.objects.get(pk=slow).state == "running"  # still on the only thread
        wait_done(community, [slow, *fast])
    finally:
        summaries = stop(procs)

    delays = claim_to_start(community, log)
    worst = max(delays.items(), key=lambda item: item[1])
    assert worst[1] <= POLL + SLACK, f"{worst} claimed {worst[1]:.2f} s before it ran"
    assert summaries[0]["handed_back"] >= 1  # those claimed ahead (the rest were never claimed there)
    assert summaries[0]["renewed"] == 0  # no lease renewed for a claim nobody ran
