"""The agent worker's poison matrix (issue 28), as a real ``run_agent_worker`` process: every kind
of hostile handler ends only its own run, with a failure code, and the worker serves every other
run on the same handler thread, counts each in its summary and exits 0. User code runs on a
connection of its own: what a handler leaves open there never holds the runtime's journal or
completion, so nothing vanishes at stop and no tool runs twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from django.db import connection

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import Created, intake_event
from project.database_url import database_url
from tests.agents_support import AGENT

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent

# kind -> (state, failure code, its one call: None (no call), "kept" or "undone")
POISON = {
    "not_json": ("failed", "output_not_json", None),
    "nul_output": ("failed", "output_not_json", None),
    "too_large": ("failed", "output_too_large", None),
    "unprintable": ("failed", "handler_error", None),
    "long_code": ("failed", "c" * 64, None),
    "system_exit": ("failed", "handler_aborted", None),
    "keyboard_interrupt": ("failed", "handler_aborted", None),
    "cancelled": ("failed", "handler_aborted", None),
    "base_exception": ("failed", "handler_aborted", None),
    "exit_mid_call": ("failed", "handler_aborted", "undone"),  # its call left pending: undone too
    "terminate_self": ("failed", "handler_error", "undone"),  # its own connection: the handler's error
    "terminate_runtime": ("completed", None, "kept"),  # the runtime reconnects and completes it
    "atomic_left_open": ("failed", "transaction_left_open", "undone"),
    "raw_begin": ("failed", "transaction_left_open", "undone"),
    "autocommit_off": ("failed", "transaction_left_open", "undone"),
    "statement_timeout": ("completed", None, "kept"),  # its session setting is cleaned after it
}


def new_run(community, kind: str) -> uuid.UUID:
    outcome = intake_event(community.id, "poison", uuid.uuid4().hex, {"kind": kind}, AGENT, max_attempts=1)
    assert isinstance(outcome, Created)
    return outcome.run_id


def run_worker(community, ledger: Path, *options: str) -> tuple[int, dict | None, str]:
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "BUZZ_MIN_LEASE_SECONDS": "1",
        "AGENT_LEDGER": str(ledger),
    }
    proc = subprocess.run(
        [
            sys.executable, "manage.py", "run_agent_worker", "--handler", "tests.agent_poison_handlers:poison",
            "--agent", AGENT.hex(), "--community", str(community.id), "--exit-when-idle",
            "--poll-seconds", "0.2", "--lease-seconds", "15", *options,
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    return proc.returncode, json.loads(lines[-1]) if lines else None, proc.stderr


def test_the_agent_worker_poison_matrix_each_run_fails_alone_and_the_worker_serves_the_rest(community, tmp_path):
    ledger = tmp_path / "ledger.txt"
    poison, ordinary = {}, []
    for kind in POISON:
        poison[kind] = new_run(community, kind)
        ordinary.append(new_run(community, "ordinary"))  # claimed right after it, on the same thread

    code, summary, err = run_worker(community, ledger, "--concurrency", "1")

    assert code == 0, err
    runs = {r.id: r for r in AgentRun.objects.filter(community_id=community.id)}
    lines = ledger.read_text().splitlines()
    for kind, (state, failure, call) in POISON.items():
        run = runs[poison[kind]]
        assert (run.state, run.failure_code) == (state, failure), (kind, run.failure_message)
        key = f"{run.id}:1"
        assert lines.count(f"made {key}") == (0 if call is None else 1), kind  # never twice
        assert lines.count(f"ran {key}:compensate") == (1 if call == "undone" else 0), kind
    assert runs[poison["unprintable"]].failure_message == "Unprintable: <unprintable Unprintable>"
    assert runs[poison["system_exit"]].failure_message == "SystemExit: 3"
    assert runs[poison["terminate_self"]].failure_message.startswith("OperationalError")
    assert "atomic() block" in runs[poison["atomic_left_open"]].failure_message
    entry = JournalEntry.objects.get(run_id=poison["exit_mid_call"])
    assert (entry.status, entry.uncertain, entry.compensation_status) == ("failed", True, "compensated")
    for run_id in ordinary:
        run = runs[run_id]
        assert run.state == "completed", run.failure_message
        assert run.output == {"statement_timeout": "0", "in_atomic_block": False}  # a clean connection
        assert lines.count(f"made {run_id}:1") == 1
    completed = len(ordinary) + sum(1 for state, _, _ in POISON.values() if state == "completed")
    compensated = sum(1 for _, _, call in POISON.values() if call == "undone")
    failed = len(POISON) + len(ordinary) - completed - compensated
    assert (summary["claimed"], summary["completed"], summary["compensated"], summary["failed"]) == (
        len(POISON) + len(ordinary), completed, compensated, failed,
    )  # fmt: skip
    assert (summary["lost"], summary["internal_errors"]) == (0, 0)
    assert "worker_error" not in err

    # Nothing was left in a transaction that rolled back at stop: a second worker finds nothing.
    code, again, err = run_worker(community, ledger)
    assert (code, again["claimed"]) == (0, 0), err
    assert ledger.read_text().splitlines() == lines


def test_a_loop_thread_lost_to_a_base_exception_is_counted_never_a_silent_clean_exit(community, monkeypatch):
    from buzz_delivery.agents import worker as w

    new_run(community, "ordinary")

    def runtime_bug(*args: object, **kwargs: object) -> str:
        raise SystemExit(9)  # not the handler's (run_claim ends those runs): the worker's own thread

    monkeypatch.setattr(w, "run_claim", runtime_bug)
    worker = w.AgentWorker(
        w.WorkerConfig(
            handler=lambda ctx: {},
            agents=[AGENT],
            communities=[community.id],
            exit_when_idle=True,
            listen=False,
            worker_id="w",
        )
    )

    counts = worker.run()

    assert (counts["claimed"], counts["internal_errors"]) == (1, 1)
    assert json.loads(worker.summary_line())["internal_errors"] == 1  # the command exits 1 on it
