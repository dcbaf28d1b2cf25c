"""OpenAI Agents SDK integration, replay defects the reviewers left open (on a fake ``Model``, real
PostgreSQL): two function calls of one response sharing a ``call_id`` each replay their own
entry; a durable agent run on a thread inside another agent's tool journals its calls and its
approval parks the run (an event-loop context given to the threaded entry fails fast); a tool's
timeout never records a call while a thread it started still runs."""

from __future__ import annotations

import asyncio
import threading

import pytest
from agents import Agent, function_tool
from agents.testing import assistant_message, function_call
from django.db import connections

from buzz_delivery.agents.integrations.openai_agents import DurableAgent, idempotency_key
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from tests import openai_agents_handlers as oh
from tests.agents_support import new_run
from tests.test_agents_journal_scopes import _approve, _claim

WAIT = 30  # bound of every wait for another call (never reached when the code is right)


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    path = tmp_path / "ledger.txt"
    monkeypatch.setenv("AGENT_LEDGER", str(path))
    monkeypatch.delenv("AGENT_KILL", raising=False)
    return path


# -- two function calls of one response with the same call_id ---------------------------------
#
# Reported as a defect: both calls journaled in ``tool:<call_id>``, replayed in another order
# they swap results. The SDK this project requires (openai-agents>=0.24) never runs two calls
# of one id: a reuse for other arguments fails the run (``ModelBehaviorError``) before any tool
# is called, an identical one is made once. These tests pin that (a change of the SDK's that
# lets two calls of one id run would fail them, and the scope would need an occurrence index).


def _same_id_agent(args_b):
    def answer(input):
        done = oh.returns(input)
        if not done:
            return oh.response(
                function_call("effect", {"n": 1}, call_id="dup"), function_call("effect", args_b, call_id="dup")
            )
        if len(done) == 1:
            return oh.response(function_call("refund", {"n": 7}, call_id="refund-1"))
        return oh.response(assistant_message(f"answers={done}"))

    return DurableAgent(
        Agent(name="dup", model=oh.FakeModel("dup", answer), tools=[oh.effect, oh.refund]),
        run_config=oh.NO_TRACING,
        compensations={"effect": oh.h.undo},
    )


def _calls(ledger):
    return [x for x in (ledger.read_text().splitlines() if ledger.exists() else []) if x.startswith("call")]


@pytest.mark.django_db
def test_two_calls_of_one_response_with_one_call_id_and_other_arguments_fail_the_run_before_any_tool(community, ledger):
    run_id = new_run(community.id)
    assert run_claim(_claim(community), _same_id_agent({"n": 2})) == "failed"
    run = AgentRun.objects.get(id=run_id)
    assert "reused a tool call ID" in run.failure_message, run.failure_message
    assert [e.tool_name for e in JournalEntry.objects.filter(run_id=run_id)] == ["model:dup"]
    assert _calls(ledger) == []


@pytest.mark.django_db
def test_two_identical_calls_of_one_response_with_one_call_id_are_made_once_and_replay_after_an_approval(
    community, ledger
):
    run_id = new_run(community.id)
    assert run_claim(_claim(community), _same_id_agent({"n": 1})) == "parked"
    effects = [
        (e.scope, e.replay_key[1], e.status) for e in JournalEntry.objects.filter(run_id=run_id, tool_name="effect")
    ]
    assert effects == [("tool:dup", 1, "succeeded")] and _calls(ledger) == [f"call {run_id}:2"]
    _approve(community, run_id)
    outcome = run_claim(_claim(community, "w2"), _same_id_agent({"n": 1}))
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert _calls(ledger) == [f"call {run_id}:2"]  # replayed, not made again
    assert run.output == "answers=[{'n': 1}, {'n': 7}]"


# -- a durable agent run on a thread inside another agent's tool --------------------------------


class Delegating:
    """An outer agent whose tool ``delegate`` runs a durable inner agent (``inner``) on the run's
    context, on a thread (``asyncio.to_thread``, which copies the tool's context)."""

    def __init__(self, inner):
        self.inner = inner
        self.ctx = None

    def handler(self, ctx):
        self.ctx = ctx
        test = self

        def answer(input):
            done = oh.returns(input)
            if not done:
                return oh.response(function_call("delegate", {}, call_id="outer-1"))
            return oh.response(assistant_message(f"inner said {done[0]}"))

        @function_tool(failure_error_function=None)
        async def delegate() -> str:
            def inner():
                try:
                    return test.inner(test.ctx)
                finally:
                    connections.close_all()

            return await asyncio.to_thread(inner)

        agent = Agent(name="outer", model=oh.FakeModel("outer", answer), tools=[delegate])
        return DurableAgent(agent, run_config=oh.NO_TRACING)(ctx)


def _bounded(fn):
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as exc:
            box["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT * 2)
    assert not thread.is_alive(), "the handler still waits"
    if "error" in box:
        raise box["error"]
    return box["out"]


def _rows(run_id):
    return [(e.scope, e.tool_name, e.status) for e in JournalEntry.objects.filter(run_id=run_id).order_by("seq")]


@pytest.mark.django_db(transaction=True)
def test_a_durable_agent_run_on_a_thread_in_another_agent_s_tool_journals_its_calls_in_that_call(community, ledger):
    """Failed before: only the outer agent's calls were journaled, the inner agent's model
    requests and tool calls were taken for a part of the outer call's body (an approval of it
    then waited for ever, below). Now journaled in the outer call's body's scope."""
    run_id = new_run(community.id)
    outcome = _bounded(lambda: run_claim(_claim(community), Delegating(oh.three_effects).handler))
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert run.output == "inner said sum=6 keys=3"
    inside = "tool:outer-1/#1"  # the body of the outer call: never visited once it is recorded
    effects = [(f"{inside}/tool:call-{n}", "effect", "succeeded") for n in (1, 2, 3)]
    model = (inside, "model:three-effects", "succeeded")
    assert _rows(run_id) == [
        ("", "model:outer", "succeeded"),
        ("tool:outer-1", "delegate", "succeeded"),
        model, effects[0], model, effects[1], model, effects[2], model,
        ("", "model:outer", "succeeded"),
    ]  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_an_approval_asked_by_an_agent_run_in_another_agent_s_tool_fails_at_once_naming_what_to_do(community, ledger):
    """Failed before: the approval waited for the outer call to be recorded, which waited for the
    inner agent: the handler hung (its heartbeat keeping the lease)."""
    run_id = new_run(community.id)
    outcome = _bounded(lambda: run_claim(_claim(community), Delegating(oh.approval).handler))
    run = AgentRun.objects.get(id=run_id)
    assert (outcome, run.state) == ("failed", "failed"), run.failure_message
    assert "ask for it in the outer agent" in run.failure_message, run.failure_message
    assert lines_of(ledger, "refund") == []
    assert [r for r in _rows(run_id) if r[1] == "approval"] == []


def lines_of(ledger, prefix):
    return [x for x in (ledger.read_text().splitlines() if ledger.exists() else []) if x.startswith(prefix)]


def test_the_threaded_entry_refuses_an_event_loop_runtime_s_context_at_once():
    """Failed before: the thread bridge called the async ``ctx.call`` without awaiting it (a
    coroutine never run for the model request's journal entry)."""
    import types

    class AsyncCtx:
        lease = types.SimpleNamespace(run_id="r")
        input = {"prompt": "go"}
        journal_scopes = True

        async def call(self, *args, **kwargs):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="await the handler's run"):
        _bounded(lambda: oh.three_effects(AsyncCtx()))


# -- a tool's timeout fires while a thread the tool started still runs ---------------------------

RELEASE_BOUND = 3  # seconds the blocked thread waits for the run to end (the bug: it ends first)


def _timing_out_agent(behavior, entered, release):
    def answer(input):
        done = oh.returns(input)
        if not done:
            return oh.response(function_call("charge", {"n": 1}, call_id="charge-1"))
        return oh.response(assistant_message(f"charge said {done[0]}"))

    def blocking(n, key):
        entered.set()
        release.wait(WAIT)
        return oh.h.effect({"n": n}, key)

    @function_tool(timeout=0.2, timeout_behavior=behavior, failure_error_function=None)
    async def charge(n: int) -> dict:
        return await asyncio.to_thread(blocking, n, idempotency_key())

    return DurableAgent(
        Agent(name="charging", model=oh.FakeModel("charging", answer), tools=[charge]),
        run_config=oh.NO_TRACING,
        compensations={"charge": oh.h.undo},
    )


def _on_the_event_loop_worker(community, durable):
    from buzz_delivery.agents import loop_worker
    from tests.agents_support import AGENT

    config = loop_worker.AsyncWorkerConfig(
        handler=durable.run,
        agents=[AGENT],
        communities=[community.id],
        exit_when_idle=True,
        poll_seconds=0.1,
        lease_seconds=15,
        worker_id="aio-timeout",
    )
    loop_worker.AsyncAgentWorker(config).run()
    return "completed"  # judged by the run's row


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("runtime", ["thread", "event-loop"])
@pytest.mark.parametrize("behavior", ["error_as_result", "raise_exception"])
def test_a_tool_s_timeout_firing_while_its_thread_runs_records_the_call_once_the_thread_ended(
    community, ledger, behavior, runtime
):
    """Failed before: at the timeout the call was recorded (the timeout's message, or failed)
    while the thread ran on; the run then ended (completed telling the model the charge timed
    out, or failed with nothing to undo) and the thread charged afterwards. Now a tool that has
    started a thread is not cut at its timeout: the call lands once the tool ended, with its true
    result (what the model sees, replayed as is)."""
    entered, release = threading.Event(), threading.Event()
    run_id = new_run(community.id)

    def releaser():
        try:
            entered.wait(WAIT)
            for _ in range(RELEASE_BOUND * 20):  # the bug: the run ends while the thread runs
                if AgentRun.objects.get(id=run_id).state in ("completed", "failed"):
                    break
                threading.Event().wait(0.05)
        finally:
            release.set()
            connections.close_all()

    watcher = threading.Thread(target=releaser, daemon=True)
    watcher.start()
    durable = _timing_out_agent(behavior, entered, release)
    if runtime == "thread":
        outcome = _bounded(lambda: run_claim(_claim(community), durable))
    else:
        outcome = _bounded(lambda: _on_the_event_loop_worker(community, durable))
    watcher.join(WAIT)
    run = AgentRun.objects.get(id=run_id)
    charge = JournalEntry.objects.get(run_id=run_id, tool_name="charge")
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert (charge.status, charge.output) == ("succeeded", {"return": {"n": 1}})
    assert lines_of(ledger, "call") == [f"call {charge.idempotency_key}"]
    assert run.output == "charge said {'n': 1}"
