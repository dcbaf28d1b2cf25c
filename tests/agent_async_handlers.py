"""Async agent handlers and tools of the event-loop worker's tests (``run_agent_worker --async``
subprocesses or in-process). Side effects go to the ledger of :mod:`tests.agent_handlers`
(``AGENT_LEDGER``, append-only, survives a SIGKILL); ``AGENT_KILL`` kills the process as there.
``AGENT_CALL_SECONDS``: how long each sleepy call waits (default 0.2)."""

from __future__ import annotations

import asyncio
import os
import time

from buzz_delivery.agents.compensations import compensation
from buzz_delivery.agents.runtime import NOT_MADE
from tests.agent_handlers import _maybe_die, _write, ledger_lines


async def effect(args: dict, key: str) -> dict:
    """An async tool whose effect is a ledger line ``call <key>`` (idempotent by key); every
    invocation also writes ``made <key>``, so a test sees a call made twice."""
    n = args["n"]
    _maybe_die("inside_before_effect", n)
    await asyncio.sleep(float(os.environ.get("AGENT_CALL_SECONDS", "0.01")))
    _write(f"made {key}")
    if f"call {key}" not in ledger_lines():
        _write(f"call {key}")
    _maybe_die("inside_after_effect", n)
    return {"n": n}


async def reconcile(args: dict, key: str):
    """An async reconcile hook: did the call with this key happen?"""
    await asyncio.sleep(0)
    return {"n": args["n"]} if f"call {key}" in ledger_lines() else NOT_MADE


@compensation
async def async_undo(args: dict, output, key: str) -> None:
    """An async compensation: a ledger line ``undo <key>``, once per key."""
    await asyncio.sleep(0)
    if f"undo {key}" not in ledger_lines():
        _write(f"undo {key}")


async def three_calls(ctx):
    total = 0
    for n in (1, 2, 3):
        _maybe_die("before", n)
        total += (await ctx.call("effect", effect, {"n": n}, compensate=async_undo, reconcile=reconcile))["n"]
        _maybe_die("after", n)
    return {"sum": total, "agent": "async_three_calls"}


async def _sleep_call(args: dict, key: str) -> dict:
    await asyncio.sleep(float(os.environ.get("AGENT_CALL_SECONDS", "0.2")))
    return {"n": args["n"]}


async def three_sleepy_calls(ctx):
    """3 journaled calls that each await asyncio.sleep (no ledger: the connection-budget test).
    With ``AGENT_GATE`` (a path), the run first waits until that file exists, so a test can hold
    every run in flight at once whatever the machine's speed."""
    gate = os.environ.get("AGENT_GATE")
    while gate and not os.path.exists(gate):
        await asyncio.sleep(0.1)
    for n in (1, 2, 3):
        await ctx.call("sleep", _sleep_call, {"n": n})
    return {"ok": True}


async def until_cancelled(ctx):
    """A call every 50 ms, each a ledger line ``tick <run> <n>``, until stopped."""
    n = 0
    while True:
        n += 1
        await ctx.call("tick", _tick, {"run": str(ctx.lease.run_id), "n": n})
        await asyncio.sleep(0.05)


def _tick(args: dict, key: str) -> dict:
    _write(f"tick {args['run']} {args['n']}")
    return args


async def fails_then_compensates(ctx):
    for n in (1, 2):
        await ctx.call("effect", effect, {"n": n}, compensate=async_undo, reconcile=reconcile)
    raise RuntimeError("the model said no")


async def poison_or_calls(ctx):
    """A run whose input says ``poison`` raises SystemExit (and a plain one does in a thread
    when it says ``sync_poison``); the others make their 3 calls."""
    if ctx.input.get("poison"):
        raise SystemExit("a handler must not stop the worker")
    return await three_calls(ctx)


async def blocks_the_loop(ctx):
    """Calls blocking code without await (tests/test_loopwatch.py): the loop's watchdog names it."""
    time.sleep(1.5)
    return {"blocked": True}


async def quick(ctx):
    """Return at once (no call): the run completes."""
    return {"ok": True}


async def three_calls_then_fails(ctx):
    """Three journaled calls (each with its compensation), then the handler raises: the run
    unwinds the three, last first, and ends failed (the fail batch bench and tests)."""
    for n in (1, 2, 3):
        await ctx.call("effect", effect, {"n": n}, compensate=async_undo, reconcile=reconcile)
    raise RuntimeError("the model gave up")


# -- Text PostgreSQL cannot store, or too long (tests/test_agents_aio_unstorable_text.py): the run
# fails or its compensation fails, with the text made storable and cut, never the run's task.
HUGE = "u" * 20_000


@compensation
async def undo_raises_huge(args: dict, output, key: str) -> None:
    _write(f"undo-attempt {key}")
    raise RuntimeError(HUGE)


@compensation
async def undo_raises_nul(args: dict, output, key: str) -> None:
    _write(f"undo-attempt {key}")
    raise RuntimeError("before\x00after")


@compensation
def undo_exits(args: dict, output, key: str) -> None:
    """A plain compensation raising ``SystemExit`` on its thread (not an ``Exception``)."""
    _write(f"undo-attempt {key}")
    raise SystemExit("a compensation must not stop the worker")


async def _fine(args: dict, key: str) -> dict:
    return {"n": 1}


async def _raises(args: dict, key: str) -> dict:
    raise RuntimeError(args["text"].replace("NUL", "\x00"))  # (JSON args cannot carry a NUL)


class _BadCode(Exception):
    failure_code = "c" * 100


async def unstorable_texts(ctx):
    """``ctx.input["how"]``: ``undo_huge`` / ``undo_nul`` / ``undo_exits`` (one call with that
    compensation, then the handler raises), ``tool_huge`` / ``tool_nul`` (a call whose tool raises
    that text), ``raise_huge`` / ``raise_nul`` (the handler raises it), ``code`` (an AgentError
    whose failure_code is 100 characters with a NUL)."""
    from buzz_delivery.agents.exceptions import AgentError

    how = ctx.input["how"]
    undo = {"undo_huge": undo_raises_huge, "undo_nul": undo_raises_nul, "undo_exits": undo_exits}.get(how)
    if undo is not None:
        await ctx.call("effect", _fine, {"n": 1}, compensate=undo)
        raise RuntimeError("the model gave up")
    if how.startswith("tool_"):
        await ctx.call("t", _raises, {"text": HUGE if how == "tool_huge" else "aNULb"})
    if how == "raise_huge":
        raise RuntimeError(HUGE)
    if how == "raise_nul":
        raise RuntimeError("a\x00b")
    error = AgentError("bad code")
    error.failure_code = "c\x00" + "c" * 100
    raise error
