"""Agent runs and batch finish through a real gunicorn and a real HTTP client (SPEC 12, 14)."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from buzz_delivery.agents import services as agents
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.gateway import nip98
from buzz_delivery.gateway.client import RemoteLease, RemoteRunLease
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory
from buzz_delivery.workflows.services import decide_approval
from tests.agents_support import counts, new_run
from tests.conftest import backdate_lease
from tests.gateway.support import deliver, enroll, new_agent

pytestmark = pytest.mark.django_db(transaction=True)


def run_state() -> list[tuple]:
    """Every run's and journal entry's mutable state, to compare before and after a refusal."""
    runs = AgentRun.objects.order_by("id").values_list(
        "id", "state", "lease_generation", "lease_until", "heartbeat_at", "tool_calls_used", "unwinding", "output"
    )
    entries = JournalEntry.objects.order_by("id").values_list("id", "status", "compensation_status", "output")
    return [*runs, *entries]


def accepted_run(agent, community, **options):
    """A delivery to ``agent`` claimed and accepted through the API; returns the run's claim."""
    deliver(community, agent.pubkey)
    (claim,) = agent.claim()
    accepted = agent.accept(claim.lease, **options)
    assert accepted.outcome == "accepted", accepted
    (run_claim,) = agent.claim_runs(worker_id="remote-1", lease_seconds=30)
    assert run_claim.run["id"] == accepted.data["run_id"]
    return run_claim


def test_the_whole_agent_run_path_accept_claim_heartbeat_call_result_complete(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    (delivery,) = deliver(community, agent.pubkey)
    (claim,) = agent.claim()
    accepted = agent.accept(claim.lease, input={"priority": "high"}, max_tool_calls=5)
    assert accepted.outcome == "accepted"
    assert WorkflowAgentDelivery.objects.get(id=delivery.id).status == "finished"
    # The accept's retry by the same holder: the delivery was settled, no second run.
    assert agent.accept(claim.lease).outcome == "already_terminal"
    assert AgentRun.objects.filter(delivery_id=delivery.id).count() == 1

    (run_claim,) = agent.claim_runs(worker_id="remote-1", lease_seconds=30)
    run, lease = run_claim.run, run_claim.lease
    assert (run["id"], run["state"], run["agent_pubkey"]) == (accepted.data["run_id"], "running", agent.pubkey.hex())
    assert run["input"]["priority"] == "high" and run["max_tool_calls"] == 5
    assert (lease.worker_id, lease.lease_generation) == ("remote-1", 1)

    beat = agent.heartbeat(lease, 60)
    assert beat.outcome == "renewed" and beat.lease.lease_until > lease.lease_until
    journaled = agent.journal_call(lease, "search", {"q": "buzz"}, cost=3)
    assert journaled.outcome == "journaled" and journaled.data["seq"] == 1
    assert journaled.data["idempotency_key"] == f"{run['id']}:1"
    recorded = agent.record_result(lease, 1, ok=True, output={"hits": 3}, latency_ms=7)
    assert (recorded.outcome, recorded.data["status"]) == ("recorded", "succeeded")
    again = agent.record_result(lease, 1, ok=False, error="late")
    assert (again.outcome, again.data["status"]) == ("already_recorded", "succeeded")

    read = agent.read_run(str(community.id), run["id"])
    assert [(e["seq"], e["status"], e["output"]) for e in read["journal"]] == [(1, "succeeded", {"hits": 3})]
    assert read["run"]["cost_used"] == 3

    done = agent.complete_run(lease, {"answer": 42})
    assert (done.outcome, done.data["state"]) == ("finished", "completed")
    assert agent.complete_run(lease, {"answer": 42}).data == {"outcome": "already_terminal", "state": "completed"}
    row = AgentRun.objects.get(id=run["id"])
    assert (row.state, row.output) == ("completed", {"answer": 42})
    assert agent.claim_runs() == []


def test_a_failing_run_unwinds_through_the_compensation_endpoints_in_reverse_order(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    lease = accepted_run(agent, community).lease
    for n in (1, 2):
        assert agent.journal_call(lease, f"t{n}", {"n": n}, compensation={"function": "m:undo"}).data["seq"] == n
        assert agent.record_result(lease, n, ok=True, output={"n": n}).outcome == "recorded"
    failing = agent.fail_run(lease, "tool_error", "t3 is down")
    assert failing.data == {"outcome": "unwinding", "seqs": [2, 1]}
    assert agent.begin_compensation(lease, 1).outcome == "not_next"  # reverse order, in the statement
    began = agent.begin_compensation(lease, 2)
    assert began.outcome == "begun" and began.data["key"].endswith(":2:compensate")
    assert began.data["args"] == {"n": 2} and began.data["output"] == {"n": 2}
    assert agent.finish_compensation(lease, 2, ok=True).data["status"] == "compensated"
    assert agent.begin_compensation(lease, 1).outcome == "begun"
    assert agent.finish_compensation(lease, 1, ok=True).data["status"] == "compensated"
    assert agent.complete_run(lease, {}).outcome == "lease_lost"  # an unwinding run cannot complete
    assert agent.fail_run(lease, "tool_error").data == {"outcome": "finished", "state": "failed"}
    statuses = JournalEntry.objects.filter(run_id=lease.run_id).order_by("seq")
    assert [e.compensation_status for e in statuses] == ["compensated", "compensated"]


def test_an_approval_parks_the_run_and_its_decision_is_in_the_journal_when_reclaimed(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    lease = accepted_run(agent, community).lease
    parked = agent.request_approval(lease, "refund?", 3600)
    assert parked.outcome == "approval_requested" and parked.data["seq"] == 1
    assert AgentRun.objects.get(id=lease.run_id).state == "waiting_approval"
    assert agent.heartbeat(lease).outcome == "lease_lost"  # parked: the lease was released
    assert agent.claim_runs() == []
    decide_approval(community.id, parked.data["approval_id"], "approved", "ops")
    (again,) = agent.claim_runs(worker_id="remote-2")
    assert again.lease.lease_generation == lease.lease_generation + 1
    entry = agent.read_run(str(community.id), lease.run_id)["journal"][0]
    assert (entry["kind"], entry["status"], entry["output"]["decision"]) == ("approval", "succeeded", "approved")
    assert agent.complete_run(again.lease, {"ok": True}).data["state"] == "completed"


def test_budget_exceeded_is_an_outcome_and_journals_nothing(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    lease = accepted_run(agent, community, max_tool_calls=1).lease
    assert agent.journal_call(lease, "t", {}).outcome == "journaled"
    agent.record_result(lease, 1, ok=True, output=None)
    refused = agent.journal_call(lease, "t", {})
    assert refused.data == {"outcome": "budget_exceeded", "budget": "tool_calls", "used": 1, "cap": 1}
    assert JournalEntry.objects.filter(run_id=lease.run_id).count() == 1


def test_a_cancelled_or_reclaimed_holder_gets_409_and_writes_nothing(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    lease = accepted_run(agent, community).lease
    assert isinstance(agents.cancel_agent_run(community.id, lease.run_id, reason="ops"), agents.Cancelled)
    before = run_state()
    beat = agent.heartbeat(lease)
    assert beat.outcome == "lease_lost" and beat.data["reason"] == "cancelled"
    for outcome in (
        agent.journal_call(lease, "t", {}),
        agent.record_result(lease, 1, ok=True),
        agent.complete_run(lease, {}),
        agent.fail_run(lease, "x"),
        agent.request_approval(lease),
    ):
        assert outcome.outcome == "lease_lost" and outcome.data["code"] == "lease_lost"
    # Another holder name (a forged worker_id) is no holder either.
    forged = RemoteRunLease(lease.community_id, lease.run_id, lease.lease_generation + 1, "", "someone-else")
    assert agent.heartbeat(forged).outcome == "lease_lost"
    assert run_state() == before


def test_runs_of_another_agent_or_community_are_404_or_403_and_never_claimed(gateway_server):
    a, b = CommunityFactory(), CommunityFactory()
    alice, bob, carol = (new_agent(gateway_server) for _ in range(3))
    enroll(alice, a)
    enroll(bob, a)
    enroll(carol, b)
    bobs = accepted_run(bob, a).lease
    carols = accepted_run(carol, b).lease
    new_run(a.id, bob.pubkey)  # a pending run of bob's: alice's claim must not take it
    before, rows = run_state(), counts()
    assert alice.claim_runs(limit=10) == []
    for lease, status in ((bobs, 404), (carols, 403)):
        stolen = RemoteRunLease(lease.community_id, lease.run_id, lease.lease_generation, "", lease.worker_id)
        base = f"/communities/{lease.community_id}/runs/{lease.run_id}"
        assert alice.request("GET", base).status_code == status
        for action, body in (
            ("heartbeat", {}),
            ("calls", {"tool_name": "t", "args": {}}),
            ("results", {"seq": 1, "ok": True}),
            ("approval", {}),
            ("complete", {"output": 1}),
            ("fail", {"failure_code": "x"}),
            ("compensations/begin", {"seq": 1}),
            ("compensations/finish", {"seq": 1, "ok": True}),
        ):
            response = alice.request(
                "POST",
                f"{base}/{action}",
                {"lease_generation": stolen.lease_generation, "worker_id": "remote-1", **body},
            )
            assert response.status_code == status, (action, response.text)
            assert response.json()["code"] == ("not_found" if status == 404 else "not_enrolled")
    missing = f"/communities/{a.id}/runs/{uuid.uuid4()}"
    assert alice.request("GET", missing).json()["code"] == "not_found"
    assert run_state() == before and counts() == rows


def test_accept_by_another_key_is_404_and_a_lost_lease_409_and_creates_no_run(gateway_server):
    community = CommunityFactory()
    alice, bob = new_agent(gateway_server), new_agent(gateway_server)
    enroll(alice, community)
    enroll(bob, community)
    (delivery,) = deliver(community, bob.pubkey)
    (claim,) = bob.claim()
    stolen = alice.request(
        "POST", f"/communities/{community.id}/deliveries/{delivery.id}/accept", {"lease_generation": 1}
    )
    assert (stolen.status_code, stolen.json()["code"]) == (404, "not_found")
    backdate_lease(delivery.id)
    assert bob.accept(claim.lease).outcome == "lease_lost"
    assert not AgentRun.objects.filter(delivery_id=delivery.id).exists()
    assert WorkflowAgentDelivery.objects.get(id=delivery.id).status == "claimed"


RUN_CASES = [
    ("heartbeat", {}, "lease_generation"),
    ("heartbeat", {"lease_generation": 1, "worker_id": 5}, "worker_id"),
    ("heartbeat", {"lease_generation": 1, "worker_id": "w" * 201}, "worker_id"),
    ("heartbeat", {"lease_generation": 1, "worker_id": "   "}, "worker_id"),
    ("heartbeat", {"lease_generation": 1, "lease_seconds": 0.1}, "lease_seconds"),
    ("calls", {"lease_generation": 1, "args": {}}, "tool_name"),
    ("calls", {"lease_generation": 1, "tool_name": "t"}, "args"),
    ("calls", {"lease_generation": 1, "tool_name": "", "args": {}}, "tool_name"),
    ("calls", {"lease_generation": 1, "tool_name": "t", "args": {}, "cost": -1}, "cost"),
    ("calls", {"lease_generation": 1, "tool_name": "t", "args": {}, "destructive": 1}, "destructive"),
    ("calls", {"lease_generation": 1, "tool_name": "t", "args": {}, "compensation": [1]}, "compensation"),
    ("calls", {"lease_generation": 1, "tool_name": "t", "args": "\u0000"}, "args"),
    ("results", {"lease_generation": 1, "ok": True}, "seq"),
    ("results", {"lease_generation": 1, "seq": 1}, "ok"),
    ("results", {"lease_generation": 1, "seq": 0, "ok": True}, "seq"),
    ("results", {"lease_generation": 1, "seq": 1, "ok": "yes"}, "ok"),
    ("results", {"lease_generation": 1, "seq": 1, "ok": True, "uncertain": True}, "uncertain"),
    ("results", {"lease_generation": 1, "seq": 1, "ok": True, "latency_ms": -1}, "latency_ms"),
    ("approval", {"lease_generation": 1, "deadline_seconds": 0}, "deadline_seconds"),
    ("approval", {"lease_generation": 1, "prompt": 3}, "prompt"),
    ("complete", {"lease_generation": 1}, "output"),
    ("fail", {"lease_generation": 1}, "failure_code"),
    ("fail", {"lease_generation": 1, "failure_code": ""}, "failure_code"),
    ("fail", {"lease_generation": 1, "failure_code": "x" * 65}, "failure_code"),
    ("compensations/begin", {"lease_generation": 1}, "seq"),
    ("compensations/finish", {"lease_generation": 1, "seq": 1}, "ok"),
    ("complete", {"lease_generation": 1, "output": 1, "state": "completed"}, "state"),
]


def send(agent, method: str, path: str, body) -> httpx.Response:
    raw = body if isinstance(body, bytes) else (b"" if body is None else json.dumps(body).encode())
    url = agent.base_url + path
    header = nip98.encode_header(nip98.sign_event(agent._key, url, method, raw))
    return httpx.request(method, url, content=raw, headers={"Authorization": header}, timeout=10)


def test_the_bad_input_matrix_of_the_run_endpoints_is_400_naming_the_field_and_writes_nothing(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    lease = accepted_run(agent, community).lease
    base = f"/communities/{community.id}/runs/{lease.run_id}"
    before, rows = run_state(), counts()
    for action, body, field in RUN_CASES:
        response = send(agent, "POST", f"{base}/{action}", body)
        assert response.status_code == 400, (action, body, response.text)
        assert response.json()["field"] == field, (action, body, response.json())
    for path, method, body, field in (
        ("/runs/claim", "POST", {"limit": 0}, "limit"),
        ("/runs/claim", "POST", {"agent_pubkeys": ["00" * 32]}, "agent_pubkeys"),
        ("/runs/claim", "POST", b"{", "body"),
        (f"/communities/{community.id}/runs/nope", "GET", None, "run_id"),
        (f"/communities/{community.id}/runs/{lease.run_id}", "GET", b"{}", "body"),
        (f"/communities/x/runs/{lease.run_id}/heartbeat", "POST", {"lease_generation": 1}, "community_id"),
        (f"/communities/{community.id}/deliveries/{uuid.uuid4()}/accept", "POST", {}, "lease_generation"),
        (
            f"/communities/{community.id}/deliveries/{uuid.uuid4()}/accept",
            "POST",
            {"lease_generation": 1, "input": [1]},
            "input",
        ),
        (
            f"/communities/{community.id}/deliveries/{uuid.uuid4()}/accept",
            "POST",
            {"lease_generation": 1, "max_attempts": 0},
            "max_attempts",
        ),
    ):
        response = send(agent, method, path, body)
        assert response.status_code == 400, (path, body, response.text)
        assert response.json()["field"] == field, (path, body, response.json())
    huge = send(agent, "POST", f"{base}/calls", b"{" + b" " * 70_000 + b"}")
    assert huge.status_code == 413
    assert run_state() == before and counts() == rows


def test_batch_finish_settles_many_and_answers_each_lease_like_the_one_by_one_finish(gateway_server):
    community, other = CommunityFactory(), CommunityFactory()
    agent, bob = new_agent(gateway_server), new_agent(gateway_server)
    enroll(agent, community)
    enroll(bob, community)
    deliver(community, agent.pubkey, 4)
    claims = agent.claim(limit=4)
    (bobs,) = deliver(community, bob.pubkey)
    bob.claim()
    leases = [c.lease for c in claims]
    backdate_lease(uuid.UUID(leases[3].delivery_id))
    bobs_lease = RemoteLease(str(community.id), str(bobs.id), 1, "")
    assert agent.finish(leases[2], "finished").outcome == "settled"
    results = agent.finish_many([*leases, bobs_lease], "failed", failure_code="bulk")
    assert [(r.outcome, r.status) for r in results] == [
        ("settled", "failed"),
        ("settled", "failed"),
        ("already_terminal", "finished"),
        ("lease_lost", None),
        ("not_found", None),
    ]
    status = dict(WorkflowAgentDelivery.objects.values_list("id", "status"))
    assert [status[uuid.UUID(x.delivery_id)] for x in leases] == ["failed", "failed", "finished", "claimed"]
    assert status[bobs.id] == "claimed"
    # Refusals name the field; nothing is settled.
    path = f"/communities/{community.id}/deliveries/finish"
    dup = {"delivery_id": leases[3].delivery_id, "lease_generation": 1}
    for body, field in (
        ({"deliveries": [], "outcome": "finished"}, "deliveries"),
        ({"deliveries": [dup, dup], "outcome": "failed"}, "deliveries[1].delivery_id"),
        (
            {"deliveries": [{"delivery_id": "x", "lease_generation": 1}], "outcome": "failed"},
            "deliveries[0].delivery_id",
        ),
        (
            {"deliveries": [{"delivery_id": leases[3].delivery_id}], "outcome": "failed"},
            "deliveries[0].lease_generation",
        ),
        ({"deliveries": [{**dup, "status": "x"}], "outcome": "failed"}, "deliveries[0].status"),
        ({"deliveries": [1], "outcome": "failed"}, "deliveries[0]"),
        ({"deliveries": [dup], "outcome": "later"}, "outcome"),
        ({"deliveries": [dup], "outcome": "finished", "failure_code": "x"}, "failure_code"),
    ):
        response = agent.request("POST", path, body)
        assert (response.status_code, response.json()["field"]) == (400, field), response.text
    not_enrolled = agent.request(
        "POST", f"/communities/{other.id}/deliveries/finish", {"deliveries": [dup], "outcome": "failed"}
    )
    assert not_enrolled.status_code == 403
    assert dict(WorkflowAgentDelivery.objects.values_list("id", "status")) == status


def test_a_cancelled_run_is_compensated_by_a_remote_agent_and_ends_cancelled(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    lease = accepted_run(agent, community).lease
    for n in (1, 2):
        agent.journal_call(lease, f"t{n}", {"n": n}, compensation={"function": "m:undo"})
        agent.record_result(lease, n, ok=True, output={"n": n})
    assert isinstance(agents.cancel_agent_run(community.id, lease.run_id), agents.Cancelled)
    assert agent.heartbeat(lease).data["reason"] == "cancelled"
    (again,) = agent.claim_runs(worker_id="remote-2")
    assert (again.run["unwinding"], again.run["failure_code"]) == (True, "cancelled")
    assert agent.fail_run(again.lease, "cancelled").data == {"outcome": "unwinding", "seqs": [2, 1]}
    for seq in (2, 1):
        assert agent.begin_compensation(again.lease, seq).outcome == "begun"
        assert agent.finish_compensation(again.lease, seq, ok=True).data["status"] == "compensated"
    assert agent.fail_run(again.lease, "cancelled").data == {"outcome": "finished", "state": "cancelled"}
    assert AgentRun.objects.get(id=lease.run_id).state == "cancelled"


def test_a_long_poll_run_claim_is_woken_by_the_notify_of_a_new_run_for_its_community(tmp_path):
    import threading
    import time

    from tests.gateway.support import (
        LONG_WAIT,
        RUN_CLAIM_OPENING,
        WAKE_TEST_ENV,
        WOKEN_WITHIN,
        start_server,
        stop_server,
        wait_for_long_polls,
    )

    # A server of its own that polls only every 600 s: only a hint can wake it within 60 s.
    server = start_server(tmp_path / "gunicorn.log", WAKE_TEST_ENV)
    try:
        community, elsewhere = CommunityFactory(), CommunityFactory()
        agent = new_agent(server)
        enroll(agent, community)
        got: list = []
        waiter = threading.Thread(target=lambda: got.extend(agent.claim_runs(wait_seconds=LONG_WAIT)))
        waiter.start()
        wait_for_long_polls(server, 1, RUN_CLAIM_OPENING)
        assert got == [] and waiter.is_alive()
        new_run(elsewhere.id, agent.pubkey)  # a hint for a community it is not enrolled in
        time.sleep(0.5)
        assert got == [] and waiter.is_alive()
        run_id = new_run(community.id, agent.pubkey)
        waiter.join(WOKEN_WITHIN)
        assert not waiter.is_alive(), f"the run claim was not woken by the hint within {WOKEN_WITHIN} s"
        assert [c.lease.run_id for c in got] == [str(run_id)]
        started = time.monotonic()
        assert agent.claim_runs(wait_seconds=1.2) == []
        assert 1.1 <= time.monotonic() - started < 60  # not before its wait ends (the bound: a loaded CI)
    finally:
        stop_server(server)


RUN_ACTIONS = ("heartbeat", "calls", "results", "approval", "complete", "fail", "compensations/begin",
               "compensations/finish")  # fmt: skip


def test_every_run_endpoint_refuses_bad_json_extra_fields_huge_bodies_and_wrong_methods(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    lease = accepted_run(agent, community).lease
    (delivery,) = deliver(community, agent.pubkey)
    base = f"/communities/{community.id}/runs/{lease.run_id}"
    posts = [f"{base}/{a}" for a in RUN_ACTIONS] + [
        "/runs/claim",
        f"/communities/{community.id}/deliveries/{delivery.id}/accept",
        f"/communities/{community.id}/deliveries/finish",
        f"/communities/{community.id}/deliveries/renew",
        *(f"/communities/{community.id}/runs/{a}" for a in ("complete", "calls", "results", "heartbeat", "fail")),
    ]
    before, rows = run_state(), counts()
    for path in posts:
        for body, field in ((b"{", "body"), (b"[]", "body"), (b"\xff", "body"), ({"x": 1}, "x")):  # extra: named first
            response = send(agent, "POST", path, body)
            assert (response.status_code, response.json()["field"]) == (400, field), (path, body, response.text)
        assert send(agent, "POST", path, b"{" + b" " * 70_000 + b"}").status_code == 413, path
        wrong = send(agent, "GET", path, None)
        assert (wrong.status_code, wrong.headers["Allow"]) == (405, "POST"), path
    assert send(agent, "POST", base, None).status_code == 405
    assert run_state() == before and counts() == rows


def test_complete_with_a_call_of_the_holder_in_flight_is_calls_in_flight_single_and_batch(gateway_server):
    """A raw client completing a run whose call 1 is still pending (call 2 recorded: the run
    'running' again) got ``finished`` and the run ended with call 1 pending for ever. Now the
    gateway answers ``calls_in_flight`` (as the approval route does), nothing written; in a
    batch for that run only. Failed before the fix (``finished``)."""
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    for _ in range(2):
        new_run(community.id, agent.pubkey)
    busy, idle = (c.lease for c in agent.claim_runs(2, worker_id="remote-1", lease_seconds=30))
    for n in (1, 2):
        assert agent.journal_call(busy, "search", {"n": n}).outcome == "journaled"
    assert agent.record_result(busy, 2, ok=True, output={}).outcome == "recorded"
    before = run_state()

    single = agent.complete_run(busy, {"answer": 42})
    assert single.data == {"outcome": "calls_in_flight", "seqs": [1]}
    assert run_state() == before
    results = agent.complete_runs([(busy, {"n": 0}), (idle, {"n": 1})])
    assert [(r.outcome, r.data.get("seqs"), r.data.get("state")) for r in results] == [
        ("calls_in_flight", [1], None),
        ("finished", None, "completed"),
    ]
    assert AgentRun.objects.get(id=busy.run_id).state == "running"
    assert JournalEntry.objects.get(run_id=busy.run_id, seq=1).status == "pending"

    assert agent.record_result(busy, 1, ok=True, output={}).outcome == "recorded"
    assert agent.complete_run(busy, {"answer": 42}).data == {"outcome": "finished", "state": "completed"}
