"""The remote worker over HTTP behaves like run_delivery_worker (SPEC sections 7 and 14)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory, DeliveryFactory, EventFactory, WorkflowRunFactory, backdate
from tests.gateway.support import ROOT, enroll, new_agent

pytestmark = pytest.mark.django_db(transaction=True)


def start(tmp_path, server, agent, *options, sleep: float = 0, gate=None):
    """``gate``: a path; every handler waits until that file exists (see tests.gateway.handlers)."""
    key_file = tmp_path / "agent.key"
    key_file.write_text(agent._key.hex() + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GATEWAY_HANDLER_SLEEP": str(sleep),
           "GATEWAY_HANDLER_LOG": str(tmp_path / "handled.log")}  # fmt: skip
    if gate is not None:
        env["GATEWAY_HANDLER_GATE"] = str(gate)
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the remote worker needs no Django
    out, err = open(tmp_path / "worker.out", "w"), open(tmp_path / "worker.err", "w")  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "buzz_delivery.gateway.client", "work", "--url", server.base,
         "--key-file", str(key_file), "--handler", "tests.gateway.handlers:scripted", *options],
        cwd=ROOT, env=env, stdout=out, stderr=err,
    )  # fmt: skip


def summary(tmp_path) -> dict:
    lines = (tmp_path / "worker.out").read_text().splitlines()
    assert len(lines) == 1, lines
    return json.loads(lines[0])


def deliveries(community, target, *step_ids):
    run, event = WorkflowRunFactory(community=community), EventFactory(community=community)
    return [
        DeliveryFactory(
            binding__run=run, binding__message_event=event, binding__target_pubkey=target, binding__step_id=s
        )
        for s in step_ids
    ]


def test_the_remote_worker_settles_by_the_handler_result(tmp_path, gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    ok, perm, retry = deliveries(community, agent.pubkey, "ok_1", "perm_1", "retry_1")
    proc = start(tmp_path, gateway_server, agent, "--concurrency", "2", "--max-deliveries", "3", "--wait-seconds", "1")
    assert proc.wait(timeout=30) == 0, (tmp_path / "worker.err").read_text()
    assert summary(tmp_path) | {"reason": "max_deliveries"} == {
        "claimed": 3, "finished": 1, "failed": 1, "retried": 1, "lease_lost": 0, "renewed": 0,
        "settle_errors": 0, "errors": 0, "abandoned": 0, "reason": "max_deliveries", "exit_code": 0,
    }  # fmt: skip
    rows = {d.id: d for d in WorkflowAgentDelivery.objects.all()}
    assert rows[ok.id].status == "finished"
    assert (rows[perm.id].status, rows[perm.id].failure_code) == ("failed", "BadPayload")
    assert rows[retry.id].status == "pending" and rows[retry.id].next_attempt_at is not None


@pytest.mark.parametrize(("verbosity", "logged"), [(None, False), ("2", True)])
def test_http_requests_are_logged_only_from_verbosity_2(tmp_path, gateway_server, verbosity, logged):
    """httpx logs every request at INFO: at the default verbosity the worker's log held one line
    per long poll. Its requests show from ``-v 2`` on."""
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    deliveries(community, agent.pubkey, "ok_1")
    options = ["--max-deliveries", "1", "--wait-seconds", "1"] + (["-v", verbosity] if verbosity else [])
    proc = start(tmp_path, gateway_server, agent, *options)
    assert proc.wait(timeout=30) == 0, (tmp_path / "worker.err").read_text()
    log = (tmp_path / "worker.err").read_text()
    assert ("HTTP Request: POST" in log) is logged, log


def test_sigterm_drains_in_flight_work_which_renewals_keep_alive(tmp_path, gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    (slow,) = deliveries(community, agent.pubkey, "ok_slow")
    proc = start(
        tmp_path, gateway_server, agent, "--lease-seconds", "2", "--renew-every", "0.5", "--wait-seconds", "1", sleep=4
    )
    log = tmp_path / "handled.log"
    deadline = time.monotonic() + 60  # the process's start, its claim and the handler's start
    while not (log.exists() and log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert log.read_text().strip() == str(slow.id)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, (tmp_path / "worker.err").read_text()
    result = summary(tmp_path)
    assert result["reason"] == "SIGTERM" and result["finished"] == 1 and result["abandoned"] == 0
    assert result["renewed"] >= 3, "a 4 s handler on a 2 s lease must have been renewed"
    row = WorkflowAgentDelivery.objects.get(id=slow.id)
    assert row.status == "finished" and row.lease_generation == 1


LONG = "ThisExceptionClassHasANameMuchLongerThanSixtyFourCharactersWhichNoFailureCodeColumnCanHold"


def test_the_remote_worker_poison_matrix_each_delivery_fails_alone_and_the_worker_exits_0(tmp_path, gateway_server):
    """Issue 28: on main a BaseException left its delivery unsettled (claimed until its lease
    lapsed), uncounted, and an exception whose str() raised did the same."""
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    kinds = ["exit_1", "kbd_1", "base_1", "unprintable_1", "longcode_1", "nul_1"]
    poison = dict(zip(kinds, deliveries(community, agent.pubkey, *kinds), strict=True))
    fine = deliveries(community, agent.pubkey, "ok_1", "ok_2", "ok_3")
    proc = start(tmp_path, gateway_server, agent, "--concurrency", "1", "--wait-seconds", "0.5", "--idle-exit", "2")

    assert proc.wait(timeout=60) == 0, (tmp_path / "worker.err").read_text()
    rows = {d.id: d for d in WorkflowAgentDelivery.objects.all()}
    expected = {
        "exit_1": ("failed", "SystemExit"),
        "kbd_1": ("failed", "KeyboardInterrupt"),
        "base_1": ("failed", "Stop"),
        "unprintable_1": ("pending", None),  # an ordinary exception: retried
        "longcode_1": ("failed", LONG[:64]),
        "nul_1": ("failed", "BadPayload"),
    }
    for kind, (status, code) in expected.items():
        row = rows[poison[kind].id]
        assert (row.status, row.failure_code) == (status, code), (kind, row.failure_message)
    assert rows[poison["exit_1"].id].failure_message == "5"
    assert rows[poison["nul_1"].id].failure_message == "a NUL \\x00 and a lone surrogate \\ud800 in the message"
    assert {rows[d.id].status for d in fine} == {"finished"}
    result = summary(tmp_path)
    assert (result["finished"], result["failed"]) == (3, 5)
    assert result["retried"] >= 1  # the unprintable one (again, when its backoff ends before the idle exit)
    assert (result["settle_errors"], result["errors"], result["exit_code"]) == (0, 0, 0)


def test_a_retry_through_the_gateway_honours_retry_after_and_a_bad_one_is_refused_by_name(gateway_server):
    """Issue 29: ``finish`` takes ``retry_after`` (a provider's Retry-After) with ``retry``."""
    from django.db import connection

    from buzz_delivery.gateway.client import GatewayHTTPError
    from tests.gateway.support import deliver

    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    deliver(community, agent.pubkey, 2)
    first, second = agent.claim(2)
    before = WorkflowAgentDelivery.objects.values().get(id=second.lease.delivery_id)
    with pytest.raises(GatewayHTTPError) as refused:
        agent.finish(second.lease, "retry", retry_after=-1)
    assert (refused.value.status, refused.value.field) == (400, "retry_after")
    assert WorkflowAgentDelivery.objects.values().get(id=second.lease.delivery_id) == before

    assert agent.finish(first.lease, "retry", retry_after=600).status == "pending"
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT extract(epoch FROM next_attempt_at - now()) FROM buzz_delivery_delivery WHERE id = %s",
            [first.lease.delivery_id],
        )
        (wait,) = cursor.fetchone()
    assert 590 <= wait <= 600


def test_finished_results_settle_in_batches_one_request_per_community_and_batch(tmp_path, gateway_server):
    """Issue 29: the remote worker used to send one signed request per settle."""
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    made = deliveries(community, agent.pubkey, *[f"ok_{i}" for i in range(24)])
    proc = start(tmp_path, gateway_server, agent, "--concurrency", "8", "--max-deliveries", "24", "--wait-seconds", "1",
                 "-v", "2")  # fmt: skip
    assert proc.wait(timeout=60) == 0, (tmp_path / "worker.err").read_text()
    assert summary(tmp_path)["finished"] == 24
    assert set(WorkflowAgentDelivery.objects.filter(id__in=[d.id for d in made]).values_list("status", flat=True)) == {
        "finished"
    }
    requests = [line for line in (tmp_path / "worker.err").read_text().splitlines() if "HTTP Request: POST" in line]
    batch = [line for line in requests if f"/communities/{community.id}/deliveries/finish " in line]
    single = [line for line in requests if line.split(" HTTP/")[0].endswith("/finish") and line not in batch]
    assert single == [], single[:3]
    assert 1 <= len(batch) < 24, len(batch)


def wait_handled(tmp_path, n: int) -> list[str]:
    """The ids of the deliveries whose handler started, once there are ``n`` (60 s at most: the
    worker process's start is in it, seconds on a loaded machine)."""
    log = tmp_path / "handled.log"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lines = log.read_text().split() if log.exists() else []
        if len(lines) >= n:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"{n} handlers did not start: {log.read_text() if log.exists() else ''}")


def posts(tmp_path) -> list[str]:
    """The POST request lines of the worker's log (``-v 2``), as ``METHOD URL``."""
    lines = (tmp_path / "worker.err").read_text().splitlines()
    return [line.split("HTTP Request: ", 1)[1].split(' "HTTP/')[0] for line in lines if "HTTP Request: POST" in line]


def test_a_stale_lease_in_a_settle_batch_is_refused_for_its_delivery_only(tmp_path, gateway_server):
    """Issue 29: the batch finish judges each lease by its own generation. One claim request
    serves every free handler thread; the settles of the 8 results go through the batch route
    only, and the lease the reaper took back (generation + 1) is refused alone."""

    from buzz_delivery import services

    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    made = deliveries(community, agent.pubkey, *[f"ok_{i}" for i in range(8)])
    gate = tmp_path / "gate"
    proc = start(tmp_path, gateway_server, agent, "--concurrency", "8", "--max-deliveries", "8", "--wait-seconds", "1",
                 "-v", "2", gate=gate)  # fmt: skip
    assert sorted(wait_handled(tmp_path, 8)) == sorted(str(d.id) for d in made)
    stale = made[3]
    backdate(stale.id, lease_until=1)  # its lease lapses while the handler runs...
    assert services.reap().reclaimed == 1  # ...and the reaper takes it back: generation 2
    gate.touch()
    assert proc.wait(timeout=60) == 0, (tmp_path / "worker.err").read_text()

    result = summary(tmp_path)
    assert (result["claimed"], result["finished"], result["lease_lost"], result["settle_errors"]) == (8, 7, 1, 0)
    rows = {d.id: d for d in WorkflowAgentDelivery.objects.filter(id__in=[d.id for d in made])}
    assert (rows[stale.id].status, rows[stale.id].lease_generation) == ("pending", 2)
    assert {rows[d.id].status for d in made if d.id != stale.id} == {"finished"}
    assert {rows[d.id].lease_generation for d in made if d.id != stale.id} == {1}
    sent = posts(tmp_path)
    assert [p for p in sent if p.endswith("/deliveries/claim")] == [f"POST {gateway_server.base}/deliveries/claim"]
    finishes = [p for p in sent if p.endswith("/finish")]
    assert finishes and set(finishes) == {f"POST {gateway_server.base}/communities/{community.id}/deliveries/finish"}
    assert len(finishes) < 8, finishes


def test_sigterm_drains_every_claimed_delivery_those_claimed_ahead_too_settled_in_batches(tmp_path, gateway_server):
    """Once handlers have run (fast), one claim takes more than the free threads (claim-ahead):
    they wait, held, in a local queue. A stop works and settles every claimed one (none
    abandoned), through the batch route."""
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    made = deliveries(community, agent.pubkey, "quick_0", "quick_1", *[f"ok_{i}" for i in range(6)])
    gate = tmp_path / "gate"
    proc = start(tmp_path, gateway_server, agent, "--concurrency", "2", "--wait-seconds", "1", "-v", "2", gate=gate)
    wait_handled(tmp_path, 4)  # the quick ones, then two held in the handler threads
    ids = [d.id for d in made]
    deadline = time.monotonic() + 60
    while WorkflowAgentDelivery.objects.filter(id__in=ids, status="pending").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not WorkflowAgentDelivery.objects.filter(id__in=ids, status="pending").exists()
    assert len(wait_handled(tmp_path, 4)) == 4  # two threads: the other four claimed ones wait
    proc.send_signal(signal.SIGTERM)
    gate.touch()
    assert proc.wait(timeout=60) == 0, (tmp_path / "worker.err").read_text()
    result = summary(tmp_path)
    assert result["reason"] == "SIGTERM"
    assert (result["claimed"], result["finished"], result["abandoned"], result["settle_errors"]) == (8, 8, 0, 0)
    assert set(WorkflowAgentDelivery.objects.filter(id__in=ids).values_list("status", flat=True)) == {"finished"}
    finishes = [p for p in posts(tmp_path) if p.endswith("/finish")]
    assert set(finishes) == {f"POST {gateway_server.base}/communities/{community.id}/deliveries/finish"}


def test_a_settle_batch_refused_as_a_whole_is_sent_again_one_delivery_per_request():
    """A 400/413 on the batch (one bad item, or too large), a 400 from a gateway older than
    per-delivery outcomes (a mixed batch, or a single failed one) and a 404/405 from one without
    the route must not drop every lease in it: each is settled on its own request, with its own
    outcome and text, and gets its own answer."""
    from buzz_delivery.gateway.client import GatewayHTTPError, RemoteLease, RemoteOutcome, RemoteWorker, _Result

    for status, ids in ((413, "abc"), (400, "abc"), (400, "b"), (404, "abc"), (405, "abc")):

        class Refusing:
            def __init__(self):
                self.singles: list[tuple] = []
                self.batches: list[list[str]] = []

            def settle_many(self, settles, status=status):
                self.batches.append([x.lease.delivery_id for x in settles])
                raise GatewayHTTPError(status, "refused", "deliveries[1].outcome: is not a field of this request")

            def finish(self, lease, outcome, *, failure_code=None, failure_message=None, retry_after=None):
                self.singles.append((lease.delivery_id, outcome, failure_code, failure_message, retry_after))
                if lease.delivery_id == "b":
                    return RemoteOutcome("lease_lost")
                return RemoteOutcome("settled", status={"retry": "pending"}.get(outcome, outcome))

        def held(d: str) -> RemoteLease:
            return RemoteLease("community", d, 1, "2026-01-01T00:00:00+00:00")

        results = {
            "a": _Result(held("a"), "finished", None, None, None),
            "b": _Result(held("b"), "failed", "Poison", "bad", None),
            "c": _Result(held("c"), "retry", None, "later", 30.0),
        }
        client = Refusing()
        worker = RemoteWorker(client, lambda d: None)  # type: ignore[arg-type]
        for d in ids:
            worker._held[d] = held(d)
        worker._settle([results[d] for d in ids])
        assert client.batches == [list(ids)], status
        assert client.singles == [tuple(vars_of(results[d])) for d in ids], status
        counts = (worker._counts["finished"], worker._counts["retried"], worker._counts["lease_lost"])
        assert counts == ((1, 1, 1) if ids == "abc" else (0, 0, 1)), status
        assert worker._counts["settle_errors"] == 0 and worker._held == {}, status


def vars_of(result) -> tuple:
    return (result.lease.delivery_id, result.outcome, result.failure_code, result.failure_message, result.retry_after)
