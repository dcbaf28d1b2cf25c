"""``async def`` function steps for tests/test_wf_async_steps.py, run by ``python -m
tests.wf_async_worker ARGS...`` (``manage.py run_workflow_worker`` with them registered)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from buzz_delivery.backoff import RetryAfter
from buzz_delivery.workflows.registry import PermanentStepFailure, workflow_function


@workflow_function("asteps.wait")
async def wait(input: dict, context: Any) -> dict:
    """Waits ``sleep`` seconds (an I/O wait); its output says when it started and ended (host
    clock, one machine) and on which attempt."""
    started = time.time()
    await asyncio.sleep(float(input.get("sleep", 0)))
    return {"started": started, "ended": time.time(), "attempt": context.attempt, "i": input.get("i")}


@workflow_function("asteps.hang_first")
async def hang_first(input: dict, context: Any) -> dict:
    """Hangs on its first attempt (the test kills the worker meanwhile), answers on the next."""
    if context.attempt == 1:
        await asyncio.sleep(600)
    return {"attempt": context.attempt, "at": time.time()}


@workflow_function("asteps.raise")
async def raises(input: dict, context: Any) -> Any:
    """Raises what ``input["what"]`` names, or returns what it cannot store."""
    await asyncio.sleep(0)
    what = input["what"]
    if what == "permanent":
        raise PermanentStepFailure("refused", failure_code="async_refused")
    if what == "ordinary":
        raise RuntimeError("async boom")
    if what == "retry_after":
        raise RetryAfter(3600)
    if what == "exit":
        raise SystemExit(3)
    if what == "cancelled":
        raise asyncio.CancelledError()
    if what == "not_json":
        return object()
    return {"ok": True}


@workflow_function("asteps.sync")
def plain(input: dict, context: Any) -> dict:
    """A plain step beside the async ones (on a step thread)."""
    time.sleep(float(input.get("sleep", 0)))
    return {"plain": True, "i": input.get("i")}


@workflow_function("asteps.blocks")
async def blocks(input: dict, context: Any) -> dict:
    """Calls blocking code without await (tests/test_loopwatch.py): the loop's watchdog names it."""
    time.sleep(1.5)
    return {"blocked": True}
