"""The steps of many runs of one community, of mixed kinds, in one request (issue 29): a worker's
runs drift to different steps, so ``POST .../runs/steps`` takes results, calls and completions
together, in ONE transaction with the request's event id, each item checked and answered as its
kind's batch route checks and answers it."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.db import connection

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.gateway.client import GatewayClient, RemoteRunLease
from buzz_delivery.gateway.remote_runs import RunBatcher
from buzz_delivery.testing import CommunityFactory
from project.database_url import database_url
from tests.agents_support import counts, new_run
from tests.gateway.support import enroll, new_agent
from tests.gateway.test_batch_one_transaction import a_completion_waits_for_a_row_lock, post, seen, signed_post
from tests.gateway.test_runs import run_state

pytestmark = pytest.mark.django_db(transaction=True)


def _ref(lease: RemoteRunLease) -> dict:
    return {"run_id": lease.run_id, "lease_generation": lease.lease_generation}


def _entry(lease: RemoteRunLease, seq: int) -> JournalEntry | None:
    return JournalEntry.objects.filter(community_id=lease.community_id, run_id=lease.run_id, seq=seq).first()


def _state(lease: RemoteRunLease) -> str:
    return AgentRun.objects.get(community_id=lease.community_id, id=lease.run_id).state


def _five_runs(agent: GatewayClient, community) -> list[RemoteRunLease]:
    for _ in range(5):
        new_run(community.id, agent.pubkey)
    return [c.lease for c in agent.claim_runs(5, worker_id="remote-1", lease_seconds=30)]


def test_a_steps_request_records_journals_and_completes_in_one_transaction_answering_as_each_kind_route(
    gateway_server,
):
    community = CommunityFactory()
    agent, bob = new_agent(gateway_server), new_agent(gateway_server)
    enroll(agent, community)
    enroll(bob, community)
    recorded, journaled, completed, stale, again = _five_runs(agent, community)
    pending = agent.journal_call(recorded, "search", {"q": 1})
    assert pending.outcome == "journaled"
    new_run(community.id, bob.pubkey)
    (bobs,) = bob.claim_runs(1, worker_id="remote-1", lease_seconds=30)
    body = {
        "results": [{**_ref(recorded), "seq": pending.data["seq"], "ok": True, "output": {"hits": 3}}],
        "calls": [{**_ref(journaled), "tool_name": "fetch", "args": {"u": "x"}}, {**_ref(bobs.lease), "tool_name": "t",
                                                                                  "args": {}}],
        "complete": [{**_ref(completed), "output": {"a": 1}}, {**_ref(stale), "lease_generation": 99, "output": 1}],
        "worker_id": "remote-1",
    }  # fmt: skip
    path = f"/communities/{community.id}/runs/steps"
    before = seen(agent)
    answers: list = []
    # Another transaction holds the completed run's row: the request waits there, after it
    # recorded the result and journaled the call, and none of that is visible before it commits.
    with psycopg.connect(database_url(connection.settings_dict)) as holder:
        holder.execute(
            "SELECT id FROM buzz_agents_run WHERE community_id = %s AND id = %s FOR UPDATE",
            [community.id, completed.run_id],
        )
        header, raw = signed_post(agent, path, body)
        sender = threading.Thread(target=lambda: answers.append(post(agent, path, header, raw)), daemon=True)
        sender.start()
        deadline = time.monotonic() + 10
        while not a_completion_waits_for_a_row_lock():
            assert time.monotonic() < deadline, "the request never waited for the row"
            time.sleep(0.001)
        assert seen(agent) == before
        assert _entry(recorded, pending.data["seq"]).status == "pending"
        assert _entry(journaled, 1) is None
        holder.rollback()
    sender.join(10)
    (response,) = answers
    assert response.status_code == 200, response.text
    out = response.json()
    assert seen(agent) == before + 1
    assert out["results"] == [{"run_id": recorded.run_id, "outcome": "recorded", "status": "succeeded"}]
    assert out["calls"] == [
        {"run_id": journaled.run_id, "outcome": "journaled", "seq": 1, "idempotency_key": f"{journaled.run_id}:1"},
        {"run_id": bobs.lease.run_id, "outcome": "not_found"},
    ]
    assert out["complete"] == [
        {"run_id": completed.run_id, "outcome": "finished", "state": "completed"},
        {"run_id": stale.run_id, "outcome": "lease_lost", "reason": "lease is not current"},
    ]
    assert _entry(recorded, pending.data["seq"]).output == {"hits": 3}
    assert _entry(journaled, 1).tool_name == "fetch"
    assert _entry(bobs.lease, 1) is None
    assert (_state(completed), _state(stale)) == ("completed", "running")
    # The per-kind routes answer the same retries the same way.
    result_retry = {"seq": pending.data["seq"], "ok": True, "output": {"hits": 3}}
    (one,) = agent.run_batch("results", [(recorded, result_retry)])
    (two,) = agent.run_batch("complete", [(completed, {"output": {"a": 1}})])
    mixed = agent.run_steps({"results": [(recorded, result_retry)], "complete": [(completed, {"output": {"a": 1}})]})
    assert [one.data, two.data] == [mixed["results"][0].data, mixed["complete"][0].data]
    assert (one.outcome, two.outcome) == ("already_recorded", "already_terminal")
    assert _state(again) == "running"


def test_a_bad_item_in_any_list_is_a_400_naming_it_nothing_written_and_the_event_id_spent(gateway_server):
    community, elsewhere = CommunityFactory(), CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    a, b, c, *_ = _five_runs(agent, community)
    pending = agent.journal_call(a, "search", {"q": 1})
    result = {**_ref(a), "seq": pending.data["seq"], "ok": True, "output": {"n": 1}}
    call = {**_ref(b), "tool_name": "fetch", "args": {}}
    done = {**_ref(c), "output": {"n": 1}}
    good = {"results": [result], "calls": [call], "complete": [done]}
    rows, state = counts(), run_state()
    path = f"/communities/{community.id}/runs/steps"
    for payload, field, status in (
        ({**good, "results": [{**result, "seq": 0}]}, "results[0].seq", 400),
        ({**good, "results": [{**result, "uncertain": True}]}, "results[0].uncertain", 400),
        ({**good, "calls": [{**call, "tool_name": ""}]}, "calls[0].tool_name", 400),
        ({**good, "calls": [{**call, "cost": -1}]}, "calls[0].cost", 400),
        ({**good, "complete": [{**done, "output": {"s": "a\x00b"}}]}, "complete[0].output", 400),
        ({**good, "complete": [done, {**done, "run_id": "x"}]}, "complete[1].run_id", 400),
        ({**good, "calls": [{**call, **_ref(a)}]}, "calls[0].run_id", 400),  # a run twice in the request
        ({**good, "complete": [{**done, "extra": 1}]}, "complete[0].extra", 400),
        ({**good, "runs": []}, "runs", 400),
        ({"results": [], "calls": [], "complete": []}, "body", 400),
        ({"calls": [call] * 60, "complete": [done] * 41}, "body", 400),
        ({**good, "worker_id": " "}, "worker_id", 400),
    ):
        header, raw = signed_post(agent, path, {**payload, "worker_id": payload.get("worker_id", "remote-1")})
        before = seen(agent)
        response = post(agent, path, header, raw)
        assert (response.status_code, response.json().get("field")) == (status, field), (field, response.text)
        assert seen(agent) == before + 1, field  # the refusal commits its event id, nothing else
        replayed = post(agent, path, header, raw)
        assert (replayed.status_code, replayed.json()["code"]) == (401, "auth_replayed"), field
        assert counts() == rows and run_state() == state, field
    response = agent.request("POST", f"/communities/{elsewhere.id}/runs/steps", {**good, "worker_id": "remote-1"})
    assert response.status_code == 403
    assert counts() == rows and run_state() == state
    # The same request, corrected, goes through.
    response = agent.request("POST", path, {**good, "worker_id": "remote-1"})
    assert [response.json()[k][0]["outcome"] for k in ("results", "calls", "complete")] == [
        "recorded",
        "journaled",
        "finished",
    ]


class Gated:
    """The real client, recording each batch request's route; its first request waits for
    ``gate``, so the steps queued meanwhile are flushed together."""

    def __init__(self, client: GatewayClient) -> None:
        self.client, self.gate, self.routes = client, threading.Event(), []

    def run_batch(self, action, items):
        self.routes.append(action)
        if len(self.routes) == 1:
            assert self.gate.wait(10)
        return self.client.run_batch(action, items)

    def run_steps(self, items):
        self.routes.append("steps:" + ",".join(sorted(items)))
        return self.client.run_steps(items)


def _sending(batcher: RunBatcher, action: str, lease: RemoteRunLease, body: dict) -> list:
    box: list = []
    threading.Thread(target=lambda: box.append(batcher.send(action, lease, body)), daemon=True).start()
    return box


def test_the_batcher_sends_the_mixed_steps_of_a_community_in_one_request(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    first, recorded, journaled, completed, _ = _five_runs(agent, community)
    pending = agent.journal_call(recorded, "search", {"q": 1})
    client = Gated(agent)
    batcher = RunBatcher(client)
    try:
        boxes = [_sending(batcher, "complete", first, {"output": 0})]
        deadline = time.monotonic() + 10
        while not client.routes:  # the first request is in flight, held at the gate
            assert time.monotonic() < deadline
            time.sleep(0.001)
        boxes += [
            _sending(batcher, "results", recorded, {"seq": pending.data["seq"], "ok": True, "output": 1}),
            _sending(batcher, "calls", journaled, {"tool_name": "fetch", "args": {}}),
            _sending(batcher, "complete", completed, {"output": 2}),
        ]
        while batcher._queue.qsize() < 3:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        client.gate.set()
        while not all(boxes):
            assert time.monotonic() < deadline
            time.sleep(0.001)
    finally:
        batcher.close()
    assert [box[0].outcome for box in boxes] == ["finished", "recorded", "journaled", "finished"]
    assert client.routes == ["complete", "steps:calls,complete,results"]
    assert (_state(first), _state(completed), _entry(journaled, 1).tool_name) == ("completed", "completed", "fetch")
