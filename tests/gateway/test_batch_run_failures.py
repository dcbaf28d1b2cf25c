"""Batched failures of agent runs through the gateway (issue 29): many runs of one community
failed in one signed request and one fenced statement (``POST .../runs/fail``), each run judged by
its own lease and given what the one-run ``fail`` answers; ``work-runs`` sends its failures
through it (RunBatcher)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from buzz_delivery.agents import services as agents
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.gateway.client import RemoteRunLease
from buzz_delivery.testing import CommunityFactory
from tests.agents_support import backdate_run_lease, counts, make_claimable, new_run
from tests.gateway.support import ROOT, enroll, new_agent
from tests.gateway.test_remote_runs import intake, lines
from tests.gateway.test_runs import run_state

pytestmark = pytest.mark.django_db(transaction=True)

UNDO = {"function": "tests.gateway.handlers:undo"}


def test_a_batch_fails_each_run_under_its_own_lease_and_refuses_a_stale_holder_for_that_run_only(gateway_server):
    community = CommunityFactory()
    agent, bob = new_agent(gateway_server), new_agent(gateway_server)
    enroll(agent, community)
    enroll(bob, community)
    for _ in range(5):
        new_run(community.id, agent.pubkey)
    leases = [c.lease for c in agent.claim_runs(5, worker_id="remote-1", lease_seconds=30)]
    plain, undoable, stale, completed, cancelled = leases
    # One call to undo; its run unwinds instead of ending.
    assert agent.journal_call(undoable, "t", {"n": 1}, compensation=UNDO).outcome == "journaled"
    assert agent.record_result(undoable, 1, ok=True, output={"n": 1}).outcome == "recorded"
    # A stale holder: its lease lapsed and another holder claimed the run again.
    backdate_run_lease(stale.run_id)
    assert agents.reap_agent_runs().reclaimed == 1
    make_claimable(stale.run_id)
    (again,) = agent.claim_runs(1, worker_id="remote-1", lease_seconds=30)
    assert again.lease.run_id == stale.run_id and again.lease.lease_generation > stale.lease_generation
    assert agent.complete_run(completed, {"done": 1}).outcome == "finished"
    assert isinstance(agents.cancel_agent_run(community.id, cancelled.run_id, reason="ops"), agents.Cancelled)
    bobs_run = new_run(community.id, bob.pubkey)
    (bobs,) = bob.claim_runs(1, worker_id="remote-1", lease_seconds=30)
    stolen = RemoteRunLease(str(community.id), str(bobs_run), bobs.lease.lease_generation, "", "remote-1")

    results = agent.fail_runs([(lease, f"code_{i}", f"message {i}") for i, lease in enumerate([*leases, stolen])])

    assert [r.data for r in results] == [
        {"run_id": plain.run_id, "outcome": "finished", "state": "failed"},
        {"run_id": undoable.run_id, "outcome": "unwinding", "seqs": [1]},
        {"run_id": stale.run_id, "outcome": "lease_lost", "reason": "lease is not current"},
        {"run_id": completed.run_id, "outcome": "already_terminal", "state": "completed"},
        {"run_id": cancelled.run_id, "outcome": "lease_lost", "reason": "cancelled"},
        {"run_id": str(bobs_run), "outcome": "not_found"},
    ]
    runs = {str(r.id): r for r in AgentRun.objects.all()}
    assert (runs[plain.run_id].state, runs[plain.run_id].failure_code) == ("failed", "code_0")
    assert runs[plain.run_id].failure_message == "message 0"
    assert (runs[undoable.run_id].state, runs[undoable.run_id].unwinding) == ("running", True)
    assert runs[stale.run_id].state == "running" and runs[stale.run_id].failure_code is None  # the new holder's
    assert runs[completed.run_id].state == "completed" and runs[str(bobs_run)].state == "running"
    # The unwinding run: its compensation through the one-run endpoints, then the batch again ends it.
    assert agent.begin_compensation(undoable, 1).outcome == "begun"
    assert agent.finish_compensation(undoable, 1, ok=True).outcome == "recorded"
    assert [r.data for r in agent.fail_runs([(undoable, "compensated", None), (again.lease, "x", None)])] == [
        {"run_id": undoable.run_id, "outcome": "finished", "state": "failed"},
        {"run_id": stale.run_id, "outcome": "finished", "state": "failed"},
    ]
    ended = AgentRun.objects.get(id=undoable.run_id)
    assert (ended.failure_code, ended.failure_message) == ("code_1", "message 1")  # the first failure wins


def test_a_bad_item_is_a_400_naming_it_and_nothing_of_the_batch_is_written(gateway_server):
    community, other = CommunityFactory(), CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    for _ in range(2):
        new_run(community.id, agent.pubkey)
    a, b = (c.lease for c in agent.claim_runs(2, worker_id="remote-1", lease_seconds=30))
    good = [{"run_id": x.run_id, "lease_generation": x.lease_generation, "failure_code": "boom"} for x in (a, b)]
    path = f"/communities/{community.id}/runs/fail"
    before, rows = run_state(), counts()
    for body, field in (
        ({"runs": []}, "runs"),
        ({"runs": [good[0]] * 101}, "runs"),
        ({"runs": [good[0], good[0]]}, "runs[1].run_id"),
        ({"runs": [good[0], {**good[1], "run_id": "x"}]}, "runs[1].run_id"),
        ({"runs": [good[0], {**good[1], "failure_code": " "}]}, "runs[1].failure_code"),
        ({"runs": [good[0], {**good[1], "failure_code": "c" * 65}]}, "runs[1].failure_code"),
        ({"runs": [good[0], {k: v for k, v in good[1].items() if k != "failure_code"}]}, "runs[1].failure_code"),
        ({"runs": [good[0], {**good[1], "failure_message": "m" * 10_001}]}, "runs[1].failure_message"),
        ({"runs": [good[0], {**good[1], "failure_message": "a\x00b"}]}, "runs[1].failure_message"),
        ({"runs": [good[0], {**good[1], "lease_generation": 0}]}, "runs[1].lease_generation"),
        ({"runs": [good[0], {**good[1], "retry_after": 5}]}, "runs[1].retry_after"),
        ({"runs": good, "worker_id": " "}, "worker_id"),
        ({"runs": [1]}, "runs[0]"),
    ):
        response = agent.request("POST", path, body)
        assert (response.status_code, response.json().get("field")) == (400, field), (body.keys(), response.text)
    assert agent.request("POST", f"/communities/{other.id}/runs/fail", {"runs": good}).status_code == 403
    assert run_state() == before and counts() == rows
    # The same batch, corrected, fails both runs.
    assert [r.outcome for r in agent.fail_runs([(a, "boom", None), (b, "boom", None)])] == ["finished"] * 2


def test_work_runs_sends_its_failures_and_compensations_through_the_batch_routes(gateway_server, tmp_path):
    """Issue 29: ``work-runs`` failed each run in a request of its own (``.../runs/<id>/fail``),
    twice for a run with calls to undo (to start unwinding, then to end it), and began and
    finished each compensation in a request of its own."""
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    bad = [intake(community, agent, {"fail": True}) for _ in range(4)]
    good = intake(community, agent, {"fail": False})
    key_file, ledger = tmp_path / "agent.key", tmp_path / "ledger.txt"
    key_file.write_text(agent._key.hex() + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GATEWAY_RUN_LEDGER": str(ledger)}
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the remote worker needs no Django
    proc = subprocess.run(
        [sys.executable, "-m", "buzz_delivery.gateway.client", "work-runs", "--url", gateway_server.base,
         "--key-file", str(key_file), "--handler", "tests.gateway.handlers:three_calls", "--wait-seconds", "0.5",
         "--idle-exit", "1.5", "--worker-id", "remote-w", "--concurrency", "5", "--no-accept", "-v", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert (summary["claimed"], summary["completed"], summary["compensated"]) == (5, 1, 4), summary
    for run_id in bad:
        run = AgentRun.objects.get(id=run_id)
        assert (run.state, run.failure_code) == ("failed", "handler_error")
        assert lines(ledger, "call", run_id) == [1, 2, 3] and lines(ledger, "undo", run_id) == [3, 2, 1]
    assert AgentRun.objects.get(id=good).state == "completed"
    assert set(JournalEntry.objects.filter(run_id__in=bad).values_list("compensation_status", flat=True)) == {
        "compensated"
    }
    posts = [line.split("HTTP Request: POST ", 1)[1].split(' "HTTP/')[0] for line in proc.stderr.splitlines()
             if "HTTP Request: POST " in line]  # fmt: skip
    fails = [p for p in posts if p.endswith("/fail")]
    assert fails and set(fails) == {f"{gateway_server.base}/communities/{community.id}/runs/fail"}, fails
    assert len(fails) < 2 * len(bad), fails  # two failures a run (start unwinding, end), fewer requests
    # The compensations too: three begins and three finishes a run, in batches of the runs' turns.
    for step in ("begin", "finish"):
        sent = [p for p in posts if p.endswith(f"/compensations/{step}")]
        assert set(sent) == {f"{gateway_server.base}/communities/{community.id}/runs/compensations/{step}"}, sent
        assert len(sent) < 3 * len(bad), sent


def test_compensation_batches_answer_each_run_as_the_one_run_endpoints_and_refuse_bad_items(gateway_server):
    community = CommunityFactory()
    agent, bob = new_agent(gateway_server), new_agent(gateway_server)
    enroll(agent, community)
    enroll(bob, community)
    for _ in range(3):
        new_run(community.id, agent.pubkey)
    leases = [c.lease for c in agent.claim_runs(3, worker_id="remote-1", lease_seconds=30)]
    for lease in leases:
        for n in (1, 2):
            assert agent.journal_call(lease, "t", {"n": n}, compensation=UNDO).outcome == "journaled"
            assert agent.record_result(lease, n, ok=True, output={"n": n}).outcome == "recorded"
        assert agent.fail_run(lease, "boom").data == {"outcome": "unwinding", "seqs": [2, 1]}
    a, b, stale = leases
    backdate_run_lease(stale.run_id)  # its holder lapsed: the reaper takes the run back
    assert agents.reap_agent_runs().reclaimed == 1
    bobs_run = new_run(community.id, bob.pubkey)
    (bobs,) = bob.claim_runs(1, worker_id="remote-1", lease_seconds=30)
    stolen = RemoteRunLease(str(community.id), str(bobs_run), bobs.lease.lease_generation, "", "remote-1")
    path = f"/communities/{community.id}/runs/compensations"

    def send(step, runs):
        response = agent.request("POST", f"{path}/{step}", {"runs": runs, "worker_id": "remote-1"})
        assert response.status_code == 200, response.text
        return [{k: v for k, v in r.items() if k not in ("args", "output")} for r in response.json()["results"]]

    def item(lease, **body):
        return {"run_id": lease.run_id, "lease_generation": lease.lease_generation, **body}

    # Bad items first: a 400 naming the item, nothing written.
    before, rows = run_state(), counts()
    for step, runs, field in (
        ("begin", [item(a, seq=2), item(b, seq=0)], "runs[1].seq"),
        ("begin", [item(a, seq=2), item(a, seq=2)], "runs[1].run_id"),
        ("finish", [item(a, seq=2, ok=True), item(b, seq=2)], "runs[1].ok"),
        ("finish", [item(a, seq=2, ok=True), item(b, seq=2, ok="yes")], "runs[1].ok"),
        ("finish", [item(a, seq=2, ok=True), item(b, seq=2, ok=False, error="e" * 10_001)], "runs[1].error"),
    ):
        response = agent.request("POST", f"{path}/{step}", {"runs": runs, "worker_id": "remote-1"})
        assert (response.status_code, response.json().get("field")) == (400, field), response.text
    assert run_state() == before and counts() == rows

    begun = send("begin", [item(a, seq=2), item(b, seq=1), item(stale, seq=2), item(stolen, seq=1)])
    assert begun == [
        {"run_id": a.run_id, "outcome": "begun", "compensation": UNDO, "key": f"{a.run_id}:2:compensate"},
        {"run_id": b.run_id, "outcome": "not_next"},  # seq 2 comes first
        {"run_id": stale.run_id, "outcome": "lease_lost", "reason": "lease is not current"},
        {"run_id": str(bobs_run), "outcome": "not_found"},
    ]
    finished = send("finish", [item(a, seq=2, ok=True, error=None), item(b, seq=2, ok=True, error=None),
                               item(stale, seq=2, ok=True, error=None)])  # fmt: skip
    assert finished == [
        {"run_id": a.run_id, "outcome": "recorded", "status": "compensated"},
        {"run_id": b.run_id, "outcome": "already_recorded", "status": None},  # never begun: nothing recorded
        {"run_id": stale.run_id, "outcome": "lease_lost", "reason": "lease is not current"},
    ]
    # What the one-run endpoints answer for the same requests now.
    assert agent.begin_compensation(b, 1).outcome == "not_next"
    assert agent.finish_compensation(a, 2, ok=True).data == {"outcome": "already_recorded", "status": "compensated"}
    assert agent.finish_compensation(b, 2, ok=True).data == {"outcome": "already_recorded", "status": None}
    entries = JournalEntry.objects.filter(run_id__in=[a.run_id, b.run_id, stale.run_id])
    assert sorted((str(e.run_id), e.seq, e.compensation_status) for e in entries) == sorted(
        [(a.run_id, 1, None), (a.run_id, 2, "compensated"), (b.run_id, 1, None), (b.run_id, 2, None),
         (stale.run_id, 1, None), (stale.run_id, 2, None)]
    )  # fmt: skip
