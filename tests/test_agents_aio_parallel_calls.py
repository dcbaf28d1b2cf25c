"""The event-loop runtime: calls of one run made by several tasks are in flight at once.

The run's call lock made them one at a time: each call held it from its journal write to its
result, so two tasks' tools never ran together (Pydantic AI's parallel tools took the sum of
their times), and a tool waiting for another tool of the same run waited for ever. Now only the
journal writes are one at a time (the journal lock); the bodies run at once, each call replayed
by its scope and index. Every wait in these tools is bounded (``WAIT``) and answers whether it
saw what it waited for, so on the call lock each test failed instead of hanging: the first tool
never saw the second start (its wait ran out, then the second ran alone).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from buzz_delivery.agents.compensations import compensation
from buzz_delivery.agents.exceptions import BudgetExhausted, RunAborted
from buzz_delivery.agents.integrations.pydantic_ai import DurableAgent
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import NOT_MADE
from buzz_delivery.agents.services import cancel_agent_run, reap_agent_runs
from buzz_delivery.workflows.services import decide_approval
from tests.agents_support import backdate_run_lease, make_claimable, new_run
from tests.aio_worker_support import run_in_thread
from tests.test_agents_aio import in_process

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 10.0  # bound of each wait for the other tool (never reached when the calls run at once)

SEEN: dict = {}


def _entries(run_id):
    return [
        (e.seq, e.scope, e.replay_key[1], e.tool_name, e.status)
        for e in JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    ]


async def _saw(event: asyncio.Event) -> bool:
    try:
        await asyncio.wait_for(event.wait(), WAIT)
    except TimeoutError:
        return False
    return True


# -- two calls of one run in flight at once ---------------------------------------------------


async def two_at_once(ctx):
    """Tasks ``a`` and ``b``, each in a scope of its own: each tool says it started, then waits
    for the other's to have started too (both bodies running at the same time)."""
    started = {"a": asyncio.Event(), "b": asyncio.Event()}

    async def meet(args, key):
        me, other = args["me"], args["other"]
        started[me].set()
        seen = await _saw(started[other])
        return {"me": me, "saw_other": seen, "key": key}

    async def branch(me, other):
        with ctx.scope(me):
            return await ctx.call("meet", meet, {"me": me, "other": other})

    a, b = await asyncio.gather(branch("a", "b"), branch("b", "a"))
    return {"a": a, "b": b}


def test_two_calls_of_one_run_are_in_flight_at_once(community):
    run_id = new_run(community.id)
    _, counts = in_process(community, two_at_once, in_flight=4, connections=2)
    run = AgentRun.objects.get(id=run_id)
    assert counts.get("completed") == 1, (counts, run.failure_code, run.failure_message)
    out = run.output
    assert (out["a"]["saw_other"], out["b"]["saw_other"]) == (True, True), out  # each body saw the other's start
    assert sorted((scope, index, status) for _, scope, index, _, status in _entries(run_id)) == [
        ("a", 1, "succeeded"),
        ("b", 1, "succeeded"),
    ]
    assert [seq for seq, *_ in _entries(run_id)] == [1, 2]  # seq contiguous


# -- replay after a reclaim: each call served from its scope ----------------------------------


async def lost_mid_calls_then_replayed(ctx):
    """First invocation (``SEEN["phase"] == 1``): ``a`` and ``b`` both in flight when the run is
    lost (both stay pending). After the reclaim, ``b`` calls first, then ``a`` (the other order):
    each is reconciled from its own scope's entry (``a``'s hook: not made, made again with its
    key; ``b``'s: found)."""
    started = {"a": asyncio.Event(), "b": asyncio.Event()}
    b_done = asyncio.Event()

    async def work(args, key):
        me = args["me"]
        SEEN.setdefault("made", []).append((me, key))
        if SEEN["phase"] == 1:
            started[me].set()
            both = await _saw(started["b" if me == "a" else "a"])
            SEEN.setdefault("both", []).append(both)
            ctx.mark_lost("test_reclaim")  # the holder is lost while both calls are in flight
            raise RunAborted("lost mid-call")
        return {"me": me, "key": key, "made_again": True}

    async def reconcile(args, key):
        SEEN.setdefault("reconciled", []).append((args["me"], key))
        return NOT_MADE if args["me"] == "a" else {"me": "b", "key": key, "found": True}

    async def branch(me):
        if SEEN["phase"] == 2 and me == "a":
            await _saw(b_done)  # the other order than the first invocation's journal
        with ctx.scope(me):
            try:
                return await ctx.call("work", work, {"me": me}, reconcile=reconcile)
            finally:
                if me == "b":
                    b_done.set()

    results = await asyncio.gather(branch("a"), branch("b"), return_exceptions=True)
    if SEEN["phase"] == 1:
        raise RunAborted("the run was lost")
    return {"a": results[0], "b": results[1]}


def test_a_run_lost_with_two_calls_in_flight_replays_each_from_its_scope_after_a_reclaim(community):
    SEEN.clear()
    SEEN["phase"] = 1
    run_id = new_run(community.id)
    _, counts = in_process(community, lost_mid_calls_then_replayed, in_flight=4, connections=2)
    assert counts.get("lost") == 1, counts
    assert SEEN["both"] == [True, True]  # both were in flight at once when the run was lost
    pending = {scope: (seq, status) for seq, scope, _, _, status in _entries(run_id)}
    assert {scope: status for scope, (_, status) in pending.items()} == {"a": "pending", "b": "pending"}

    backdate_run_lease(run_id)  # time passing for the lost holder: reclaimed, claimable again
    assert reap_agent_runs().reclaimed == 1
    make_claimable(run_id)
    SEEN.update(phase=2, made=[], reconciled=[])
    _, counts = in_process(community, lost_mid_calls_then_replayed, in_flight=4, connections=2)
    run = AgentRun.objects.get(id=run_id)
    assert counts.get("completed") == 1, (counts, run.failure_code, run.failure_message)
    key_a, key_b = f"{run_id}:{pending['a'][0]}", f"{run_id}:{pending['b'][0]}"
    assert SEEN["reconciled"] == [("b", key_b), ("a", key_a)]  # b first this time, each its own entry
    assert SEEN["made"] == [("a", key_a)]  # a made again with its key, b found
    assert run.output == {
        "a": {"me": "a", "key": key_a, "made_again": True},
        "b": {"me": "b", "key": key_b, "found": True},
    }
    assert len(_entries(run_id)) == 2  # nothing journaled twice
    assert {scope: status for _, scope, _, _, status in _entries(run_id)} == {"a": "succeeded", "b": "succeeded"}


# -- a Pydantic AI tool waiting for another tool of the same run -------------------------------


def _waiting_tools_agent() -> DurableAgent:
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not any(m.kind == "response" for m in messages):
            return ModelResponse(
                parts=[ToolCallPart("waiter", {}, tool_call_id="w"), ToolCallPart("setter", {}, tool_call_id="s")]
            )
        returns = [p.content for m in messages if m.kind == "request" for p in m.parts if p.part_kind == "tool-return"]
        return ModelResponse(parts=[TextPart(" ".join(sorted(map(str, returns))))])

    agent = Agent(FunctionModel(model, model_name="waiting"))
    ready = {}

    def event() -> asyncio.Event:  # one per run, made on the worker's loop
        return ready.setdefault("set", asyncio.Event())

    @agent.tool_plain
    async def waiter() -> str:
        return "waited" if await _saw(event()) else "gave up"

    @agent.tool_plain
    async def setter() -> str:
        event().set()
        return "set"

    return DurableAgent(agent)


def test_a_pydantic_ai_tool_waiting_for_another_tool_of_its_run_completes(community):
    run_id = new_run(community.id)
    durable = _waiting_tools_agent()

    async def handler(ctx):
        return await durable.run(ctx)

    _, counts = in_process(community, handler, in_flight=4, connections=2)
    run = AgentRun.objects.get(id=run_id)
    assert counts.get("completed") == 1, (counts, run.failure_code, run.failure_message)
    assert run.output == "set waited"  # the waiter saw the setter run (not its bound)
    statuses = {e.scope: e.status for e in JournalEntry.objects.filter(run_id=run_id) if e.scope}
    assert statuses == {"tool:w": "succeeded", "tool:s": "succeeded"}


# -- the handler raising while a call of one of its tasks is in flight -------------------------


async def raises_while_its_task_calls(ctx):
    """Task ``x``'s tool waits for task ``y``'s tool to run; the handler raises once ``x``'s
    call is in flight. The run fails only once both calls are recorded."""
    x_started, y_ran = asyncio.Event(), asyncio.Event()

    async def x_tool(args, key):
        x_started.set()
        SEEN["x_saw_y"] = await _saw(y_ran)
        return {"x": SEEN["x_saw_y"]}

    async def y_tool(args, key):
        await _saw(x_started)
        y_ran.set()
        return {"y": True}

    async def in_scope(name, tool):
        with ctx.scope(name):
            return await ctx.call(name, tool, {})

    ctx.background = [asyncio.ensure_future(in_scope("x", x_tool)), asyncio.ensure_future(in_scope("y", y_tool))]
    await _saw(x_started)
    raise RuntimeError("the handler gives up")


def test_a_handler_raising_while_its_tasks_calls_are_in_flight_fails_the_run_with_both_recorded(community):
    SEEN.clear()
    run_id = new_run(community.id)
    counts = run_in_thread(community, raises_while_its_task_calls)
    run = AgentRun.objects.get(id=run_id)
    assert counts.get("failed") == 1, counts
    assert (run.state, run.failure_code) == ("failed", "handler_error"), run.failure_message
    assert SEEN["x_saw_y"] is True  # y's call ran while x's was in flight
    assert {scope: status for _, scope, _, _, status in _entries(run_id)} == {"x": "succeeded", "y": "succeeded"}


# -- a cancel with two calls in flight ---------------------------------------------------------

CANCEL: dict = {}


async def two_calls_left_in_flight(ctx):
    """Two tasks the handler starts and never awaits, each a call whose tool runs until
    cancelled (bounded); the handler itself waits for nothing that comes."""

    async def long(args, key):
        CANCEL["started"].add(args["me"])
        if len(CANCEL["started"]) == 2:
            CANCEL["both"].set()
        try:
            await asyncio.sleep(WAIT * 3)
        except asyncio.CancelledError:
            CANCEL["cancelled"].add(args["me"])
            raise
        CANCEL["finished"].add(args["me"])
        return {"me": args["me"]}

    async def in_scope(me):
        with ctx.scope(me):
            return await ctx.call("long", long, {"me": me})

    ctx.background = [asyncio.ensure_future(in_scope("a")), asyncio.ensure_future(in_scope("b"))]
    try:
        await asyncio.sleep(WAIT * 3)
    except asyncio.CancelledError:  # the cancel: the calls' tasks are cancelled with this one
        CANCEL["calls_cancelled_too"] = [task.cancelling() > 0 or task.cancelled() for task in ctx.background]
        raise
    return {"never": True}


def test_a_cancel_cancels_each_call_in_flight(community):
    CANCEL.update(started=set(), cancelled=set(), finished=set(), both=threading.Event())
    run_id = new_run(community.id)

    def cancel_once_both_run():
        assert CANCEL["both"].wait(WAIT), CANCEL["started"]  # two calls of the run in flight at once
        assert type(cancel_agent_run(community.id, run_id, reason="stop")).__name__ == "Cancelled"

    counts = run_in_thread(community, two_calls_left_in_flight, meanwhile=cancel_once_both_run)
    deadline = time.monotonic() + WAIT
    while CANCEL["cancelled"] != {"a", "b"} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert CANCEL["calls_cancelled_too"] == [True, True]  # by the cancel, not at the worker's exit
    assert (CANCEL["cancelled"], CANCEL["finished"]) == ({"a", "b"}, set())
    assert counts.get("lost") == 1, counts
    assert AgentRun.objects.get(id=run_id).state == "cancelled"


# -- a Pydantic AI tool raising while another tool of the run is in flight ---------------------


def _raising_tools_agent(made: list) -> DurableAgent:
    """``slow`` and ``boom`` of one response: ``boom`` raises once ``slow`` runs (both in flight
    at once); ``slow`` ends a moment later (or says it was cancelled, if it was)."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not any(m.kind == "response" for m in messages):
            return ModelResponse(
                parts=[ToolCallPart("slow", {}, tool_call_id="s"), ToolCallPart("boom", {}, tool_call_id="b")]
            )
        return ModelResponse(parts=[TextPart("never")])

    agent = Agent(FunctionModel(model, model_name="raising"))
    started: dict = {}

    def event() -> asyncio.Event:
        return started.setdefault("slow", asyncio.Event())

    @agent.tool_plain
    async def slow() -> str:
        event().set()
        try:
            await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            made.append("slow cancelled")
            raise
        made.append("slow")
        return "slow"

    @agent.tool_plain
    async def boom() -> str:
        made.append("boom saw slow" if await _saw(event()) else "boom alone")
        raise RuntimeError("boom")

    return DurableAgent(agent)


def test_a_pydantic_ai_tool_raising_while_another_runs_fails_the_run_with_none_left_pending(community):
    run_id = new_run(community.id)
    made: list = []
    durable = _raising_tools_agent(made)

    async def handler(ctx):
        return await durable.run(ctx)

    _, counts = in_process(community, handler, in_flight=4, connections=2)
    run = AgentRun.objects.get(id=run_id)
    assert (counts.get("failed"), run.failure_code) == (1, "tool_call_failed"), (counts, run.failure_message)
    # Pydantic AI cancelled slow's task once boom raised; the cancel came from the handler's own
    # code, not the worker, so slow's body ran to its end and was recorded before the run failed
    # (as the thread worker lets a sibling tool end): its effect is known, never compensated
    # before it was made; none is left pending.
    assert made == ["boom saw slow", "slow"]  # both in flight at once; slow not cut short
    entries = {e.scope: (e.status, e.uncertain) for e in JournalEntry.objects.filter(run_id=run_id) if e.scope}
    assert entries == {"tool:s": ("succeeded", False), "tool:b": ("failed", False)}


# -- an approval asked while another task's call is in flight ----------------------------------


async def approval_while_a_call_runs(ctx):
    """Task ``slow``'s call is in flight when the handler asks for an approval: the approval
    waits for it to be recorded, then parks (a run never parks with a call of its own in flight)."""
    started = asyncio.Event()

    async def slow(args, key):
        started.set()
        await asyncio.sleep(0.3)
        return {"slow": True}

    async def in_scope():
        with ctx.scope("slow"):
            return await ctx.call("slow", slow, {})

    task = asyncio.ensure_future(in_scope())
    waiting = asyncio.ensure_future(started.wait())
    await asyncio.wait([task, waiting], return_when=asyncio.FIRST_COMPLETED)  # replayed: never started
    waiting.cancel()
    decision = await ctx.request_approval("ship?", 600)
    return {"slow": await task, "decision": decision["decision"]}


def test_an_approval_asked_while_a_call_is_in_flight_parks_once_it_is_recorded(community):
    run_id = new_run(community.id)
    _, counts = in_process(community, approval_while_a_call_runs, in_flight=4, connections=2)
    assert counts.get("parked") == 1, (counts, AgentRun.objects.get(id=run_id).failure_message)
    assert [(seq, scope, status) for seq, scope, _, _, status in _entries(run_id)] == [
        (1, "slow", "succeeded"),
        (2, "", "pending"),
    ]
    run = AgentRun.objects.get(id=run_id)
    decide_approval(community.id, run.approval_id, "approved", "alice")
    _, counts = in_process(community, approval_while_a_call_runs, in_flight=4, connections=2)
    run = AgentRun.objects.get(id=run_id)
    assert counts.get("completed") == 1, (counts, run.failure_code, run.failure_message)
    assert run.output == {"slow": {"slow": True}, "decision": "approved"}


# -- an OpenAI Agents SDK agent: one response's function calls in flight at once ---------------


class Meetings:
    """An OpenAI Agents SDK agent (a fake ``Model``) whose first response asks for ``meet(me)``
    twice (calls ``call-a`` and ``call-b``), then answers with the results as JSON. The calls are
    handed to the journal in ``order`` (a tool input guardrail, the agent's own code, waits for
    its call's turn: given once the call before it was handed over); each body says it started,
    then waits for the other's to have started too. ``lose`` names a call whose body, once the
    other call is recorded, makes its effect and then loses the run (its entry stays pending).
    ``found``: the effects the reconcile hook finds (a call lost after its effect)."""

    def __init__(self, order, lose=None, found=None):
        self.order, self.lose, self.found = order, lose, dict(found or {})
        self.made: list[tuple[str, str]] = []  # (me, key): each body run
        self.reconciled: list[tuple[str, str]] = []
        self.journaled: list[str] = []  # the order the calls were handed to the journal
        self.events: dict[str, asyncio.Event] = {}  # made on the worker's loop, when first asked

    def event(self, name):
        if name not in self.events:
            self.events[name] = asyncio.Event()
            if name == f"turn:{self.order[0]}":
                self.events[name].set()
        return self.events[name]

    def durable(self):
        from agents import Agent, ToolGuardrailFunctionOutput, function_tool, tool_input_guardrail
        from agents.testing import assistant_message, function_call

        from buzz_delivery.agents.integrations.openai_agents import DurableAgent, idempotency_key
        from tests import openai_agents_handlers as oh

        test = self

        def answer(input):
            done = oh.returns(input)
            if not done:
                return oh.response(*(function_call("meet", {"me": me}, call_id=f"call-{me}") for me in "ab"))
            return oh.response(assistant_message(json.dumps(sorted(done, key=lambda r: r["me"]), sort_keys=True)))

        @tool_input_guardrail
        async def in_turn(data):
            await _saw(test.event(f"turn:{json.loads(data.context.tool_arguments)['me']}"))
            return ToolGuardrailFunctionOutput.allow()

        @function_tool(tool_input_guardrails=[in_turn], failure_error_function=None)
        async def meet(me: str) -> dict:
            other = "b" if me == "a" else "a"
            test.made.append((me, idempotency_key()))
            test.event(f"started:{me}").set()
            seen = await _saw(test.event(f"started:{other}"))
            if me == test.lose:
                await _saw(test.event(f"recorded:{other}"))
                test.found[me] = {"me": me, "saw_other": seen, "found": True}  # its effect, made
                test.ctx.mark_lost("test_reclaim")  # the holder is lost mid-call
                raise RunAborted("lost mid-call")
            return {"me": me, "saw_other": seen, "key": idempotency_key()}

        def reconcile(args, key):
            test.reconciled.append((args["me"], key))
            found = test.found.get(args["me"])
            return NOT_MADE if found is None else {**found, "key": key}

        agent = Agent(name="meetings", model=oh.FakeModel("meetings", answer), tools=[meet])
        return DurableAgent(agent, run_config=oh.NO_TRACING, reconcile={"meet": reconcile})

    def handler(self):
        durable, test = self.durable(), self

        class Ctx:
            """The event-loop runtime's context, telling the test when each call is handed to
            the journal (the next one's turn) and recorded."""

            def __init__(self, ctx):
                self._ctx = ctx

            def __getattr__(self, name):
                return getattr(self._ctx, name)

            async def call(self, tool_name, fn, args, **options):
                if tool_name != "meet":
                    return await self._ctx.call(tool_name, fn, args, **options)
                me = args["me"]
                test.journaled.append(me)
                following = test.order.index(me) + 1
                if following < len(test.order):
                    test.event(f"turn:{test.order[following]}").set()
                output = await self._ctx.call(tool_name, fn, args, **options)
                test.event(f"recorded:{me}").set()
                return output

        async def handler(ctx):
            test.ctx = ctx
            return await durable.run(Ctx(ctx))

        return handler


def _meetings(run_id):
    return {
        e.scope: (e.seq, e.replay_key[1], e.status)
        for e in JournalEntry.objects.filter(run_id=run_id, tool_name="meet")
    }


def test_an_openai_agents_response_s_function_calls_are_in_flight_at_once_under_the_event_loop_worker(community):
    run_id = new_run(community.id)
    test = Meetings(order=["a", "b"])
    _, counts = in_process(community, test.handler(), in_flight=4, connections=2)
    run = AgentRun.objects.get(id=run_id)
    assert counts.get("completed") == 1, (counts, run.failure_code, run.failure_message)
    meetings = _meetings(run_id)
    assert {scope: rest[1:] for scope, rest in meetings.items()} == {
        "tool:call-a": (1, "succeeded"),
        "tool:call-b": (1, "succeeded"),
    }
    keys = {me: f"{run_id}:{meetings[f'tool:call-{me}'][0]}" for me in "ab"}
    assert json.loads(run.output) == [
        {"me": me, "saw_other": True, "key": keys[me]} for me in "ab"
    ]  # each saw the other
    assert sorted(test.made) == [(me, keys[me]) for me in "ab"]
    assert [e[0] for e in _entries(run_id)] == [1, 2, 3, 4]  # model, two calls, model: seq contiguous


def test_an_openai_agents_run_lost_mid_call_under_the_event_loop_worker_replays_each_call_from_its_scope(community):
    """The run is lost with ``call-a`` recorded and ``call-b`` pending (its effect made). After
    the reclaim the calls reach the journal in the other order (``b`` first): ``a`` is replayed
    from its own scope's entry, ``b`` is reconciled with its own key and found; no body runs twice."""
    run_id = new_run(community.id)
    first = Meetings(order=["a", "b"], lose="b")
    _, counts = in_process(community, first.handler(), in_flight=4, connections=2)
    assert counts.get("lost") == 1, (counts, AgentRun.objects.get(id=run_id).failure_message)
    assert first.journaled == ["a", "b"]
    meetings = _meetings(run_id)
    assert {scope: rest[1:] for scope, rest in meetings.items()} == {
        "tool:call-a": (1, "succeeded"),
        "tool:call-b": (1, "pending"),
    }
    keys = {me: f"{run_id}:{meetings[f'tool:call-{me}'][0]}" for me in "ab"}
    assert sorted(first.made) == [(me, keys[me]) for me in "ab"]  # both bodies ran, at once (each saw the other)
    assert first.found == {"b": {"me": "b", "saw_other": True, "found": True}}

    backdate_run_lease(run_id)  # time passing for the lost holder: reclaimed, claimable again
    assert reap_agent_runs().reclaimed == 1
    make_claimable(run_id)
    again = Meetings(order=["b", "a"], found=first.found)
    _, counts = in_process(community, again.handler(), in_flight=4, connections=2)
    run = AgentRun.objects.get(id=run_id)
    assert counts.get("completed") == 1, (counts, run.failure_code, run.failure_message)
    assert again.journaled == ["b", "a"]  # the other order than the first invocation's journal
    assert again.made == []  # no body run twice: a replayed, b found
    assert again.reconciled == [("b", keys["b"])]  # b's own entry, with its own key
    assert json.loads(run.output) == [
        {"me": "a", "saw_other": True, "key": keys["a"]},
        {"me": "b", "saw_other": True, "found": True, "key": keys["b"]},
    ]
    assert {scope: status for _, scope, _, _, status in _entries(run_id) if scope} == {
        "tool:call-a": "succeeded",
        "tool:call-b": "succeeded",
    }
    assert len(_entries(run_id)) == 4  # model, two calls, model: nothing journaled twice


# -- a plain tool's thread outliving its cancelled task (review12) ------------------------------

OUTLIVE: dict = {}


@compensation(name="tests.aio_parallel.undo_slow")
def undo_slow(args, output, key):
    OUTLIVE["events"].append("undone")
    OUTLIVE["undone"].set()


async def sibling_fails_while_a_plain_tool_runs(ctx):
    """A TaskGroup: ``slow`` (a plain function, on a thread) is in flight when ``boom`` raises;
    the group cancels slow's task, but its thread runs on. slow waits (bounded) to see whether
    its compensation ran before its own effect."""

    def slow(args, key):
        OUTLIVE["started"].set()
        saw_undo = OUTLIVE["undone"].wait(2.0)  # bounded: the effect comes after it either way
        OUTLIVE["events"].append(("made", saw_undo))
        return {"slow": True}

    async def boom(args, key):
        await asyncio.to_thread(OUTLIVE["started"].wait, WAIT)
        raise RuntimeError("boom")

    async def in_scope(name, tool, **kwargs):
        with ctx.scope(name):
            return await ctx.call(name, tool, {}, **kwargs)

    async with asyncio.TaskGroup() as group:
        group.create_task(in_scope("slow", slow, compensate=undo_slow))
        group.create_task(in_scope("boom", boom))


def test_a_plain_tool_whose_task_is_cancelled_is_undone_only_after_its_thread_ends(community):
    """Its task cancelled by a sibling's failure, a plain tool's thread runs on: the call stays in
    flight until that thread ends, so the run's failure (closing it uncertain) and its compensation
    come after the tool's effect, not before it. (Before, the call landed at the cancel: the
    run failed and undid the call while its thread still ran, and the effect came after.)"""
    OUTLIVE.update(events=[], started=threading.Event(), undone=threading.Event())
    run_id = new_run(community.id)
    _, counts = in_process(community, sibling_fails_while_a_plain_tool_runs, in_flight=4, connections=2)
    run = AgentRun.objects.get(id=run_id)
    assert run.state in ("failed", "compensated"), (counts, run.state, run.failure_code, run.failure_message)
    assert OUTLIVE["events"] == [("made", False), "undone"], OUTLIVE["events"]


# -- a task calling on after the handler raised: the failure and that call (review12) ----------

RACE: dict = {}


@compensation(name="tests.aio_parallel.undo_b2")
async def undo_b2(args, output, key):
    RACE["events"].append("undone b2")
    RACE["undone"].set()


async def raises_while_a_task_calls_on(ctx):
    """Task ``b`` calls ``b1`` then ``b2`` (compensable); the handler raises (``a`` failed) while
    ``b1`` is in flight. The run's failure waits for ``b1``; ``b2`` must then not be journaled
    and made around the failure (closed uncertain and undone while its tool runs)."""
    b1_started, a_failed = asyncio.Event(), asyncio.Event()

    async def a_tool(args, key):
        await _saw(b1_started)
        raise ValueError("a fails")

    async def b1(args, key):
        b1_started.set()
        await _saw(a_failed)
        return "b1"

    async def b2(args, key):
        saw_undo = await _saw_within(RACE["undone"], 2.0)
        RACE["events"].append(("made b2", saw_undo))
        return "b2"

    async def branch_b():
        with ctx.scope("b"):
            await ctx.call("b1", b1, {})
            await ctx.call("b2", b2, {}, compensate=undo_b2)

    ctx.background = [asyncio.ensure_future(branch_b())]
    try:
        with ctx.scope("a"):
            await ctx.call("a", a_tool, {})
    finally:
        a_failed.set()


async def _saw_within(event: asyncio.Event, seconds: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        return False
    return True


def test_a_call_journaled_as_the_run_fails_is_not_undone_before_it_is_made(community):
    RACE.update(events=[], undone=asyncio.Event())
    run_id = new_run(community.id)
    _, counts = in_process(community, raises_while_a_task_calls_on, in_flight=4, connections=1)
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == ("failed", "tool_call_failed"), (counts, run.failure_message)
    # b2 is journaled before the failure (then waited for: made, recorded, then undone with the
    # run) or refused after it (never made, nothing to undo). Before, it was journaled as the run
    # failed: closed uncertain and undone by the failure, then made (it saw its own undo).
    entries = sorted((index, status) for _, scope, index, _, status in _entries(run_id) if scope == "b")
    if RACE["events"]:
        assert RACE["events"] == [("made b2", False), "undone b2"], RACE["events"]
        assert entries == [(1, "succeeded"), (2, "succeeded")]
    else:
        assert entries == [(1, "succeeded")]


# -- a task that calls on and on: the run still completes, fails or parks (review12) -----------

POLL: dict = {}
POLL_BUDGET = 200


async def polls_on_while_it_ends(ctx):
    """Task ``poller`` calls a quick tool again and again (until refused, or its budget spent);
    once it called, the handler completes (or asks for an approval, or raises)."""
    polled = asyncio.Event()

    async def poll(args, key):
        polled.set()
        return args["n"]

    async def poller():
        with ctx.scope("poller"):
            n = 0
            while True:
                n += 1
                try:
                    await ctx.call("poll", poll, {"n": n})
                except BudgetExhausted:
                    POLL["exhausted"] = True
                    return
                except RunAborted:  # refused: the run ended or parked
                    return

    ctx.background = [asyncio.ensure_future(poller())]
    await polled.wait()
    if POLL["end"] == "approval":
        await ctx.request_approval("ok?", 600)
    if POLL["end"] == "raise":
        raise RuntimeError("the handler gives up")
    return "done"


@pytest.mark.parametrize(
    ("end", "state"), [("complete", "completed"), ("raise", "failed"), ("approval", "waiting_approval")]
)
def test_a_task_calling_on_and_on_does_not_keep_the_run_from_its_end(community, end, state):
    """Waiting for the calls in flight outside the journal lock, the end (the completion, the
    failure, the approval's park) waited for ever: each gap between two of the poller's calls was
    taken by its next journal write. It now holds the lock while it waits: the poller's next call
    is refused after the end, long before the run's budget is spent."""
    POLL.clear()
    POLL["end"] = end
    run_id = new_run(community.id, max_tool_calls=POLL_BUDGET)
    counts = run_in_thread(community, polls_on_while_it_ends)
    run = AgentRun.objects.get(id=run_id)
    assert run.state == state, (counts, run.state, run.failure_code, run.failure_message)
    assert "exhausted" not in POLL, "the poller spent the run's budget before the run could end"
    polls = [status for _, scope, _, _, status in _entries(run_id) if scope == "poller"]
    assert 1 <= len(polls) < POLL_BUDGET and set(polls) == {"succeeded"}, polls


# -- the end waiting for a call whose tool waits for another task's call (review12) ------------

DEPEND: dict = {}


async def ends_while_a_tool_waits_for_another_task(ctx):
    """``waiter``'s tool waits for ``setter``'s tool to run; ``setter`` calls only once the
    handler ends (raises, or asks for an approval) with waiter's call in flight: the end waits for
    that call holding the journal lock, and setter's call waits for the lock. The end lets it in
    after a while (never a deadlock)."""
    waiter_started, setter_ran, ending = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def waiter(args, key):
        waiter_started.set()
        DEPEND["waiter_saw_setter"] = await _saw(setter_ran)
        return "waited"

    async def setter(args, key):
        setter_ran.set()
        return "set"

    async def in_scope(name, tool, before=None):
        if before is not None:
            await before.wait()
        with ctx.scope(name):
            return await ctx.call(name, tool, {})

    ctx.background = [
        asyncio.ensure_future(in_scope("waiter", waiter)),
        asyncio.ensure_future(in_scope("setter", setter, ending)),
    ]
    await waiter_started.wait()
    ending.set()
    if DEPEND["end"] == "approval":
        return await ctx.request_approval("ok?", 600)
    raise RuntimeError("the handler gives up")


@pytest.mark.parametrize(("end", "state"), [("raise", "failed"), ("approval", "waiting_approval")])
def test_the_end_waiting_for_a_tool_that_waits_for_another_tasks_call_is_no_deadlock(community, end, state):
    DEPEND.clear()
    DEPEND["end"] = end
    run_id = new_run(community.id)
    _, counts = in_process(community, ends_while_a_tool_waits_for_another_task, in_flight=4, connections=2)
    run = AgentRun.objects.get(id=run_id)
    assert run.state == state, (counts, run.state, run.failure_code, run.failure_message)
    assert DEPEND["waiter_saw_setter"] is True  # setter's call was let in while the end waited
    assert {scope: status for _, scope, _, _, status in _entries(run_id) if scope} == {
        "waiter": "succeeded",
        "setter": "succeeded",
    }


# -- a Pydantic AI plain tool cancelled by its sibling's failure (review12) ---------------------

PYD: dict = {}


@compensation(name="tests.aio_parallel.undo_plain_slow")
def undo_plain_slow(args, output, key):
    PYD["events"].append("undone")
    PYD["undone"].set()


def _plain_slow_agent() -> DurableAgent:
    """``slow`` (a plain function: Pydantic AI runs it on a thread) and ``boom`` of one response:
    boom raises once slow runs; Pydantic AI cancels slow's task, its thread runs on."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not any(m.kind == "response" for m in messages):
            return ModelResponse(
                parts=[ToolCallPart("slow", {}, tool_call_id="s"), ToolCallPart("boom", {}, tool_call_id="b")]
            )
        return ModelResponse(parts=[TextPart("never")])

    agent = Agent(FunctionModel(model, model_name="plain-slow"))

    @agent.tool_plain
    def slow() -> str:
        PYD["started"].set()
        saw_undo = PYD["undone"].wait(2.0)  # bounded: the effect comes after it either way
        PYD["events"].append(("made", saw_undo))
        return "slow"

    @agent.tool_plain
    async def boom() -> str:
        await asyncio.to_thread(PYD["started"].wait, WAIT)
        raise RuntimeError("boom")

    return DurableAgent(agent, compensations={"slow": undo_plain_slow})


def test_a_pydantic_ai_plain_tool_cancelled_by_a_sibling_is_undone_only_after_its_thread_ends(community):
    """Pydantic AI runs a plain tool on a thread of its own: cancelling its task does not stop
    it. The call stays in flight until that thread ends (the integration gives Pydantic AI the
    call's executor), so the run fails and undoes it after its effect. Before, the undo came
    first and the tool made its effect after it."""
    PYD.update(events=[], started=threading.Event(), undone=threading.Event())
    run_id = new_run(community.id)
    durable = _plain_slow_agent()

    async def handler(ctx):
        return await durable.run(ctx)

    _, counts = in_process(community, handler, in_flight=4, connections=2)
    run = AgentRun.objects.get(id=run_id)
    assert run.failure_code == "tool_call_failed", (counts, run.state, run.failure_message)
    assert PYD["events"] == [("made", False), "undone"], PYD["events"]


# -- a plain handler's call cancelled by a cancel of its run (review12) -------------------------

BRIDGE: dict = {}


def plain_handler_calls_then_is_cancelled(ctx):
    """A plain handler (SyncBridge): its call's async tool runs until the run is cancelled."""

    async def long(args, key):
        BRIDGE["started"].set()
        await asyncio.sleep(WAIT * 3)
        return "never"

    try:
        ctx.call("long", long, {})
    except BaseException as exc:
        BRIDGE["raised"] = type(exc).__name__
        BRIDGE["done"].set()
        raise
    return {"never": True}


def test_a_plain_handlers_call_cancelled_with_its_run_raises_run_aborted(community):
    """The cancel cancels the call's task; the handler's thread is told RunAborted, as the
    thread worker tells it, not concurrent.futures.CancelledError (an Exception a handler's
    ``except Exception`` took for a tool's failure)."""
    BRIDGE.update(started=threading.Event(), done=threading.Event())
    run_id = new_run(community.id)

    def cancel_once_it_calls():
        assert BRIDGE["started"].wait(WAIT)
        assert type(cancel_agent_run(community.id, run_id, reason="stop")).__name__ == "Cancelled"

    run_in_thread(community, plain_handler_calls_then_is_cancelled, meanwhile=cancel_once_it_calls)
    assert BRIDGE["done"].wait(WAIT)
    assert BRIDGE["raised"] == "RunAborted", BRIDGE["raised"]
