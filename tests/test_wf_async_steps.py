"""``async def`` function steps on the orchestrator's event loop (issue 29): awaited as tasks on
one thread, up to ``--async-concurrency`` at once, with no database connection each, so a
thousand steps waiting on I/O hold the worker's few connections (dispatcher, completer, renewer,
listener, heartbeat, and the step threads that ran something). Everything that touches the
database happens off the loop: the claim and the input on the thread that claimed, completions
and failures on the completer, renewals on the renewer. Real processes where it counts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command
from django.db import connection
from django.db.models.functions import Now

from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.orchestrator import OrchestratorConfig, mixed_room, run_orchestrator
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from buzz_delivery.workflows.testing import function_step
from tests import wf_async_steps  # noqa: F401  (registers the steps in this process)
from tests.test_wf_concurrency import ROOT, env
from tests.test_worker_async import ConnectionSampler
from tests.wf_support import start

pytestmark = pytest.mark.django_db(transaction=True)

BUDGET = 8  # --concurrency 2: dispatcher, completer, renewer, listener, heartbeat, 2 step threads


def worker(community, *args: str, appname: str = "buzz-async-steps") -> subprocess.Popen:
    command = [sys.executable, "-m", "tests.wf_async_worker", "--community", str(community.id), *args]
    return subprocess.Popen(
        command, cwd=ROOT, env={**env(), "PGAPPNAME": appname}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def summary_of(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def peak_overlap(spans: list[tuple[float, float]]) -> int:
    """The most (start, end) spans open at one moment."""
    marks = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans], key=lambda m: (m[0], m[1]))
    peak = current = 0
    for _, step in marks:
        current += step
        peak = max(peak, current)
    return peak


def test_a_thousand_waiting_async_steps_run_at_once_within_the_connection_budget(community):
    workflow = WorkflowFactory(community=community)
    each = {"kind": "function", "function": "asteps.wait", "input": {"sleep": 3, "i": {"$ref": "item"}}}
    run = start(
        workflow,
        {"steps": [{"key": "each", "kind": "map", "over": {"$ref": "input.items"}, "do": each}]},
        {"items": list(range(1000))},
    )
    sampler = ConnectionSampler("buzz-async-steps")
    sampler.start()
    proc = worker(
        community, "--concurrency", "2", "--async-concurrency", "1000", "--lease-seconds", "30",
        "--idle-exit", "2", "--poll-interval", "0.5",
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        sampler.stop.set()
        sampler.join()
    assert proc.returncode == 0, err[-3000:]
    summary = summary_of(out)
    assert (summary["awaited"], summary["errors"], summary["handed_back"]) == (1000, 0, 0), summary
    final = Run.objects.get(pk=run.pk)
    assert final.state == "succeeded"
    outputs = Step.objects.get(community_id=community.id, run_id=run.pk, key="each").output
    assert [o["i"] for o in outputs] == list(range(1000))
    assert {o["attempt"] for o in outputs} == {1}
    # Each step waits 3 s (2 s was too short on a loaded cluster: claiming the thousand took
    # that long): step threads (at most 256) would hold them back; the loop held
    # almost all of the thousand waiting at the same moment...
    assert peak_overlap([(o["started"], o["ended"]) for o in outputs]) >= 900
    # ...on a fixed number of connections, not one per step in flight.
    assert 1 <= sampler.peak <= BUDGET, sampler.peak


def test_a_killed_orchestrator_s_async_steps_are_reclaimed_after_the_lease_and_complete_once(community):
    workflow = WorkflowFactory(community=community)
    runs = [start(workflow, {"steps": [function_step("a", "asteps.hang_first")]}) for _ in range(20)]
    steps = Step.objects.filter(community_id=community.id, key="a")
    first = worker(community, "--lease-seconds", "2", "--poll-interval", "0.2", appname="buzz-async-first")
    try:
        deadline = time.monotonic() + 30
        while steps.filter(state="running").count() < 20:
            assert time.monotonic() < deadline, "the first orchestrator did not start the 20 steps"
            time.sleep(0.1)
        time.sleep(3)  # past their first lease (2 s): the renewer keeps them while they await
        assert steps.filter(state="running", lease_until__gt=Now(), lease_generation=1).count() == 20
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    second = worker(community, "--lease-seconds", "2", "--poll-interval", "0.2", appname="buzz-async-second")
    try:
        deadline = time.monotonic() + 60
        while Run.objects.filter(run_id__in=[r.pk for r in runs], state="succeeded").count() < 20:
            assert time.monotonic() < deadline, "the killed orchestrator's steps did not complete elsewhere"
            reap_workflow_steps()  # the maintenance: lapsed leases go back to ready
            time.sleep(0.2)
    finally:
        second.send_signal(signal.SIGTERM)
        out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err[-3000:]
    for step in steps:
        assert (step.state, step.attempts, step.output["attempt"]) == ("succeeded", 2, 2)
        settles = [(e["status"], e["generation"]) for e in step.history if e["event"] == "settle"]
        assert settles == [("succeeded", step.lease_generation)], step.history  # once, by the second holder
    assert summary_of(out)["awaited"] == 20


def wait_running(steps, n: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while steps.filter(state="running").count() < n:
        assert proc.poll() is None and time.monotonic() < deadline, "the steps did not start"
        time.sleep(0.1)


def test_sigterm_drains_the_loop_s_steps_within_the_grace_and_abandons_them_past_it(community):
    workflow = WorkflowFactory(community=community)
    short = [start(workflow, {"steps": [function_step("a", "asteps.wait", input={"sleep": 2})]}) for _ in range(10)]
    steps = Step.objects.filter(community_id=community.id, run_id__in=[r.pk for r in short])
    proc = worker(community, "--shutdown-grace", "20", "--poll-interval", "0.2")
    wait_running(steps, 10, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    summary = summary_of(out)
    assert (summary["reason"], summary["awaited"], summary["succeeded"], summary["abandoned"]) == (
        "SIGTERM", 10, 10, 0,
    )  # fmt: skip
    assert set(steps.values_list("state", flat=True)) == {"succeeded"}

    long = [start(workflow, {"steps": [function_step("a", "asteps.wait", input={"sleep": 60})]}) for _ in range(10)]
    steps = Step.objects.filter(community_id=community.id, run_id__in=[r.pk for r in long])
    proc = worker(community, "--shutdown-grace", "1", "--poll-interval", "0.2")
    wait_running(steps, 10, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err[-3000:]  # in-flight steps abandoned at the end of the grace
    summary = summary_of(out)
    assert (summary["reason"], summary["abandoned"], summary["succeeded"], summary["failed"]) == ("SIGTERM", 10, 0, 0)
    # Their leases are left to lapse (the maintenance reclaims them); nothing was recorded.
    assert set(steps.values_list("state", "attempts")) == {("running", 1)}


def test_an_async_step_s_outcomes_are_a_plain_step_s_and_a_plain_step_runs_beside_it(community):
    workflow = WorkflowFactory(community=community)
    whats = ["ok", "permanent", "ordinary", "retry_after", "exit", "cancelled", "not_json"]
    definition = {
        "steps": [
            *(
                function_step(w, "asteps.raise", input={"what": w}, on_error="continue", retry={"max_attempts": 3})
                for w in whats
            ),
            function_step(
                "last_try", "asteps.raise", input={"what": "ordinary"}, on_error="continue", retry={"max_attempts": 1}
            ),
            function_step("plain", "asteps.sync", input={"i": 1}),
        ]
    }
    run = start(workflow, definition)
    config = OrchestratorConfig(community_id=community.id, concurrency=2, idle_exit=0.5, poll_interval=0.1)
    summary = run_orchestrator(config, handle_signals=False)
    assert (summary["exit_code"], summary["errors"], summary["awaited"]) == (0, 0, 8), summary
    rows = {s.key: s for s in Step.objects.filter(community_id=community.id, run_id=run.pk)}
    got = {k: (s.state, s.failure_code, s.attempts) for k, s in rows.items()}
    assert got["ok"] == ("succeeded", None, 1) and rows["ok"].output == {"ok": True}
    assert got["permanent"] == ("failed", "async_refused", 1)
    assert got["exit"] == ("failed", "function_aborted", 1)
    assert got["cancelled"] == ("failed", "function_aborted", 1)
    assert "CancelledError" in rows["cancelled"].failure_message
    assert got["not_json"] == ("failed", "output_not_json", 1)
    assert got["last_try"] == ("failed", "attempts_exhausted", 1)
    assert "RuntimeError: async boom" in rows["last_try"].failure_message
    assert got["plain"] == ("succeeded", None, 1) and rows["plain"].output == {"plain": True, "i": 1}
    # An ordinary exception is retried with backoff; one carrying retry_after not before then.
    assert rows["ordinary"].state == "ready" and rows["ordinary"].next_attempt_at is not None
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        (now,) = cursor.fetchone()
    assert rows["retry_after"].state == "ready"
    assert (rows["retry_after"].next_attempt_at - now).total_seconds() > 3000
    assert (rows["ordinary"].next_attempt_at - now).total_seconds() < 3000


def test_plain_steps_proceed_while_the_loop_is_full_and_steps_waiting_for_it_are_handed_back_not_lost(community):
    workflow = WorkflowFactory(community=community)
    slow = {"steps": [function_step("a", "asteps.wait", input={"sleep": 2})]}
    plain = {"steps": [function_step("a", "asteps.sync", input={"i": 1})]}
    runs = [start(workflow, slow if i % 2 else plain) for i in range(16)]  # 8 of each, interleaved
    config = OrchestratorConfig(
        community_id=community.id, concurrency=2, async_concurrency=4, idle_exit=0.5, poll_interval=0.5
    )
    summary = run_orchestrator(config, handle_signals=False)
    assert (summary["exit_code"], summary["errors"], summary["succeeded"]) == (0, 0, 16), summary
    assert summary["awaited"] == 8 and summary["handed_back"] >= 1  # queued for the full loop past a poll
    steps = Step.objects.filter(community_id=community.id, run_id__in=[r.pk for r in runs])
    assert set(steps.values_list("state", "attempts")) == {("succeeded", 1)}  # a hand-back gives the attempt back
    ended = {s.run_id: s.finished_at for s in steps}
    plain_done = max(ended[r.pk] for i, r in enumerate(runs) if not i % 2)
    async_done = sorted(ended[r.pk] for i, r in enumerate(runs) if i % 2)
    # Four at a time on the loop: two rounds of 2 s; the plain steps did not wait for them.
    assert (async_done[-1] - async_done[0]).total_seconds() >= 1.5
    assert (async_done[-1] - plain_done).total_seconds() >= 1.5


def test_a_claim_is_sized_for_both_the_step_threads_and_the_loop():
    # Only plain steps lately: the step threads' room, as without async functions.
    assert mixed_room(threads=4, tasks=1000, share=0.0, batch=32) == 4
    # Only async steps lately: the loop's room (a batch at most).
    assert mixed_room(threads=0, tasks=1000, share=1.0, batch=32) == 32
    assert mixed_room(threads=4, tasks=10, share=0.999, batch=32) == 10
    # The loop full of mostly async steps: nothing (plain steps queued behind them wait their turn).
    assert mixed_room(threads=4, tasks=0, share=0.98, batch=32) == 0
    # Step threads all busy, half the steps async: still a claim, so async steps proceed...
    assert mixed_room(threads=0, tasks=1000, share=0.5, batch=32) > 0
    # ...but not once plain ones wait a batch beyond the threads.
    assert mixed_room(threads=-16, tasks=1000, share=0.5, batch=32) == 0


def test_async_concurrency_is_bounded_by_name():
    for bad in (0, 10_001):
        with pytest.raises(ValidationError, match="async_concurrency"):
            OrchestratorConfig(community_id=None, async_concurrency=bad)
    with pytest.raises(CommandError, match="--async-concurrency: must be at most 10000"):
        call_command("run_workflow_worker", "--all", "--async-concurrency", "10001")
