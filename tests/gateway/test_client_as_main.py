"""``python -m buzz_delivery.gateway.client`` (how the README and the tests start ``work`` and
``work-runs``) runs the file as ``__main__``: a second copy of the module beside the one
``remote_runs`` imports. Its client then raised ``__main__.GatewayHTTPError``, a class
``remote_runs`` does not catch, so a step batch the gateway answered 503 ("the database is
unavailable; retry later", a distributed deadlock on Citus) was not sent again nor turned into a
lost run: it reached the handler, which failed its run and compensated it (the Citus CI's
batched-completions failure). The real command against a real HTTP server that answers every
run step 503: the run is left to its lease (``lost``), never failed."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.gateway.fake_server import Reply, fake_gateway

ROOT = Path(__file__).resolve().parents[2]
COMMUNITY, RUN = "00000000-0000-7000-8000-000000000001", "00000000-0000-7000-8000-000000000002"
LEASE = {"community_id": COMMUNITY, "run_id": RUN, "lease_generation": 1,
         "lease_until": "2999-01-01T00:00:00+00:00", "worker_id": "w"}  # fmt: skip
CLAIM = {"run": {"id": RUN, "input": {"n": 1}, "unwinding": False, "tool_calls_used": 0}, "lease": LEASE}


@pytest.fixture
def unavailable_gateway():
    """One run to claim, then none; every other POST answered as the gateway answers a database
    error (503, code ``unavailable``). Records each request's path."""
    paths: list[str] = []
    claimed = threading.Event()

    def answer(path: str) -> Reply:
        paths.append(path)
        if path.endswith("/runs/claim"):
            status, body = 200, {"claims": [] if claimed.is_set() else [CLAIM]}
            claimed.set()
        else:
            status, body = 503, {"code": "unavailable", "message": "the database is unavailable; retry later"}
        return status, body, {}

    with fake_gateway(post=answer) as url:
        yield url, paths


def test_work_runs_run_as_a_module_leaves_a_run_whose_steps_get_503_to_its_lease(unavailable_gateway, tmp_path):
    url, paths = unavailable_gateway
    key_file = tmp_path / "agent.key"
    key_file.write_text(bytes(range(1, 33)).hex() + "\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "GATEWAY_RUN_LEDGER": str(tmp_path / "ledger.txt")}
    argv = [sys.executable, "-m", "buzz_delivery.gateway.client", "work-runs", "--url", url,
            "--key-file", str(key_file), "--handler", "tests.gateway.handlers:three_calls",
            "--wait-seconds", "0", "--idle-exit", "1", "--max-runs", "1", "--no-accept",
            "--worker-id", "w"]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert (summary["lost"], summary["failed"], summary["completed"]) == (1, 0, 0), (summary, proc.stderr)
    assert not [p for p in paths if p.endswith("/fail")], paths  # the run was never failed
    steps = [p for p in paths if p.endswith(("/runs/calls", "/runs/steps"))]
    assert len(steps) == 4, paths  # the first call's batch, sent again three times (a 503 kept nothing)
