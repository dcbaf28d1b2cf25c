"""``exit_when_idle`` and a poll the database fails (both agent workers, in this process, real
PostgreSQL): one failed poll is retried, not taken for an idle one; the worker stops on its own
only once polls have not reached the database for ``UNREACHABLE_IDLE_SECONDS`` (the subprocess
test against a dead port is in test_worker_commands_cli). Before, a single terminated backend or
a restart's gap ended an ``--exit-when-idle`` worker with exit 0 and its backlog left behind.

The failure is injected into the worker's own poll (a Django ``OperationalError``, what a lost
connection raises there); everything else runs against the database."""

from __future__ import annotations

import pytest
from django.db import OperationalError, connections

from buzz_delivery.agents import worker as worker_module
from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig
from tests.agents_support import AGENT, new_run

pytestmark = pytest.mark.django_db(transaction=True)


def quick(ctx):
    return {"ok": True}


def fail_first(method):
    """``method`` that raises OperationalError on its first call (a lost connection), then runs."""
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return method(*args, **kwargs)

    return wrapped


def test_the_thread_worker_retries_a_failed_poll_and_serves_the_backlog_before_it_stops(community, monkeypatch):
    run_ids = [new_run(community.id) for _ in range(3)]
    worker = AgentWorker(
        WorkerConfig(
            handler=quick, agents=[AGENT], communities=[community.id], poll_seconds=0.1, exit_when_idle=True,
            worker_id="w", listen=False,
        )
    )  # fmt: skip
    monkeypatch.setattr(worker, "_poll", fail_first(worker._poll))
    try:
        counts = worker.run()
    finally:
        connections.close_all()
    assert counts["db_errors"] == 1, counts
    assert counts["completed"] == 3, counts
    assert sorted(AgentRun.objects.filter(id__in=run_ids).values_list("state", flat=True)) == ["completed"] * 3


def test_the_event_loop_worker_retries_a_failed_round_and_serves_the_backlog_before_it_stops(community, monkeypatch):
    run_ids = [new_run(community.id) for _ in range(3)]
    worker = AsyncAgentWorker(
        AsyncWorkerConfig(
            handler=quick, agents=[AGENT], communities=[community.id], exit_when_idle=True, poll_seconds=0.1,
            lease_seconds=15, worker_id="aio", connections=2,
        )
    )  # fmt: skip
    round_ = worker._round
    calls = {"n": 0}

    async def failing_first(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return await round_(*args, **kwargs)

    monkeypatch.setattr(worker, "_round", failing_first)
    counts = worker.run()
    assert counts["db_errors"] == 1, counts
    assert counts["completed"] == 3, counts
    assert sorted(AgentRun.objects.filter(id__in=run_ids).values_list("state", flat=True)) == ["completed"] * 3


def test_polls_that_never_reach_the_database_count_as_idle_after_the_window(monkeypatch):
    monkeypatch.setattr(worker_module.time, "monotonic", lambda: 100.0)
    assert not worker_module.unreachable_for_long(100.0 - worker_module.UNREACHABLE_IDLE_SECONDS + 0.5, 0.1)
    assert worker_module.unreachable_for_long(100.0 - worker_module.UNREACHABLE_IDLE_SECONDS, 0.1)
    assert not worker_module.unreachable_for_long(90.0, 4.0)  # three poll intervals when longer
    assert worker_module.unreachable_for_long(88.0, 4.0)
