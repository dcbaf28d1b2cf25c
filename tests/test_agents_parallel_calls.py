"""Parallel tool calls by one holder (issue 28): threads of one handler calling ``ctx.call`` on one
Context at once each get their call journaled, made and recorded; none gets a false
``LeaseLost`` (the run was ``waiting_tool`` for another call) and the run is not abandoned."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import claim_agent_runs
from tests.agents_support import AGENT, new_run
from tests.conftest import BARRIER_TIMEOUT

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 4


def slow(args: dict, key: str) -> dict:
    time.sleep(0.05)  # every call is in flight while the others journal and record
    return {"n": args["n"]}


def parallel(ctx) -> dict:
    barrier = threading.Barrier(THREADS, timeout=BARRIER_TIMEOUT)
    outputs: dict[int, object] = {}

    def one(n: int) -> None:
        try:
            barrier.wait()
            outputs[n] = ctx.call("slow", slow, {"n": n})
        except BaseException as exc:
            outputs[n] = repr(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=one, args=(n,)) for n in range(1, THREADS + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {str(n): outputs[n] for n in sorted(outputs)}


def test_threads_of_one_holder_calling_tools_at_once_all_get_their_calls_and_the_run_completes(community):
    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)

    assert run_claim(claimed, parallel) == "completed"

    run = AgentRun.objects.get(id=run_id)
    assert run.output == {str(n): {"n": n} for n in range(1, THREADS + 1)}
    entries = JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    assert [(e.seq, e.status) for e in entries] == [(n, "succeeded") for n in range(1, THREADS + 1)]
    assert sorted(e.args["n"] for e in entries) == list(range(1, THREADS + 1))
    assert run.tool_calls_used == THREADS
