"""The remote run worker (``work-runs``) sends a compensation's error text the gateway can store
(review of issue 29): over 10,000 characters, or with a NUL, it is made storable and cut as a
failure message is (``client.storable``), so the compensation fails once and the run fails, as
with short text. Before, the gateway refused the text (400), the run's unwinding raised, the run
was left to lapse and its compensation was made again at each reclaim."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import reap_agent_runs
from buzz_delivery.testing import CommunityFactory
from tests.agents_support import backdate_run_lease, make_claimable
from tests.gateway.support import ROOT, enroll, new_agent
from tests.gateway.test_remote_runs import intake

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_unstorable_compensation_error_fails_the_compensation_once(gateway_server, tmp_path):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    runs = {}
    for how in ("huge", "nul"):
        run_id = intake(community, agent, {})
        (claim,) = agent.claim_runs(worker_id="earlier")
        journaled = agent.journal_call(
            claim.lease, "effect", {"n": 1}, compensation={"function": f"tests.gateway.handlers:undo_raises_{how}"}
        )
        assert agent.record_result(claim.lease, journaled.data["seq"], ok=True, output={"n": 1}).outcome == "recorded"
        assert agent.fail_run(claim.lease, "give_up").outcome == "unwinding"  # ... and walk away from it
        backdate_run_lease(run_id)
        runs[how] = run_id
    reap_agent_runs()
    for run_id in runs.values():
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
    entries = {e.run_id: e for e in JournalEntry.objects.filter(run_id__in=runs.values())}
    assert {how: entries[r].compensation_status for how, r in runs.items()} == {
        "huge": "compensation_failed",
        "nul": "compensation_failed",
    }
    assert entries[runs["huge"]].compensation_error == ("RuntimeError: " + "u" * 20_000)[:10_000]
    assert entries[runs["nul"]].compensation_error == "RuntimeError: before\\x00after"
    assert set(AgentRun.objects.filter(id__in=runs.values()).values_list("state", flat=True)) == {"failed"}
    attempts = [x for x in ledger.read_text().splitlines() if x.startswith("undo-attempt ")]
    assert len(attempts) == 2, attempts
