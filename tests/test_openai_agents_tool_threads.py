"""OpenAI Agents SDK integration: a tool's timeout and the threads the tool started on the agent
loop's default executor (``integrations.journal.ToolThreads``), on a fake ``Model``, real
PostgreSQL, under both runtimes."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from agents import Agent, function_tool
from agents.testing import assistant_message, function_call
from django.db import connections

from buzz_delivery.agents.integrations.openai_agents import DurableAgent, idempotency_key
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from tests import openai_agents_handlers as oh
from tests.agents_support import new_run
from tests.test_agents_journal_scopes import _claim
from tests.test_openai_agents_replay import WAIT, _bounded, _on_the_event_loop_worker, lines_of


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    path = tmp_path / "ledger.txt"
    monkeypatch.setenv("AGENT_LEDGER", str(path))
    monkeypatch.delenv("AGENT_KILL", raising=False)
    return path


def _resolving_then_hanging_agent(first):
    """A tool that resolves a host name (asyncio's ``getaddrinfo``: a thread on the loop's default
    executor, as every async HTTP client's new connection does; or a slow resolver, still running
    at the timeout), then waits on a server that never answers (async code: a cancel stops it)."""

    def answer(input):
        done = oh.returns(input)
        if not done:
            return oh.response(function_call("fetch", {"url": "http://localhost/"}, call_id="fetch-1"))
        return oh.response(assistant_message(f"fetch said {done[0]}"))

    @function_tool(timeout=0.2, failure_error_function=None)
    async def fetch(url: str) -> str:
        if first == "slow-resolver":
            await asyncio.to_thread(time.sleep, 1)
        await asyncio.get_running_loop().getaddrinfo("localhost", 80)
        await asyncio.sleep(WAIT)  # the server that never answers (the bug: waited to its end)
        return "answered"

    return DurableAgent(
        Agent(name="fetching", model=oh.FakeModel("fetching", answer), tools=[fetch]), run_config=oh.NO_TRACING
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("runtime", ["thread", "event-loop"])
@pytest.mark.parametrize("first", ["resolver", "slow-resolver"])
def test_a_tool_whose_threads_have_ended_is_cut_at_its_timeout(community, runtime, first):
    """Failed before: any thread the tool had started by its timeout, even one long ended (a host
    name resolved by the HTTP client), made the tool run to its end: the timeout of every tool
    calling a hanging server over HTTP was gone (bound by nothing under the threaded runtime).
    A thread that has ended can make no effect after the call is recorded: the tool is cut at
    its timeout, or, a thread still running then, once its threads have ended and the timeout
    has passed again."""
    run_id = new_run(community.id)
    durable = _resolving_then_hanging_agent(first)
    if runtime == "thread":
        outcome = _bounded(lambda: run_claim(_claim(community), durable))
    else:
        outcome = _bounded(lambda: _on_the_event_loop_worker(community, durable))
    run = AgentRun.objects.get(id=run_id)
    fetch = JournalEntry.objects.get(run_id=run_id, tool_name="fetch")
    assert outcome == "completed", (run.failure_code, run.failure_message)
    timed_out = "Tool 'fetch' timed out after 0.2 seconds."
    assert (fetch.status, fetch.output) == ("succeeded", {"return": timed_out})
    assert run.output == f"fetch said {timed_out}"


# -- a tool's thread that never started (the loop's default executor busy) at its timeout --------


def _queued_thread_agent(hogged, release):
    """``hog`` fills the loop's default executor with threads of its own (as other runs' tools on
    the worker's loop do); ``charge`` (timeout 0.2 s) then asks for a thread for its effect: it
    waits in the executor's queue, never started, at the timeout."""

    def answer(input):
        done = oh.returns(input)
        if not done:
            return oh.response(function_call("hog", {}, call_id="hog-1"))
        if len(done) == 1:
            return oh.response(function_call("charge", {"n": 1}, call_id="charge-1"))
        return oh.response(assistant_message(f"charge said {done[1]}"))

    @function_tool(timeout=30, failure_error_function=None)
    async def hog() -> str:
        loop = asyncio.get_running_loop()
        for _ in range(loop._default_executor._max_workers):  # type: ignore[attr-defined]
            loop.run_in_executor(None, release.wait, WAIT * 2)
        hogged.set()
        return "hogging"

    @function_tool(timeout=0.2, failure_error_function=None)
    async def charge(n: int) -> dict:
        key = idempotency_key()
        return await asyncio.to_thread(oh.h.effect, {"n": n}, key)

    return DurableAgent(
        Agent(name="queued", model=oh.FakeModel("queued", answer), tools=[hog, charge]), run_config=oh.NO_TRACING
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("runtime", ["thread", "event-loop"])
def test_a_tool_whose_thread_never_started_is_cut_at_its_timeout_and_its_thread_never_runs(community, ledger, runtime):
    """Failed before: a thread waiting in the default executor's queue (every worker busy with
    other tools' threads) counted as a thread the tool had started: the tool waited for it past
    its timeout, for as long as the others ran, then made its effect. A thread not started can
    be stopped: it is cancelled and the tool is cut at its timeout (as before ToolThreads)."""
    hogged, release = threading.Event(), threading.Event()
    run_id = new_run(community.id)

    def releaser():
        try:
            hogged.wait(WAIT)
            for _ in range(WAIT * 20):  # the hog's threads end once charge is recorded (bounded)
                if JournalEntry.objects.filter(run_id=run_id, tool_name="charge", status="succeeded").exists():
                    break
                threading.Event().wait(0.05)
        finally:
            release.set()
            connections.close_all()

    watcher = threading.Thread(target=releaser, daemon=True)
    watcher.start()
    durable = _queued_thread_agent(hogged, release)
    if runtime == "thread":
        outcome = _bounded(lambda: run_claim(_claim(community), durable))
    else:
        outcome = _bounded(lambda: _on_the_event_loop_worker(community, durable))
    watcher.join(WAIT)
    run = AgentRun.objects.get(id=run_id)
    charge = JournalEntry.objects.get(run_id=run_id, tool_name="charge")
    assert outcome == "completed", (run.failure_code, run.failure_message)
    timed_out = "Tool 'charge' timed out after 0.2 seconds."
    assert (charge.status, charge.output) == ("succeeded", {"return": timed_out})
    assert lines_of(ledger, "call") == []  # its thread never ran
