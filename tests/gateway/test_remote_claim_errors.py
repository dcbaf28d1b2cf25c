"""The remote workers when no claim gets through (a key not enrolled, a gateway gone): a newcomer
ran ``work-runs --idle-exit 3`` with a key not yet enrolled and it never exited, warning twice a
second, and its summary counted every failed claim request as an ``accept_errors`` (a delivery
whose accept failed) while no delivery was ever claimed; ``work`` counted none of them at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.gateway.support import ROOT, new_agent

pytestmark = pytest.mark.django_db(transaction=True)

HANDLERS = {"work": "tests.gateway.handlers:scripted", "work-runs": "tests.gateway.handlers:three_calls"}


@pytest.mark.parametrize("command", ["work", "work-runs"])
def test_claims_refused_count_as_idle_and_as_errors_not_accept_errors(gateway_server, tmp_path, command):
    agent = new_agent(gateway_server)  # never enrolled: every claim is a 403 not_enrolled
    key_file = tmp_path / "agent.key"
    key_file.write_text(agent._key.hex() + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the remote workers need no Django
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "buzz_delivery.gateway.client", command, "--url", gateway_server.base,
             "--key-file", str(key_file), "--handler", HANDLERS[command], "--wait-seconds", "0.5",
             "--idle-exit", "1"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{command} --idle-exit 1 still running after 60 s: {exc.stderr!r}"[-2000:])
    assert proc.returncode == 0, proc.stderr
    assert "not_enrolled" in proc.stderr  # each refusal says why
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["reason"] in ("idle", "idle_exit") and summary["claimed"] == 0, summary
    assert summary["errors"] >= 1, summary
    assert summary.get("accept_errors", 0) == 0, summary


def test_work_runs_logs_how_each_run_ended_at_the_default_verbosity(gateway_server, tmp_path):
    """At -v 1 (the default: "the worker's own lines") work-runs printed nothing until its summary,
    where run_agent_worker logs ``completed run=...`` per run: a newcomer could not tell which runs
    it had worked."""
    import uuid

    from buzz_delivery.agents.services import intake_event
    from buzz_delivery.testing import CommunityFactory
    from tests.gateway.support import enroll

    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    run_id = intake_event(community.id, "test", uuid.uuid4().hex, {"fail": False}, agent.pubkey).run_id
    key_file = tmp_path / "agent.key"
    key_file.write_text(agent._key.hex() + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GATEWAY_RUN_LEDGER": str(tmp_path / "ledger.txt")}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "buzz_delivery.gateway.client", "work-runs", "--url", gateway_server.base,
         "--key-file", str(key_file), "--handler", HANDLERS["work-runs"], "--wait-seconds", "0.5",
         "--idle-exit", "1.5", "--no-accept"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["completed"] == 1
    assert f"completed run={run_id}" in proc.stderr, proc.stderr


def test_work_runs_names_the_failure_code_of_a_failed_run(gateway_server, tmp_path):
    """``failed run=...`` said that a run failed but not why: the line names the code it recorded."""
    import uuid

    from buzz_delivery.agents.models import AgentRun
    from buzz_delivery.agents.services import intake_event
    from buzz_delivery.testing import CommunityFactory
    from tests.gateway.support import enroll

    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    run_id = intake_event(community.id, "test", uuid.uuid4().hex, {}, agent.pubkey).run_id
    key_file = tmp_path / "agent.key"
    key_file.write_text(agent._key.hex() + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "buzz_delivery.gateway.client", "work-runs", "--url", gateway_server.base,
         "--key-file", str(key_file), "--handler", "tests.gateway.handlers:fails_with_code",
         "--wait-seconds", "0.5", "--idle-exit", "1.5", "--no-accept"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["failed"] == 1
    assert AgentRun.objects.get(id=run_id).failure_code == "quota_spent"
    assert f"failed run={run_id} code='quota_spent'" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("key_text", "handler", "named"),
    [
        ("nothex\n", "tests.gateway.handlers:three_calls", ["--key-file", "bad.key", "64 hex characters"]),
        ("ab" * 31 + "\n", "tests.gateway.handlers:three_calls", ["--key-file", "bad.key", "64 hex characters"]),
        ("ab" * 32 + "\n", "tests.gateway.no_such_module:handle", ["--handler", "tests.gateway.no_such_module"]),
    ],
)
def test_a_bad_key_file_or_handler_is_refused_naming_the_option(tmp_path, key_text, handler, named):
    """A key file that is not hex was refused with "non-hexadecimal number found in fromhex() arg
    at position 0": neither the option nor the file nor what it should hold."""
    key_file = tmp_path / "bad.key"
    key_file.write_text(key_text)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "buzz_delivery.gateway.client", "work-runs", "--url", "http://127.0.0.1:9/gateway/v1",
         "--key-file", str(key_file), "--handler", handler],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    for word in named:
        assert word in proc.stderr, (word, proc.stderr)


def test_a_url_that_is_not_the_gateway_is_named_in_one_line(gateway_server):
    """``--url http://host/gateway`` (without ``/v1``) logged "404 not_json:" and then the 404
    page's HTML over several lines, every second: nothing said which URL, nor what to check."""
    from buzz_delivery.gateway.client import GatewayClient, GatewayHTTPError

    wrong = gateway_server.base.rsplit("/v1", 1)[0]
    client = GatewayClient(wrong, os.urandom(32))
    try:
        with pytest.raises(GatewayHTTPError) as info:
            client.claim_runs(1)
    finally:
        client.close()
    text = str(info.value)
    assert info.value.status == 404 and info.value.code == "not_json"
    assert f"{wrong}/runs/claim" in text and "gateway's mount" in text and "\n" not in text, text


@pytest.fixture
def restarting_gateway():
    """A real HTTP server standing in for a gateway that restarts: every claim is answered 503
    (not the gateway's JSON: a proxy's page) for ``OUTAGE`` seconds, then one claim is handed
    out, then none; every other request is answered 503 (the claimed item is then left to its lease)."""
    import threading
    import time

    from tests.gateway.fake_server import Reply, fake_gateway

    community, item = "00000000-0000-7000-8000-000000000001", "00000000-0000-7000-8000-000000000002"
    lease = {"community_id": community, "lease_generation": 1, "lease_until": "2999-01-01T00:00:00+00:00"}
    claims = {
        "/runs/claim": {"run": {"id": item, "input": {}, "unwinding": False},
                        "lease": {**lease, "run_id": item, "worker_id": "w"}},
        "/deliveries/claim": {"delivery": {"id": item, "step_id": "quick_1"}, "lease": {**lease, "delivery_id": item}},
    }  # fmt: skip
    started, handed = time.monotonic(), threading.Event()

    def answer(path: str) -> Reply:
        route = next((r for r in claims if path.endswith(r)), None)
        if route is not None and time.monotonic() - started >= OUTAGE:
            body = json.dumps({"claims": [] if handed.is_set() else [claims[route]]}).encode()
            handed.set()
            return 200, body, {}
        return 503, b"<html>503 Service Unavailable</html>", {}

    with fake_gateway(post=answer) as url:
        yield f"{url}/gateway/v1"


OUTAGE = 3.0  # seconds: longer than --idle-exit below, shorter than UNREACHABLE_IDLE_SECONDS


@pytest.mark.parametrize("command", ["work", "work-runs"])
def test_a_gateways_restart_shorter_than_the_unreachable_bound_does_not_end_an_idle_exit_worker(
    restarting_gateway, tmp_path, command
):
    """A worker that has drained its backlog and then meets a gateway's restart waits for it (the
    backlog may still be there), as run_agent_worker waits UNREACHABLE_IDLE_SECONDS for its
    database; only then do its failed claims count as idle for --idle-exit."""
    from buzz_delivery.gateway.client import UNREACHABLE_IDLE_SECONDS

    assert 1 < OUTAGE < UNREACHABLE_IDLE_SECONDS
    key_file = tmp_path / "agent.key"
    key_file.write_text(os.urandom(32).hex() + "\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "GATEWAY_RUN_LEDGER": str(tmp_path / "ledger.txt")}
    proc = subprocess.run(
        [sys.executable, "-m", "buzz_delivery.gateway.client", command, "--url", restarting_gateway,
         "--key-file", str(key_file), "--handler", HANDLERS[command], "--wait-seconds", "0",
         "--idle-exit", "1", "--shutdown-grace", "1"]
        + (["--no-accept", "--worker-id", "w"] if command == "work-runs" else []),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["claimed"] == 1, (summary, proc.stderr[-2000:])  # it was still there after the restart
    assert summary["reason"] in ("idle", "idle_exit"), summary
