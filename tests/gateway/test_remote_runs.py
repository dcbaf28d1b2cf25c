"""The remote agent-run worker over HTTP (``work-runs``, remote_runs) behaves like
``run_agent_worker``: journal before each call, replay on resume, compensate in reverse order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import Created, intake_event, reap_agent_runs
from buzz_delivery.gateway.remote_runs import RemoteRunContext, run_remote_claim
from buzz_delivery.testing import CommunityFactory
from tests.agents_support import backdate_run_lease, make_claimable
from tests.gateway import handlers
from tests.gateway.support import ROOT, enroll, new_agent

pytestmark = pytest.mark.django_db(transaction=True)


def intake(community, agent, payload) -> uuid.UUID:
    outcome = intake_event(community.id, "test", uuid.uuid4().hex, payload, agent.pubkey)
    assert isinstance(outcome, Created)
    return outcome.run_id


def lines(ledger, verb: str, run_id) -> list[int]:
    prefix = f"{verb} {run_id}:"
    text = ledger.read_text().splitlines() if ledger.exists() else []
    return [int(x[len(prefix) :].split(":")[0]) for x in text if x.startswith(prefix)]


def test_work_runs_completes_one_run_and_compensates_a_failing_one_in_reverse_order(gateway_server, tmp_path):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    good, bad = intake(community, agent, {"fail": False}), intake(community, agent, {"fail": True})
    key_file, ledger = tmp_path / "agent.key", tmp_path / "ledger.txt"
    key_file.write_text(agent._key.hex() + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GATEWAY_RUN_LEDGER": str(ledger)}
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the remote worker needs no Django
    proc = subprocess.run(
        [sys.executable, "-m", "buzz_delivery.gateway.client", "work-runs", "--url", gateway_server.base,
         "--key-file", str(key_file), "--handler", "tests.gateway.handlers:three_calls", "--wait-seconds", "0.5",
         "--idle-exit", "1.5", "--worker-id", "remote-w"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert (summary["claimed"], summary["completed"], summary["compensated"]) == (2, 1, 1), summary
    assert summary["reason"] == "idle"
    done, failed = AgentRun.objects.get(id=good), AgentRun.objects.get(id=bad)
    assert (done.state, done.output, done.worker_id) == ("completed", {"sum": 6}, "remote-w")
    assert (failed.state, failed.failure_code) == ("failed", "handler_error")
    assert lines(ledger, "call", good) == [1, 2, 3] and lines(ledger, "undo", good) == []
    assert lines(ledger, "call", bad) == [1, 2, 3] and lines(ledger, "undo", bad) == [3, 2, 1]
    statuses = JournalEntry.objects.filter(run_id=bad).order_by("seq").values_list("compensation_status", flat=True)
    assert list(statuses) == ["compensated"] * 3


def test_a_resumed_remote_run_replays_succeeded_calls_and_reconciles_the_pending_one(
    gateway_server, tmp_path, monkeypatch
):
    ledger = tmp_path / "ledger.txt"
    monkeypatch.setenv("GATEWAY_RUN_LEDGER", str(ledger))
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    run_id = intake(community, agent, {"fail": False})
    (first,) = agent.claim_runs(worker_id="dies")
    # The first holder made call 1 and recorded it, made call 2 and died before recording it.
    seq1 = agent.journal_call(first.lease, "effect", {"n": 1}, compensation={"function": "x:undo"}).data
    handlers.effect({"n": 1}, seq1["idempotency_key"])
    agent.record_result(first.lease, 1, ok=True, output={"n": 1})
    seq2 = agent.journal_call(first.lease, "effect", {"n": 2}, compensation={"function": "x:undo"}).data
    handlers.effect({"n": 2}, seq2["idempotency_key"])
    backdate_run_lease(run_id)
    assert reap_agent_runs().reclaimed == 1
    make_claimable(run_id)
    (second,) = agent.claim_runs(worker_id="resumes")
    ctx = RemoteRunContext(agent, second)
    assert run_remote_claim(agent, second, handlers.three_calls, ctx) == "completed"
    assert ctx.replayed == 1  # call 1 from the journal; call 2 reconciled; call 3 made
    assert lines(ledger, "call", run_id) == [1, 2, 3]  # no call made twice
    assert AgentRun.objects.get(id=run_id).output == {"sum": 6}
    entries = JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    assert [(e.status, e.result_generation) for e in entries] == [
        ("succeeded", 1),
        ("succeeded", 3),
        ("succeeded", 3),
    ]  # reap +1, claim +1


def test_a_replay_that_asks_for_another_call_fails_the_run_as_replay_mismatch(gateway_server, tmp_path, monkeypatch):
    monkeypatch.setenv("GATEWAY_RUN_LEDGER", str(tmp_path / "ledger.txt"))
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    run_id = intake(community, agent, {"fail": False})
    (first,) = agent.claim_runs()
    agent.journal_call(first.lease, "effect", {"n": 99})
    agent.record_result(first.lease, 1, ok=True, output={"n": 99})
    backdate_run_lease(run_id)
    reap_agent_runs()
    make_claimable(run_id)
    (second,) = agent.claim_runs()
    assert run_remote_claim(agent, second, handlers.three_calls) == "failed"
    assert AgentRun.objects.get(id=run_id).failure_code == "replay_mismatch"


def test_sigterm_drains_a_remote_run_worker(gateway_server, tmp_path):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    key_file = tmp_path / "agent.key"
    key_file.write_text(agent._key.hex() + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GATEWAY_RUN_LEDGER": str(tmp_path / "ledger.txt")}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "buzz_delivery.gateway.client", "work-runs", "--url", gateway_server.base,
         "--key-file", str(key_file), "--handler", "tests.gateway.handlers:three_calls", "--wait-seconds", "1"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    run_id = intake(community, agent, {"fail": False})
    deadline = time.monotonic() + 30
    while AgentRun.objects.get(id=run_id).state != "completed":
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    summary = json.loads(out.splitlines()[-1])
    assert (summary["completed"], summary["reason"]) == (1, "SIGTERM")


def test_the_remote_run_worker_poison_matrix_each_run_fails_alone_and_the_worker_exits_0(gateway_server, tmp_path):
    """Issue 28: on main a SystemExit killed the run thread (the worker then exited 0 with its
    run claimed), a failure code of 100 characters or output that is not JSON left the run
    held until its lease lapsed, counted as errors."""
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    kinds = ["exit", "unprintable", "long_code", "not_json", "nul_output"]
    runs = {kind: intake(community, agent, {"kind": kind}) for kind in kinds}
    fine = [intake(community, agent, {"kind": f"ok{i}"}) for i in range(3)]
    key_file = tmp_path / "agent.key"
    key_file.write_text(agent._key.hex() + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "buzz_delivery.gateway.client", "work-runs", "--url", gateway_server.base,
         "--key-file", str(key_file), "--handler", "tests.gateway.handlers:poison_run", "--wait-seconds", "0.5",
         "--idle-exit", "1.5", "--concurrency", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    expected = {
        "exit": "handler_aborted",
        "unprintable": "handler_error",
        "long_code": "c" * 64,
        "not_json": "output_not_json",
        "nul_output": "output_not_json",
    }
    for kind, code in expected.items():
        row = AgentRun.objects.get(id=runs[kind])
        assert (row.state, row.failure_code) == ("failed", code), (kind, row.failure_message)
    assert AgentRun.objects.get(id=runs["exit"]).failure_message == "SystemExit: 6"
    assert AgentRun.objects.get(id=runs["unprintable"]).failure_message == "Unprintable: <unprintable Unprintable>"
    assert {AgentRun.objects.get(id=r).state for r in fine} == {"completed"}
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert (summary["completed"], summary["failed"], summary["errors"]) == (3, 5, 0), summary
    assert (summary["reason"], summary["exit_code"]) == ("idle", 0)


def test_a_stored_compensation_name_is_looked_up_never_imported(gateway_server, tmp_path):
    """Issue 27: a journal entry's compensation descriptor is data anyone holding the key can
    write; the remote worker used to import and call whatever ``module:callable`` it named."""
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    run_id = intake(community, agent, {})
    (claim,) = agent.claim_runs(worker_id="hostile")
    lease = claim.lease
    for n, function in ((1, "tests.gateway.handlers:forbidden"), (2, "tests.gateway.handlers:undo")):
        journaled = agent.journal_call(lease, "effect", {"n": n}, compensation={"function": function})
        assert agent.record_result(lease, journaled.data["seq"], ok=True, output={"n": n}).outcome == "recorded"
    assert agent.fail_run(lease, "give_up").outcome == "unwinding"  # ... and walk away from it
    backdate_run_lease(run_id)
    reap_agent_runs()
    make_claimable(run_id)
    key_file, ledger = tmp_path / "agent.key", tmp_path / "ledger.txt"
    key_file.write_text(agent._key.hex() + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GATEWAY_RUN_LEDGER": str(ledger)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "buzz_delivery.gateway.client", "work-runs", "--url", gateway_server.base,
         "--key-file", str(key_file), "--handler", "tests.gateway.handlers:three_calls", "--wait-seconds", "0.5",
         "--idle-exit", "1.5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert lines(ledger, "forbidden", run_id) == []  # never imported, never called
    assert lines(ledger, "undo", run_id) == [2]  # the registered one ran
    entries = JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    assert [(e.seq, e.compensation_status) for e in entries] == [(1, "compensation_failed"), (2, "compensated")]
    assert "unregistered_compensation" in entries[0].compensation_error
    assert AgentRun.objects.get(id=run_id).state == "failed"


def test_a_remote_handler_may_only_name_a_registered_compensation(gateway_server):
    from buzz_delivery.gateway.remote_runs import compensation, compensation_name

    with pytest.raises(ValueError, match="not a registered compensation"):
        compensation_name(handlers.forbidden)
    assert compensation_name(handlers.undo) == "tests.gateway.handlers:undo"
    with pytest.raises(ValueError, match="another function"):
        compensation(name="tests.gateway.handlers:undo")(handlers.forbidden)


def work_runs(gateway_server, agent, tmp_path, *options: str) -> dict:
    key_file = tmp_path / "agent.key"
    key_file.write_text(agent._key.hex() + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GATEWAY_RUN_LEDGER": str(tmp_path / "ledger.txt")}
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the remote worker needs no Django
    proc = subprocess.run(
        [sys.executable, "-m", "buzz_delivery.gateway.client", "work-runs", "--url", gateway_server.base,
         "--key-file", str(key_file), "--handler", "tests.gateway.handlers:three_calls", "--wait-seconds", "0.5",
         "--idle-exit", "2", *options],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_work_runs_accepts_the_keys_deliveries_so_a_step_awaiting_agent_runs_ends(gateway_server, tmp_path):
    from buzz_delivery.models import WorkflowAgentDelivery
    from buzz_delivery.testing import WorkflowFactory
    from buzz_delivery.workflows.models import Step
    from buzz_delivery.workflows.testing import run_until_idle, send_step
    from tests.wf_support import start

    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    run = start(
        WorkflowFactory(community=community), {"steps": [send_step("ask", [agent.pubkey], **{"await": "agent_run"})]}
    )
    run_until_idle(community.id)

    summary = work_runs(gateway_server, agent, tmp_path)

    assert (summary["accepted"], summary["claimed"], summary["completed"], summary["accept_errors"]) == (1, 1, 1, 0)
    assert WorkflowAgentDelivery.objects.get(run_id=run.pk).status == "finished"
    step = Step.objects.get(run_id=run.pk, key="ask")
    assert (step.state, step.output) == ("succeeded", {agent.pubkey.hex(): {"sum": 6}})


def test_work_runs_no_accept_leaves_the_keys_deliveries_pending(gateway_server, tmp_path):
    from tests.gateway.support import deliver

    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    (delivery,) = deliver(community, agent.pubkey)

    summary = work_runs(gateway_server, agent, tmp_path, "--no-accept")

    assert (summary["accepted"], summary["claimed"]) == (0, 0)
    delivery.refresh_from_db()
    assert delivery.status == "pending" and not AgentRun.objects.filter(community_id=community.id).exists()
