"""Handlers for ``run_delivery_worker`` in the benchmarks."""

from __future__ import annotations

from typing import Any


def noop(delivery: Any) -> None:
    """Do nothing: the delivery settles ``finished`` (measures the runtime, not the handler)."""
    return None


async def anoop(delivery: Any) -> None:
    """``noop`` as an ``async def`` handler: the worker awaits it on its event loop (as PgQueuer
    awaits its ``async def`` entrypoints)."""
    return None


def _noop_call(args: Any, key: str) -> Any:
    return {"ok": True}


def three_calls(ctx: Any) -> dict[str, bool]:
    """An agent run of three journaled no-op calls (``run_agent_worker`` and ``work-runs`` alike)."""
    for i in range(3):
        ctx.call("noop", _noop_call, {"i": i})
    return {"done": True}
