"""The event-loop agent worker (issue 29): async handlers, tools, reconcile hooks and
compensations; many runs in flight on a fixed number of connections, with journal writes,
results, renewals and completions batched per community, each row fenced by its own lease."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import cancel_agent_run, reap_agent_runs
from project.database_url import database_url
from tests import agent_async_handlers as ah
from tests import agent_handlers as h
from tests.agents_support import AGENT, backdate_run_lease, make_claimable, new_run

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    path = tmp_path / "ledger.txt"
    monkeypatch.setenv("AGENT_LEDGER", str(path))
    return path


def in_process(community, handler, **options):
    config = AsyncWorkerConfig(
        handler=handler,
        agents=[AGENT],
        communities=[community.id],
        exit_when_idle=True,
        poll_seconds=0.1,
        lease_seconds=15,
        worker_id="aio-test",
        **options,
    )
    worker = AsyncAgentWorker(config)
    return worker, worker.run()


def states(run_ids):
    return sorted(AgentRun.objects.filter(id__in=run_ids).values_list("state", flat=True))


def test_async_handlers_run_to_completion_with_their_calls_journaled_once(community, ledger):
    run_ids = [new_run(community.id) for _ in range(12)]
    worker, counts = in_process(community, ah.three_calls, in_flight=50, connections=2)
    assert counts["completed"] == 12, counts
    assert states(run_ids) == ["completed"] * 12
    entries = JournalEntry.objects.filter(run_id__in=run_ids)
    assert entries.count() == 36 and set(entries.values_list("status", flat=True)) == {"succeeded"}
    calls = [line for line in h.ledger_lines() if line.startswith("call ")]
    assert len(calls) == 36 and len(set(calls)) == 36
    assert counts["batched_items"] > counts["batches"]  # several runs shared a statement
    assert AgentRun.objects.get(id=run_ids[0]).output == {"sum": 6, "agent": "async_three_calls"}


def test_a_plain_handler_runs_on_a_thread_in_the_event_loop_worker(community, ledger):
    run_ids = [new_run(community.id) for _ in range(4)]
    _, counts = in_process(community, h.three_calls, in_flight=8, connections=2)
    assert counts["completed"] == 4, counts
    assert states(run_ids) == ["completed"] * 4
    assert len([line for line in h.ledger_lines() if line.startswith("call ")]) == 12


def test_an_async_handler_that_fails_is_compensated_by_an_async_compensation_and_fails_alone(community, ledger):
    bad = new_run(community.id, agent=None)
    _, counts = in_process(community, ah.fails_then_compensates, in_flight=4, connections=1)
    assert counts["compensated"] == 1, counts
    run = AgentRun.objects.get(id=bad)
    assert run.state == "failed" and run.failure_code == "handler_error"
    undone = [line for line in h.ledger_lines() if line.startswith("undo ")]
    assert undone == [f"undo {bad}:2:compensate", f"undo {bad}:1:compensate"]
