"""The demo's remote agents, run by the gateway's remote worker (``python -m
buzz_delivery.gateway.client work-runs`` / ``work``): they know no database, only the gateway's
HTTP API. Their tools record each effect, with the idempotency key they were given, as one JSON
line in the file ``BUZZ_DEMO_EFFECTS`` names; the demo reads it back for its report."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

_lock = threading.Lock()


def _effect(key: str, kind: str, tool: str) -> None:
    line = json.dumps({"key": key, "kind": kind, "tool": tool, "pid": os.getpid()})
    with _lock, open(os.environ["BUZZ_DEMO_EFFECTS"], "a") as f:
        f.write(line + "\n")


def search_orders(args: dict[str, Any], key: str) -> dict[str, Any]:
    _effect(key, "call", "search_orders")
    return {"orders": 3, "customer": args["customer"]}


def send_summary(args: dict[str, Any], key: str) -> dict[str, Any]:
    _effect(key, "call", "send_summary")
    return {"sent": True}


def handle(ctx: Any) -> Any:
    """An agent run served through the gateway: two journaled tool calls. In the worker started
    with ``BUZZ_DEMO_REMOTE_HANG`` set, the run stops after its first call (recorded in the
    journal), holding its lease until the demo kills that worker with SIGKILL; the replacement
    worker resumes it: the first call's result comes from the journal, it is not made again."""
    found = ctx.call("search_orders", search_orders, {"customer": str(ctx.input.get("content", ""))[:40]})
    if os.environ.get("BUZZ_DEMO_REMOTE_HANG"):
        while True:  # its heartbeats keep the lease alive until the SIGKILL
            time.sleep(3600)
    ctx.call("send_summary", send_summary, {"orders": found["orders"]})
    return {"answered_remotely": True, "orders": found["orders"]}


def on_delivery(delivery: dict[str, Any]) -> None:
    """A plain delivery (``await: delivered``) worked through the gateway: returning finishes it."""
    _effect(f"delivery:{delivery.get('id') or delivery.get('delivery_id')}", "delivery", "courier")
