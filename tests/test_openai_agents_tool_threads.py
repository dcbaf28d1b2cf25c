"""OpenAI Agents SDK integration: a tool's timeout and the threads the tool started on the agent
loop's default executor (``integrations.journal.ToolThreads``), on a fake ``Model``, real
PostgreSQL, under both runtimes."""

from __future__ import annotations

import asyncio
import time

import pytest
from agents import Agent, function_tool
from agents.testing import assistant_message, function_call

from buzz_delivery.agents.integrations.openai_agents import DurableAgent
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from tests import openai_agents_handlers as oh
from tests.agents_support import new_run
from tests.test_agents_journal_scopes import _claim
from tests.test_openai_agents_replay import WAIT, _bounded, _on_the_event_loop_worker


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
