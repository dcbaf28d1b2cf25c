"""Replay by scope (agents migration 0022, docs/agents.md "Resume", "Parallel calls").

The journal was replayed by global position (call ``n`` of a resumed handler was entry ``n``),
so calls made at the same time had to be made one at a time (the Pydantic AI integration made
every tool ``sequential``) and calls a tool fanned out to threads of its own broke the replay
of the calls after it (the outer call replayed without running, its children's entries were met
by the next call: ``ReplayMismatch``). Now a call made in scope ``S`` is the ``k``-th call of
``S`` and is replayed from entry ``(S, k)``, whatever order the scopes' calls arrive in.

Each test failed before the change: the threads' calls replayed out of order met another
thread's entry (``ReplayMismatch``); the fan-out's next call met a child's entry
(``ReplayMismatch``); the Pydantic AI tools, made one at a time, waited for each other until
their bound (the first never saw the last start); ``ctx.scope``, ``scope=``/``index=`` did not
exist.
"""

from __future__ import annotations

import hashlib
import json
import threading

import pytest
from django.core.exceptions import ValidationError
from django.db import connections
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from buzz_delivery.agents.exceptions import ReplayMismatch, RunAborted
from buzz_delivery.agents.integrations.pydantic_ai import DurableAgent, idempotency_key
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import NOT_MADE, run_claim
from buzz_delivery.agents.services import (
    Journaled,
    Recorded,
    claim_agent_runs,
    journal_call,
    reap_agent_runs,
    record_call_result,
)
from buzz_delivery.workflows.services import decide_approval
from tests.agents_support import AGENT, backdate_run_lease, claim, make_claimable, new_run

WAIT = 30  # bound of every wait for another thread (never reached when the calls run at once)


def _claim(community, worker="w"):
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id=worker, lease_seconds=60)
    return claimed


def _entries(run_id):
    return [
        (e.seq, e.scope, e.replay_key[1], e.kind, e.tool_name, e.status)
        for e in JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    ]


def _reclaim(run_id):
    """Time passing for a lost holder: its lease lapses, the reaper reclaims, the backoff ends."""
    backdate_run_lease(run_id)
    assert reap_agent_runs().reclaimed == 1
    make_claimable(run_id)


def _approve(community, run_id):
    run = AgentRun.objects.get(id=run_id)
    assert run.state == "waiting_approval", (run.state, run.failure_code, run.failure_message)
    decide_approval(community.id, run.approval_id, "approved", "alice")


# -- threads, each in a scope of its own, arriving in another order on replay ----------------


class Ordered:
    """Makes threads ``w1..w3`` journal their calls in ``order`` (one thread's two calls, then
    the next thread's), so the journal's seq order is chosen by the test."""

    def __init__(self, order):
        self.order = order
        self.turn = {name: threading.Event() for name in order}
        self.made: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def tool(self, name):
        def fn(args, key):
            with self.lock:
                self.made.append((name, args["i"]))
            return {"thread": name, "i": args["i"], "key": key}

        return fn

    def handler(self, ctx):
        outputs: dict[str, object] = {}

        def worker(name):
            try:
                assert self.turn[name].wait(WAIT)
                with ctx.scope(name):
                    outputs[name] = [ctx.call(f"look-{name}", self.tool(name), {"i": i}) for i in (1, 2)]
            except BaseException as exc:
                outputs[name] = repr(exc)
            finally:
                following = self.order.index(name) + 1
                if following < len(self.order):
                    self.turn[self.order[following]].set()
                connections.close_all()

        threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in ("w1", "w2", "w3")]
        for t in threads:
            t.start()
        self.turn[self.order[0]].set()
        for t in threads:
            t.join(WAIT)
        for name, out in outputs.items():
            if isinstance(out, str):
                raise RuntimeError(f"{name}: {out}")
        decision = ctx.request_approval("ship?", 600)
        return {"outputs": outputs, "decision": decision["decision"]}


@pytest.mark.django_db(transaction=True)
def test_threads_in_scopes_replay_their_calls_whatever_order_they_arrive_in(community):
    run_id = new_run(community.id)
    first = Ordered(["w3", "w2", "w1"])
    assert run_claim(_claim(community), first.handler) == "parked"
    assert [name for name, _ in first.made] == ["w3", "w3", "w2", "w2", "w1", "w1"]
    assert [(seq, scope, index) for seq, scope, index, *_ in _entries(run_id)] == [
        (1, "w3", 1),
        (2, "w3", 2),
        (3, "w2", 1),
        (4, "w2", 2),
        (5, "w1", 1),
        (6, "w1", 2),
        (7, "", 1),
    ]
    _approve(community, run_id)

    again = Ordered(["w1", "w2", "w3"])  # the other way round: a positional replay mismatched
    assert run_claim(_claim(community, "w2"), again.handler) == "completed"
    assert again.made == []  # every call replayed, none made twice
    run = AgentRun.objects.get(id=run_id)
    assert run.output["decision"] == "approved"
    assert run.output["outputs"]["w1"] == [
        {"thread": "w1", "i": 1, "key": f"{run_id}:5"},
        {"thread": "w1", "i": 2, "key": f"{run_id}:6"},
    ]
    assert run.tool_calls_used == 7


# -- a tool that fans its calls out to threads, then an approval ------------------------------


def _fan_out_handler(made):
    def handler(ctx):
        def part(args, key):
            made.append(("part", args["n"]))
            return {"n": args["n"] * 10}

        def fan_out(args, key):
            made.append(("fan_out", 0))
            branches = {n: ctx.scope(f"part-{n}") for n in (1, 2)}  # created here: nested in this call
            results: dict[int, object] = {}

            def one(n):
                try:
                    with branches[n]:
                        results[n] = ctx.call("part", part, {"n": n})["n"]
                finally:
                    connections.close_all()

            threads = [threading.Thread(target=one, args=(n,)) for n in (1, 2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(WAIT)
            return {"parts": [results.get(1), results.get(2)]}

        fanned = ctx.call("fan_out", fan_out, {})
        decision = ctx.request_approval("ship?", 600)
        after = ctx.call("after", lambda a, k: made.append(("after", 0)) or {"ok": True}, {})
        return {"fanned": fanned, "decision": decision["decision"], "after": after}

    return handler


@pytest.mark.django_db(transaction=True)
def test_a_tools_fan_out_to_threads_in_scopes_does_not_break_the_replay_after_an_approval(community):
    run_id = new_run(community.id)
    made: list = []
    assert run_claim(_claim(community), _fan_out_handler(made)) == "parked"
    assert sorted(made) == [("fan_out", 0), ("part", 1), ("part", 2)]
    scopes = sorted((scope, index, tool) for _, scope, index, _, tool, _ in _entries(run_id))
    assert scopes == [("", 1, "fan_out"), ("", 2, "approval"), ("#1/part-1", 1, "part"), ("#1/part-2", 1, "part")]
    _approve(community, run_id)

    made.clear()
    outcome = run_claim(_claim(community, "w2"), _fan_out_handler(made))
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert made == [("after", 0)]  # the fan-out replayed (its children not made again)
    assert run.output == {"fanned": {"parts": [10, 20]}, "decision": "approved", "after": {"ok": True}}
    assert _entries(run_id)[-1][1:] == ("", 3, "tool", "after", "succeeded")


# -- a mismatch inside a scope still fails the replay ------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_call_that_differs_from_its_scopes_entry_fails_replay_mismatch(community):
    run_id = new_run(community.id)

    def handler_for(tool):
        def handler(ctx):
            with ctx.scope("s"):
                ctx.call("same", lambda a, k: {"ok": 1}, {})
                ctx.call(tool, lambda a, k: {"ok": 2}, {})
            return ctx.request_approval("ship?", 600)

        return handler

    assert run_claim(_claim(community), handler_for("first")) == "parked"
    _approve(community, run_id)
    assert run_claim(_claim(community, "w2"), handler_for("other")) == "failed"
    run = AgentRun.objects.get(id=run_id)
    assert run.failure_code == ReplayMismatch.failure_code
    assert "'first', now 'other'" in run.failure_message
    assert run.tool_calls_used == 3  # nothing journaled for the mismatched call


# -- journals written before scopes replay as before ------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_journal_written_before_scopes_replays_by_position(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    for n in (1, 2):  # the old form: no scope, no index (stored NULL: the entry's seq)
        journaled = journal_call(lease, "old", {"n": n})
        assert isinstance(journaled, Journaled)
        assert isinstance(record_call_result(lease, journaled.seq, ok=True, output={"n": n * 100}), Recorded)
    assert [(e.scope, e.scope_index, e.replay_key) for e in JournalEntry.objects.filter(run_id=run_id)] == [
        ("", None, ("", 1)),
        ("", None, ("", 2)),
    ]
    _reclaim(run_id)
    made = []

    def handler(ctx):
        outs = [ctx.call("old", lambda a, k: made.append(a) or {"n": -1}, {"n": n}) for n in (1, 2)]
        outs.append(ctx.call("new", lambda a, k: made.append(a) or {"n": 3}, {"n": 3}))
        return [o["n"] for o in outs]

    assert run_claim(_claim(community, "w2"), handler) == "completed"
    assert made == [{"n": 3}]
    assert AgentRun.objects.get(id=run_id).output == [100, 200, 3]
    assert _entries(run_id)[-1][:3] == (3, "", 3)


@pytest.mark.django_db(transaction=True)
def test_a_second_entry_at_the_same_scope_and_index_is_refused_and_spends_nothing(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    assert isinstance(journal_call(lease, "a", {}, scope="s", index=1), Journaled)
    with pytest.raises(ValidationError) as refused:  # by field, not a server error (the gateway's 400)
        journal_call(lease, "a", {}, scope="s", index=1)
    assert list(refused.value.message_dict) == ["index"]
    assert AgentRun.objects.get(id=run_id).tool_calls_used == 1
    with pytest.raises(Exception, match="index"):
        journal_call(lease, "a", {}, scope="s")  # a scope other than the root needs its index


# -- Pydantic AI: the model's parallel tool calls run at once ----------------------------------


class Cities:
    """Tools ``lookup(city)`` for one response's three calls: ``a`` waits until ``c`` started and
    ``b`` is done, ``b`` until ``c`` is done, so the calls end c, b, a (made one at a time, ``a`` never saw
    ``c`` start); ``lose_in`` names a city whose tool marks the run lost (its call stays
    pending, the run is reclaimed)."""

    def __init__(self, ctx_box, lose_in=None):
        self.started = {c: threading.Event() for c in "abc"}
        self.done = {c: threading.Event() for c in "abc"}
        self.made: list[str] = []
        self.ended: list[str] = []
        self.ctx_box, self.lose_in = ctx_box, lose_in

    def lookup(self, city: str) -> dict:
        self.made.append(city)
        self.started[city].set()
        if city == "a" and not self.started["c"].wait(WAIT):
            raise RuntimeError("c never started while a ran: the tools were made one at a time")
        if city == "a" and not self.done["b"].wait(WAIT):
            raise RuntimeError("b never ended while a ran")
        if city == "b" and not self.done["c"].wait(WAIT):
            raise RuntimeError("c never ended while b ran")
        if city == self.lose_in:
            self.lose_in = None
            self.ctx_box[0].mark_lost("test")  # the worker lost the run mid-call
            raise RunAborted("lost in the tool")
        self.ended.append(city)
        self.done[city].set()
        return {"city": city, "key": idempotency_key()}


def _cities_agent(cities: Cities, with_approval: bool) -> DurableAgent:
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        responses = sum(1 for m in messages if m.kind == "response")
        if responses == 0:
            return ModelResponse(parts=[ToolCallPart("lookup", {"city": c}, tool_call_id=f"call-{c}") for c in "abc"])
        if responses == 1 and with_approval:
            return ModelResponse(parts=[ToolCallPart("ship", {}, tool_call_id="call-ship")])
        returns = [p.content for m in messages if m.kind == "request" for p in m.parts if p.part_kind == "tool-return"]
        text = json.dumps(sorted(returns, key=lambda r: json.dumps(r, sort_keys=True)), sort_keys=True)
        return ModelResponse(parts=[TextPart(text)])

    agent = Agent(FunctionModel(model, model_name="cities"))
    agent.tool_plain(cities.lookup)

    @agent.tool_plain(requires_approval=True)
    def ship() -> str:
        return "shipped"

    def reconcile(args, key):
        return NOT_MADE  # the lost call never reached its effect

    return DurableAgent(agent, reconcile={"lookup": reconcile})


def _handler(durable, ctx_box):
    def handler(ctx):
        ctx_box[0] = ctx
        return durable(ctx)

    return handler


@pytest.mark.django_db(transaction=True)
def test_pydantic_ai_parallel_tool_calls_run_at_once_and_replay_after_an_approval(community):
    run_id = new_run(community.id)
    box: list = [None]
    first = Cities(box)
    assert run_claim(_claim(community), _handler(_cities_agent(first, True), box)) == "parked"
    assert first.ended == ["c", "b", "a"]
    lookups = [(scope, index, status) for _, scope, index, _, tool, status in _entries(run_id) if tool == "lookup"]
    assert sorted(lookups) == [(f"tool:call-{c}", 1, "succeeded") for c in "abc"]
    _approve(community, run_id)

    again = Cities(box)
    outcome = run_claim(_claim(community, "w2"), _handler(_cities_agent(again, True), box))
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert again.made == []  # no tool made twice: each replayed from its scope's entry
    keys = {e.scope: e.idempotency_key for e in JournalEntry.objects.filter(run_id=run_id, tool_name="lookup")}
    assert json.loads(run.output) == ["shipped"] + [{"city": c, "key": keys[f"tool:call-{c}"]} for c in "abc"]


@pytest.mark.django_db(transaction=True)
def test_pydantic_ai_parallel_tool_calls_resume_after_a_reclaim_mid_call(community):
    run_id = new_run(community.id)
    box: list = [None]
    first = Cities(box, lose_in="a")  # a is lost once b and c are done
    assert run_claim(_claim(community), _handler(_cities_agent(first, False), box)) == "lost"
    assert sorted(first.ended) == ["b", "c"]
    statuses = {e.scope: e.status for e in JournalEntry.objects.filter(run_id=run_id, tool_name="lookup")}
    assert statuses == {"tool:call-a": "pending", "tool:call-b": "succeeded", "tool:call-c": "succeeded"}
    _reclaim(run_id)

    again = Cities(box)
    for replayed in ("b", "c"):  # replayed, not made: a need not wait for them
        again.started[replayed].set()
        again.done[replayed].set()
    outcome = run_claim(_claim(community, "w2"), _handler(_cities_agent(again, False), box))
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert again.made == ["a"]  # only the call left pending is made (reconciled NOT_MADE), once
    keys = {e.scope: e.idempotency_key for e in JournalEntry.objects.filter(run_id=run_id, tool_name="lookup")}
    assert json.loads(run.output) == [{"city": c, "key": keys[f"tool:call-{c}"]} for c in "abc"]
    assert run.tool_calls_used == 5  # model, three lookups, model: nothing journaled twice


# -- the event-loop runtime: tasks in scopes ---------------------------------------------------

ASYNC_RUN: dict = {"order": [], "made": []}


async def async_tasks_in_scopes(ctx):
    """Tasks ``w1..w3`` each make two calls in a scope of its own, in ``ASYNC_RUN["order"]``."""
    import asyncio

    order = ASYNC_RUN["order"]
    turn = {name: asyncio.Event() for name in order}

    async def look(args, key):
        ASYNC_RUN["made"].append(args["name"])
        return {"name": args["name"], "i": args["i"], "key": key}

    async def worker(name):
        await turn[name].wait()
        try:
            with ctx.scope(name):
                return [await ctx.call(f"look-{name}", look, {"name": name, "i": i}) for i in (1, 2)]
        finally:
            following = order.index(name) + 1
            if following < len(order):
                turn[order[following]].set()

    tasks = [asyncio.create_task(worker(name)) for name in ("w1", "w2", "w3")]
    turn[order[0]].set()
    outputs = await asyncio.gather(*tasks)
    decision = await ctx.request_approval("ship?", 600)
    return {"outputs": outputs, "decision": decision["decision"]}


@pytest.mark.django_db(transaction=True)
def test_event_loop_tasks_in_scopes_replay_whatever_order_they_arrive_in(community):
    from tests.test_agents_aio import in_process

    run_id = new_run(community.id)
    ASYNC_RUN.update(order=["w3", "w2", "w1"], made=[])
    assert in_process(community, async_tasks_in_scopes, in_flight=4, connections=2)[1].get("parked") == 1
    assert ASYNC_RUN["made"] == ["w3", "w3", "w2", "w2", "w1", "w1"]
    assert [(seq, scope) for seq, scope, *_ in _entries(run_id)][:6] == [
        (1, "w3"), (2, "w3"), (3, "w2"), (4, "w2"), (5, "w1"), (6, "w1"),
    ]  # fmt: skip
    _approve(community, run_id)

    ASYNC_RUN.update(order=["w1", "w2", "w3"], made=[])
    counts = in_process(community, async_tasks_in_scopes, in_flight=4, connections=2)[1]
    run = AgentRun.objects.get(id=run_id)
    assert counts.get("completed") == 1, (counts, run.failure_code, run.failure_message)
    assert ASYNC_RUN["made"] == []
    assert run.output["outputs"][0] == [
        {"name": "w1", "i": 1, "key": f"{run_id}:5"},
        {"name": "w1", "i": 2, "key": f"{run_id}:6"},
    ]


# -- a parallel tool raising while another's body still runs -----------------------------------


class Raising:
    """Tools ``slow`` and ``boom`` of one response: ``boom`` raises once ``slow`` started; ``slow``
    ends only once the agent's run is over (Pydantic AI cancelled the task awaiting it), so its
    body is still running on the agent's loop when the agent ends."""

    def __init__(self):
        self.slow_started = threading.Event()
        self.agent_over = threading.Event()
        self.made: list[str] = []

    def durable(self) -> DurableAgent:
        import asyncio

        def model(messages, info):
            if not any(m.kind == "response" for m in messages):
                return ModelResponse(
                    parts=[ToolCallPart("slow", {}, tool_call_id="s"), ToolCallPart("boom", {}, tool_call_id="b")]
                )
            return ModelResponse(parts=[TextPart("never")])

        agent = Agent(FunctionModel(model, model_name="raising"))
        test = self

        @agent.tool_plain
        async def slow() -> str:
            test.slow_started.set()
            for _ in range(WAIT * 20):  # polls the state it waits for, bounded
                if test.agent_over.is_set():
                    break
                await asyncio.sleep(0.05)
            test.made.append("slow")
            return "slow"

        @agent.tool_plain
        async def boom() -> str:
            while not test.slow_started.is_set():
                await asyncio.sleep(0.01)
            test.made.append("boom")
            raise RuntimeError("boom")

        class Over(DurableAgent):
            async def run(self, ctx, journal=None):
                try:
                    return await super().run(ctx, journal)
                finally:
                    test.agent_over.set()

        return Over(agent)


@pytest.mark.django_db(transaction=True)
def test_a_parallel_tool_raising_while_another_runs_fails_the_run_with_both_recorded(community):
    """Failed before the fix: the agent's loop closed with ``slow``'s body still on it, and the
    handler's thread, serving that call, waited for its end forever (the run hung, its lease
    renewed by the heartbeat)."""
    run_id = new_run(community.id)
    raising = Raising()
    box: dict = {}

    def handler_thread():
        try:
            box["outcome"] = run_claim(_claim(community), raising.durable())
        finally:
            connections.close_all()

    thread = threading.Thread(target=handler_thread, daemon=True)
    thread.start()
    thread.join(WAIT * 2)
    assert not thread.is_alive(), "the handler's thread still waits for a call's body"
    run = AgentRun.objects.get(id=run_id)
    assert (box["outcome"], run.failure_code) == ("failed", "tool_call_failed"), run.failure_message
    assert sorted(raising.made) == ["boom", "slow"]
    statuses = {e.scope: e.status for e in JournalEntry.objects.filter(run_id=run_id) if e.scope}
    assert statuses == {"tool:s": "succeeded", "tool:b": "failed"}  # nothing left pending


# -- a nested call is known by any call of the thread, not only the innermost -----------------


@pytest.mark.django_db(transaction=True)
def test_a_call_in_the_scope_of_a_call_below_on_the_thread_is_nested(community):
    """The handler's thread serving call ``b`` (in a scope outside ``a``'s) from inside ``a``'s
    function, as the thread bridge serves parallel tool calls: a call asked in ``a``'s own scope
    then (``a``'s body asking one, re-entered by the bridge) is nested in ``a`` and refused, as it
    is when ``a`` is the innermost call. Failed before the fix: only the innermost call's scope
    was judged, so whether it was refused depended on which call the thread served."""
    from buzz_delivery import journal_scope
    from buzz_delivery.agents.exceptions import NestedCall

    new_run(community.id)
    seen: dict = {}

    def handler(ctx):
        b_scope = ctx.scope("b")
        a_scope: list[str] = []

        def inner(args, key):
            with journal_scope.entered(a_scope[0]):  # a's body asking (the bridge re-enters its scope)
                try:
                    ctx.call("nested", lambda a, k: 1, {})
                except NestedCall as exc:
                    seen["nested"] = exc.outer_seq
            return 2

        def a(args, key):
            a_scope.append(journal_scope.current())
            with b_scope:
                return ctx.call("b", inner, {})

        return ctx.call("a", a, {})

    assert run_claim(_claim(community), handler) == "completed"
    assert seen == {"nested": 2}  # refused, naming the innermost call (b, seq 2)


# -- a handler cannot name its scope as the runtimes name theirs -------------------------------


@pytest.mark.parametrize("name", ["#1", "tool:call_1", "a/b", "", " ", "x\x00"])
def test_a_scope_name_in_a_form_the_runtimes_reserve_is_refused(name):
    """``#<index>`` is a call's body and ``tool:<id>`` a Pydantic AI tool call: a handler's
    ``ctx.scope("#1")`` at the root would have shared root call 1's body's scope (and a name
    holding ``/`` could fake a nested path), so their calls would have met each other's entries."""
    from buzz_delivery import journal_scope
    from buzz_delivery.agents.aio_runtime import AsyncContext
    from buzz_delivery.agents.runtime import Context
    from buzz_delivery.gateway.remote_runs import RemoteRunContext

    for scoped in (Context.scope, AsyncContext.scope, RemoteRunContext.scope):
        with pytest.raises(journal_scope.ScopeError):
            scoped(name)


def test_a_tool_call_id_holding_the_separator_or_long_gets_a_scope_of_one_name():
    """Pydantic AI's ``tool_call_id`` and the OpenAI Agents SDK's ``call_id`` alike
    (``journal_scope.tool_call``, shared by both integrations)."""
    import hashlib

    from buzz_delivery import journal_scope

    scope = journal_scope.tool_call("call/1")
    assert scope == "tool:sha256:" + hashlib.sha256(b"call/1").hexdigest()
    assert journal_scope.tool_call("x" * 65) == "tool:sha256:" + hashlib.sha256(b"x" * 65).hexdigest()
    assert journal_scope.tool_call("x" * 64) == "tool:" + "x" * 64
    assert journal_scope.tool_call("call_1") == "tool:call_1"


# -- a scope path nested deeper than 200 characters is keyed by a stable hash ------------------


def _deep_handler(made, seen):
    """Three threads, each in a scope of 97 characters inside the one before (a path of 293
    characters), the innermost making a call, asking for an approval, making another."""

    def handler(ctx):
        box: dict = {}

        def deep(args, key):
            made.append(args["i"])
            return {"i": args["i"], "key": key}

        def level(depth, scope):
            try:
                with scope:  # created by the thread that started this one: nested in its scope
                    if depth < 3:
                        inner = threading.Thread(
                            target=level, args=(depth + 1, ctx.scope(f"level{depth + 1}-" + "x" * 90))
                        )
                        inner.start()
                        inner.join(WAIT)
                        return
                    from buzz_delivery import journal_scope

                    seen["path"] = journal_scope.current()
                    first = ctx.call("deep", deep, {"i": 1})
                    decision = ctx.request_approval("deep?", 600)
                    box["out"] = [first, decision["decision"], ctx.call("deep", deep, {"i": 2})]
            except BaseException as exc:
                box.setdefault("error", exc)
            finally:
                connections.close_all()

        outer = threading.Thread(target=level, args=(1, ctx.scope("level1-" + "x" * 90)))
        outer.start()
        outer.join(WAIT)
        if "error" in box:
            raise box["error"]  # the park (or a failure) the innermost thread met
        return box["out"]

    return handler


@pytest.mark.django_db(transaction=True)
def test_a_scope_path_longer_than_200_characters_is_keyed_by_its_hash_and_replays(community):
    """Failed before: a path longer than 200 characters raised ``ScopeError`` where the scope was
    entered (a Pydantic AI agent run in a tool of one run in a tool of one, with long tool call
    ids, failed its tool). A path of 200 characters or less is keyed by itself, as before."""
    import hashlib

    from buzz_delivery import journal_scope

    run_id = new_run(community.id)
    made: list = []
    seen: dict = {}
    assert run_claim(_claim(community), _deep_handler(made, seen)) == "parked"
    path = seen["path"]
    assert len(path) == 293 and made == [1]
    key = path[:128] + "~sha256:" + hashlib.sha256(path.encode()).hexdigest()
    assert len(key) == 200 and journal_scope.key(path) == key
    assert [(scope, index, tool) for _, scope, index, _, tool, _ in _entries(run_id)] == [
        (key, 1, "deep"),
        (key, 2, "approval"),
    ]
    _approve(community, run_id)

    made.clear()
    outcome = run_claim(_claim(community, "w2"), _deep_handler(made, seen))
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert made == [2]  # the first call replayed from its deep scope's entry, not made again
    assert run.output == [{"i": 1, "key": f"{run_id}:1"}, "approved", {"i": 2, "key": f"{run_id}:3"}]
    assert journal_scope.key("a" * 200) == "a" * 200  # a short path keys as it always did


class Diving:
    """A Pydantic AI agent whose tool ``dive`` runs the next depth's agent (``DurableAgent`` on
    the run's context, on a thread in ``ctx.scope("sub")``), three deep; tool call ids of 75
    characters (scopes ``tool:sha256:<hex>``), so the deepest calls' path passes 200 characters.
    ``lose``: the deepest tool marks the run lost (its call and those above it stay pending)."""

    def __init__(self, lose=False):
        self.lose = lose
        self.made: list[str] = []
        self.paths: list[str] = []
        self.ctx = None

    def durable(self, depth: int) -> DurableAgent:
        import asyncio

        from buzz_delivery import journal_scope

        def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            if not any(m.kind == "response" for m in messages):
                return ModelResponse(parts=[ToolCallPart("dive", {}, tool_call_id=f"call-{depth}-" + "y" * 68)])
            returns = [
                p.content for m in messages if m.kind == "request" for p in m.parts if p.part_kind == "tool-return"
            ]
            return ModelResponse(parts=[TextPart(json.dumps(returns))])

        agent = Agent(FunctionModel(model, model_name=f"depth{depth}"))
        test = self

        @agent.tool_plain
        async def dive() -> object:
            if depth == 3:
                test.paths.append(journal_scope.current())
                if test.lose:
                    test.lose = False
                    test.ctx.mark_lost("test")
                    raise RunAborted("lost in the deepest tool")
                test.made.append("effect")
                return {"depth": 3, "key": idempotency_key()}
            sub = test.ctx.scope("sub")  # created here: nested in this tool call's scope

            def inner():
                try:
                    with sub:
                        return test.durable(depth + 1)(test.ctx)
                finally:
                    connections.close_all()

            return await asyncio.to_thread(inner)

        return DurableAgent(agent, reconcile={"dive": lambda args, key: NOT_MADE})

    def handler(self, ctx):
        self.ctx = ctx
        return self.durable(1)(ctx)


@pytest.mark.django_db(transaction=True)
def test_a_pydantic_ai_agent_nested_three_tools_deep_journals_and_resumes_past_200_characters(community):
    """Failed before: the deepest tool call's scope passed 200 characters and its tool failed
    with ``ScopeError``; and an agent run by a tool on a thread of its own journaled in the
    root scope (its loop's thread did not carry the scope it was started in), among the outer
    agent's own calls."""

    run_id = new_run(community.id)
    first = Diving(lose=True)
    assert run_claim(_claim(community), first.handler) == "lost"
    (path,) = first.paths
    assert len(path) > 200 and first.made == []
    pending = [(e.tool_name, e.scope) for e in JournalEntry.objects.filter(run_id=run_id, status="pending")]
    assert [tool for tool, _ in pending] == ["dive"] * 3  # each depth's tool call, below the deepest
    top = "tool:sha256:" + hashlib.sha256(f"call-1-{'y' * 68}".encode()).hexdigest()
    # The deepest call's scope (its body's path less "/#1") passed 200 characters: its hashed key.
    deepest = pending[2][1]
    assert pending[0][1] == top and path == f"{deepest}/#1" and len(deepest) == 200 and "~sha256:" in deepest
    _reclaim(run_id)

    again = Diving()
    outcome = run_claim(_claim(community, "w2"), again.handler)
    run = AgentRun.objects.get(id=run_id)
    assert outcome == "completed", (run.failure_code, run.failure_message)
    assert again.made == ["effect"] and again.paths == [path]
    models = JournalEntry.objects.filter(run_id=run_id, tool_name__startswith="model:")
    assert sorted(models.values_list("tool_name", flat=True)) == [
        "model:depth1", "model:depth1", "model:depth2", "model:depth2", "model:depth3", "model:depth3",
    ]  # fmt: skip
    # each request made once: the first three replayed on the resume (their scopes' entries)
    assert run.tool_calls_used == 9
