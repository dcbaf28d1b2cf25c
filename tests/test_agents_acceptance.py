"""Built-in acceptance (issue 29): ``run_agent_worker`` accepts the deliveries addressed to its
agents into runs, so a workflow whose ``send_message`` step has ``await: agent_run`` completes
with only the bundled commands running (real subprocesses), and ``--no-accept`` leaves them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.db import connection

from buzz_delivery import services as core
from buzz_delivery.agents.acceptance import (
    accept_claim,
    accept_round,
    communities_with_pending_deliveries,
    is_delivery_hint,
)
from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig
from buzz_delivery.models import WorkerRegistration, WorkflowAgentDelivery
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.services import cancel_run
from buzz_delivery.workflows.testing import run_until_idle, send_step
from project.database_url import database_url
from tests import agent_async_handlers as ah
from tests import agent_handlers as h
from tests.wf_support import start
from tests.worker_support import RUN_CLAIM_OPENING, wait_for_poll_since_listening

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_LEDGER", str(tmp_path / "ledger.txt"))
    monkeypatch.delenv("AGENT_KILL", raising=False)


def ask_then_count(agents: list[bytes]) -> dict:
    """A send_message step awaiting the agents' runs, then a function step over its output."""
    return {
        "steps": [
            send_step("ask", agents, content="summarise this", **{"await": "agent_run"}),
            {
                "key": "count",
                "kind": "function",
                "function": "wf_app.count",
                "input": {"items": {"$ref": ["steps", "ask", "output"]}},
                "depends_on": ["ask"],
            },
        ]
    }


def spawn(*args: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": "tests.settings_wf_app",
    }
    return subprocess.Popen(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def until(predicate, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> tuple[int, dict, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    lines = out.strip().splitlines()
    return proc.returncode, (json.loads(lines[-1]) if lines else {}), err


def test_a_workflow_awaiting_agent_runs_completes_with_only_the_bundled_commands_running(community):
    a, b = random32(), random32()
    workflow = WorkflowFactory(community=community)
    # The agent worker polls rarely (600 s) and is idle before the run starts: the deliveries the
    # orchestrator sends are found through the core's NOTIFY hints, or not within the deadline.
    agents = spawn(
        "run_agent_worker", "--handler", "tests.agent_handlers:noop_three", "--agent", a.hex(), "--agent", b.hex(),
        "--community", str(community.id), "--poll-seconds", "600", "--shutdown-grace", "5",
    )  # fmt: skip
    until(lambda: WorkerRegistration.objects.filter(kind="agent", pid=agents.pid).exists() or agents.poll() is not None)
    assert agents.poll() is None, agents.communicate()
    wait_for_poll_since_listening(RUN_CLAIM_OPENING)  # its (empty) pass after its LISTEN
    run = start(workflow, ask_then_count([a, b]))
    engine = spawn("run_workflow_worker", "--community", str(community.id), "--poll-interval", "0.2")
    try:
        until(lambda: Run.objects.get(pk=run.pk).state in ("succeeded", "failed"), timeout=120)
    finally:
        agent_code, agent_summary, agent_err = stop(agents)
        engine_code, _, engine_err = stop(engine)
    assert Run.objects.get(pk=run.pk).state == "succeeded", (agent_err[-3000:], engine_err[-3000:])
    assert (agent_code, engine_code) == (0, 0), (agent_err[-3000:], engine_err[-3000:])
    assert (agent_summary["accepted"], agent_summary["completed"], agent_summary["accept_errors"]) == (2, 2, 0)
    outputs = dict(Step.objects.filter(run_id=run.pk).values_list("key", "output"))
    assert outputs["ask"] == {a.hex(): {"ok": True}, b.hex(): {"ok": True}}
    assert outputs["count"] == {"n": 2}
    deliveries = WorkflowAgentDelivery.objects.filter(run_id=run.pk)
    assert sorted(deliveries.values_list("status", flat=True)) == ["finished", "finished"]
    (holder,) = set(deliveries.values_list("claimed_by", flat=True))  # the agent worker's id (host:pid)
    assert holder.endswith(f":{agents.pid}")


def sent(community, agents: list[bytes]) -> Run:
    """A workflow run whose send_message step (await: agent_run) has sent its deliveries."""
    run = start(WorkflowFactory(community=community), {"steps": [send_step("ask", agents, **{"await": "agent_run"})]})
    run_until_idle(community.id)
    assert WorkflowAgentDelivery.objects.filter(run_id=run.pk, status="pending").count() == len(agents)
    return run


def idle_worker(agents: list[bytes], **options) -> dict:
    return AgentWorker(
        WorkerConfig(handler=h.noop_three, agents=agents, exit_when_idle=True, worker_id="w", **options)
    ).run()


def test_the_worker_discovers_and_accepts_deliveries_to_its_agents_only(community):
    mine, other = random32(), random32()
    run = sent(community, [mine, other])
    assert community.id in communities_with_pending_deliveries([mine])

    counts = idle_worker([mine])

    assert (counts["accepted"], counts["completed"]) == (1, 1)
    statuses = dict(WorkflowAgentDelivery.objects.filter(run_id=run.pk).values_list("target_pubkey", "status"))
    assert {bytes(k): v for k, v in statuses.items()} == {mine: "finished", other: "pending"}
    assert AgentRun.objects.get(source_run_id=run.pk).state == "completed"


def test_the_async_worker_accepts_deliveries_into_runs_and_runs_them_within_its_connections(community):
    mine, other = random32(), random32()
    runs = [sent(community, [mine, other]) for _ in range(3)]

    worker = AsyncAgentWorker(
        AsyncWorkerConfig(
            handler=ah.three_calls, agents=[mine], exit_when_idle=True, worker_id="aio", connections=2, poll_seconds=0.1
        )
    )
    counts = worker.run()

    assert (counts["accepted"], counts["completed"], counts["accept_errors"]) == (3, 3, 0), counts
    assert json.loads(worker.summary_line())["accepted"] == 3
    for run in runs:
        statuses = dict(WorkflowAgentDelivery.objects.filter(run_id=run.pk).values_list("target_pubkey", "status"))
        assert {bytes(k): v for k, v in statuses.items()} == {mine: "finished", other: "pending"}
        assert AgentRun.objects.get(source_run_id=run.pk).state == "completed"


def test_the_async_worker_with_accept_off_leaves_the_deliveries(community):
    agent = random32()
    run = sent(community, [agent])

    counts = AsyncAgentWorker(
        AsyncWorkerConfig(
            handler=ah.three_calls, agents=[agent], communities=[community.id], exit_when_idle=True, accept=False
        )
    ).run()

    assert counts.get("accepted", 0) == 0 and counts.get("claimed", 0) == 0
    assert WorkflowAgentDelivery.objects.get(run_id=run.pk).status == "pending"


def test_no_accept_leaves_the_deliveries_to_an_inbox_of_your_own(community):
    agent = random32()
    run = sent(community, [agent])

    counts = idle_worker([agent], communities=[community.id], accept=False)

    assert counts.get("accepted", 0) == 0 and counts["claimed"] == 0
    assert WorkflowAgentDelivery.objects.get(run_id=run.pk).status == "pending"
    assert not AgentRun.objects.filter(community_id=community.id).exists()


def test_a_delivery_whose_workflow_run_was_cancelled_while_held_is_refused_and_the_round_goes_on(community):
    agent = random32()
    doomed, live = sent(community, [agent]), sent(community, [agent])
    delivery = WorkflowAgentDelivery.objects.get(run_id=doomed.pk)
    held = core.claim_delivery(community.id, agent, delivery_id=delivery.id, lease_seconds=30)
    cancel_run(community.id, doomed.pk)

    assert accept_claim(held) == "run_ended"
    done = accept_round([community.id], [agent], holder="t", batch=10)

    assert (done.claimed, done.accepted) == (1, 1)
    doomed_delivery = WorkflowAgentDelivery.objects.get(run_id=doomed.pk)
    assert (doomed_delivery.status, doomed_delivery.failure_code) == ("failed", "run_canceled")
    assert AgentRun.objects.filter(source_run_id=live.pk).count() == 1
    assert not AgentRun.objects.filter(source_run_id=doomed.pk).exists()


@pytest.mark.parametrize(
    "payload",
    ["", "null", "[]", '{"target": 1}', '{"community": "x", "target": "00"}', "{" * 10_000, '"' + "x" * 100],
)
def test_a_hint_that_does_not_name_a_served_agent_wakes_nothing_and_raises_nothing(payload):
    assert is_delivery_hint(payload, {"ab" * 32}, set()) is False


def test_a_hint_naming_a_served_agent_in_a_served_community_wakes():
    hint = json.dumps({"community": "c1", "delivery": "d", "target": "ab" * 32})
    assert is_delivery_hint(hint, {"ab" * 32}, set()) is True
    assert is_delivery_hint(hint, {"ab" * 32}, {"c1"}) is True
    assert is_delivery_hint(hint, {"ab" * 32}, {"c2"}) is False
