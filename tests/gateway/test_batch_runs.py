"""Batched completion of agent runs through the gateway (issue 29): many runs of one community
completed in one signed request and one fenced statement, each run judged by its own lease."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from buzz_delivery.agents import services as agents
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.gateway.client import RemoteRunLease
from buzz_delivery.testing import CommunityFactory
from tests.agents_support import backdate_run_lease, counts, make_claimable, new_run
from tests.gateway.support import ROOT, enroll, new_agent
from tests.gateway.test_remote_runs import lines
from tests.gateway.test_runs import run_state

pytestmark = pytest.mark.django_db(transaction=True)


def states(run_ids) -> list[tuple]:
    by_id = {r.id: r for r in AgentRun.objects.filter(id__in=list(run_ids))}
    return [(by_id[uuid.UUID(str(x))].state, by_id[uuid.UUID(str(x))].output) for x in run_ids]


def test_a_batch_completes_each_run_under_its_own_lease_and_refuses_a_stale_holder_for_that_run_only(
    gateway_server,
):
    community = CommunityFactory()
    agent, bob = new_agent(gateway_server), new_agent(gateway_server)
    enroll(agent, community)
    enroll(bob, community)
    for _ in range(5):
        new_run(community.id, agent.pubkey)
    claims = agent.claim_runs(5, worker_id="remote-1", lease_seconds=30)
    leases = [c.lease for c in claims]
    assert len(leases) == 5
    # Run 2's holder went stale: its lease lapsed and another holder claimed the run again.
    backdate_run_lease(leases[2].run_id)
    assert agents.reap_agent_runs().reclaimed == 1
    make_claimable(leases[2].run_id)
    (again,) = agent.claim_runs(1, worker_id="remote-2", lease_seconds=30)
    assert again.lease.run_id == leases[2].run_id and again.lease.lease_generation > leases[2].lease_generation
    # Run 3 was completed one by one before; run 4 was cancelled (the holder is fenced off).
    assert agent.complete_run(leases[3], {"n": "single"}).outcome == "finished"
    assert isinstance(agents.cancel_agent_run(community.id, leases[4].run_id, reason="ops"), agents.Cancelled)
    # A run of another key looks like a missing one.
    bobs_run = new_run(community.id, bob.pubkey)
    (bobs,) = bob.claim_runs(1, worker_id="remote-1", lease_seconds=30)
    assert bobs.lease.run_id == str(bobs_run)
    stolen = RemoteRunLease(str(community.id), str(bobs_run), bobs.lease.lease_generation, "", "remote-1")

    # Heartbeats in a batch: the stale holder is refused for its run only; the others are renewed.
    beats = agent.heartbeat_runs(leases[:3], lease_seconds=60)
    assert [b.outcome for b in beats] == ["renewed", "renewed", "lease_lost"]
    assert [b.lease.lease_generation for b in beats[:2]] == [x.lease_generation for x in leases[:2]]
    assert AgentRun.objects.get(id=leases[2].run_id).worker_id == "remote-2"
    # Journal writes in batches: the stale holder is refused for its run only.
    call = {"tool_name": "search", "args": {"q": 1}}
    journaled = agent.run_batch("calls", [(lease, call) for lease in leases[:3]])
    assert [(r.outcome, r.data.get("seq")) for r in journaled] == [
        ("journaled", 1), ("journaled", 1), ("lease_lost", None),
    ]  # fmt: skip
    assert journaled[0].data["idempotency_key"] != journaled[1].data["idempotency_key"]
    answer = {"seq": 1, "ok": True, "output": {"hits": 3}}
    recorded = agent.run_batch("results", [(lease, answer) for lease in leases[:3]])
    assert [(r.outcome, r.data.get("status")) for r in recorded] == [
        ("recorded", "succeeded"), ("recorded", "succeeded"), ("lease_lost", None),
    ]  # fmt: skip
    assert list(JournalEntry.objects.filter(run_id__in=[x.run_id for x in leases]).values_list("run_id", "status")) in (
        [(uuid.UUID(leases[0].run_id), "succeeded"), (uuid.UUID(leases[1].run_id), "succeeded")],
        [(uuid.UUID(leases[1].run_id), "succeeded"), (uuid.UUID(leases[0].run_id), "succeeded")],
    )

    results = agent.complete_runs([(lease, {"n": i}) for i, lease in enumerate([*leases, stolen])])

    assert [(r.outcome, r.data.get("state"), r.data.get("reason")) for r in results] == [
        ("finished", "completed", None),
        ("finished", "completed", None),
        ("lease_lost", None, "lease is not current"),
        ("already_terminal", "completed", None),
        ("lease_lost", None, "cancelled"),
        ("not_found", None, None),
    ]
    assert [r.data["run_id"] for r in results] == [x.run_id for x in [*leases, stolen]]
    assert states([x.run_id for x in leases]) == [
        ("completed", {"n": 0}),
        ("completed", {"n": 1}),
        ("running", None),  # the stale holder wrote nothing; the new holder still holds it
        ("completed", {"n": "single"}),
        ("cancelled", None),
    ]
    assert states([bobs_run]) == [("running", None)]
    # The new holder completes it through a batch of its own.
    (current,) = agent.complete_runs([(again.lease, {"n": "second holder"})])
    assert current.outcome == "finished"
    assert states([leases[2].run_id]) == [("completed", {"n": "second holder"})]


def test_a_bad_item_is_a_400_naming_it_and_nothing_of_the_batch_is_written(gateway_server):
    community, other = CommunityFactory(), CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    for _ in range(3):
        new_run(community.id, agent.pubkey)
    leases = [c.lease for c in agent.claim_runs(3, worker_id="remote-1", lease_seconds=30)]
    path = f"/communities/{community.id}/runs/complete"

    def item(lease, output=None):
        return {"run_id": lease.run_id, "lease_generation": lease.lease_generation, "output": output or {"ok": 1}}

    good = [item(x) for x in leases]
    before, rows = run_state(), counts()
    for body, field in (
        ({"runs": []}, "runs"),
        ({"runs": [item(leases[0])] * 101}, "runs"),
        ({"runs": [good[0], good[0]]}, "runs[1].run_id"),
        ({"runs": [good[0], {**good[1], "run_id": "x"}]}, "runs[1].run_id"),
        ({"runs": [good[0], {"run_id": leases[1].run_id, "output": 1}]}, "runs[1].lease_generation"),
        ({"runs": [good[0], {"run_id": leases[1].run_id, "lease_generation": 1}]}, "runs[1].output"),
        ({"runs": [good[0], good[1], item(leases[2], {"s": "a\x00b"})]}, "runs[2].output"),
        ({"runs": [good[0], {**good[1], "extra": 1}]}, "runs[1].extra"),
        ({"runs": good, "worker_id": " "}, "worker_id"),
        ({"runs": good, "outcome": "finished"}, "outcome"),
        ({"runs": [1]}, "runs[0]"),
    ):
        response = agent.request("POST", path, body)
        assert (response.status_code, response.json().get("field")) == (400, field), (body.keys(), response.text)
    lease0 = {"run_id": leases[0].run_id, "lease_generation": leases[0].lease_generation}
    lease1 = {"run_id": leases[1].run_id, "lease_generation": leases[1].lease_generation}
    call = {"tool_name": "search", "args": {"q": 1}}
    for action, runs, field in (
        ("calls", [{**lease0, **call}, {**lease1, **call, "tool_name": ""}], "runs[1].tool_name"),
        ("calls", [{**lease0, **call}, {**lease1, **call, "cost": -1}], "runs[1].cost"),
        ("calls", [{**lease0, **call}, {**lease1, **call, "compensation": [1]}], "runs[1].compensation"),
        ("results", [{**lease0, "seq": 1, "ok": True}, {**lease1, "seq": 0, "ok": True}], "runs[1].seq"),
        ("results", [{**lease0, "seq": 1, "ok": True, "uncertain": True}], "runs[0].uncertain"),
    ):
        response = agent.request("POST", f"/communities/{community.id}/runs/{action}", {"runs": runs})
        assert (response.status_code, response.json().get("field")) == (400, field), (action, response.text)
    not_enrolled = agent.request("POST", f"/communities/{other.id}/runs/complete", {"runs": good})
    assert not_enrolled.status_code == 403
    assert run_state() == before and counts() == rows
    # The same batch, corrected, completes every run.
    assert [r.outcome for r in agent.complete_runs([(x, {"ok": 1}) for x in leases])] == ["finished"] * 3


def test_remote_worker_processes_complete_every_run_once_through_batched_completions(gateway_server, tmp_path):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    run_ids = [new_run(community.id, agent.pubkey) for _ in range(24)]
    key_file, ledger = tmp_path / "agent.key", tmp_path / "ledger.txt"
    key_file.write_text(agent._key.hex() + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GATEWAY_RUN_LEDGER": str(ledger), "GATEWAY_HANDLER_SLEEP": "1"}
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the remote worker needs no Django
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "buzz_delivery.gateway.client",
                "work-runs",
                "--url",
                gateway_server.base,
                "--key-file",
                str(key_file),
                "--handler",
                "tests.gateway.handlers:slow_three_calls",
                "--wait-seconds",
                "0.5",
                "--idle-exit",
                "2",
                "--concurrency",
                "6",
                "--renew-every",
                "0.2",
                "--no-accept",
                "--worker-id",
                f"remote-{i}",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    summaries, errs = [], []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        summaries.append(json.loads(out.splitlines()[-1]))
        errs.append(err)
    assert sum(s["completed"] for s in summaries) == 24, (summaries, errs)
    assert sum(s["lost"] for s in summaries) == 0, summaries
    assert sum(s["renewed"] for s in summaries) > 0, summaries  # the batched heartbeats renewed leases
    assert states(run_ids) == [("completed", {"sum": 6})] * 24
    for run_id in run_ids:
        assert lines(ledger, "call", run_id) == [1, 2, 3]  # each call made once
