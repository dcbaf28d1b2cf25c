"""The demo's agents, run by ``run_agent_worker --handler project.demo.agent_handlers:handle``
(in-process agents) and by the remote worker. What an agent does depends on the message it was
sent (``ctx.input["content"]``):

- ``lookup``: two tool calls (journaled with ``ctx.call``) and an answer;
- ``refund``: asks a human (``ctx.request_approval``), then makes the refund if approved;
- ``provision``: reserves a machine (a call with a compensation), then fails: the runtime
  runs the compensation, once;
- ``charge``: on its first attempt makes the charge and never records it (its worker is killed
  with SIGKILL mid-call); the next holder finds the pending journal entry and reconciles it
  with the charge the tool made (its ``reconcile`` hook), so the charge happens once.

Every tool and compensation writes a :class:`~project.demo.models.ToolEffect` with the key it
was given; the report counts them per key.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from buzz_delivery.agents.compensations import compensation
from buzz_delivery.agents.runtime import NOT_MADE
from project.demo.models import ToolEffect


class ProvisioningFailed(Exception):
    """The provisioning agent's failure (the run fails and is compensated)."""


def _run_id() -> uuid.UUID:
    return uuid.UUID(os.environ["BUZZ_DEMO_RUN"])


def _effect(key: str, kind: str, tool: str) -> None:
    ToolEffect.objects.create(run_id=_run_id(), key=key, kind=kind, tool=tool, worker_pid=os.getpid())


def search_kb(args: dict[str, Any], key: str) -> dict[str, Any]:
    _effect(key, "call", "search_kb")
    time.sleep(0.02)
    return {"hits": 3, "query": args["query"]}


def post_reply(args: dict[str, Any], key: str) -> dict[str, Any]:
    _effect(key, "call", "post_reply")
    return {"posted": True}


def refund(args: dict[str, Any], key: str) -> dict[str, Any]:
    _effect(key, "call", "refund")
    return {"refunded": args["amount"]}


def reserve_machine(args: dict[str, Any], key: str) -> dict[str, Any]:
    _effect(key, "call", "reserve_machine")
    return {"machine": "m-1"}


@compensation
def release_machine(args: dict[str, Any], output: Any, key: str) -> None:
    """The compensation of ``reserve_machine``: idempotent by its key."""
    if not ToolEffect.objects.filter(run_id=_run_id(), key=key).exists():
        _effect(key, "compensate", "release_machine")


def charge_and_hang(args: dict[str, Any], key: str) -> dict[str, Any]:
    _effect(key, "call", "charge")
    while True:  # the worker dies here, before the runtime can record the result
        time.sleep(3600)


def charge(args: dict[str, Any], key: str) -> dict[str, Any]:
    _effect(key, "call", "charge")
    return {"charged": args["amount"]}


def find_charge(args: dict[str, Any], key: str) -> Any:
    """``reconcile`` of the charge: did the tool already make it under this key?"""
    if ToolEffect.objects.filter(run_id=_run_id(), key=key, kind="call").exists():
        return {"charged": args["amount"], "reconciled": True}
    return NOT_MADE


def handle(ctx: Any) -> Any:
    content = str(ctx.input.get("content", ""))
    if content.startswith("lookup"):
        found = ctx.call("search_kb", search_kb, {"query": content})
        ctx.call("post_reply", post_reply, {"hits": found["hits"]})
        return {"answered": True, "hits": found["hits"]}
    if content.startswith("refund"):
        decision = ctx.request_approval(prompt=f"refund 40 EUR? ({content})", deadline_seconds=600)
        if decision["decision"] != "approved":
            return {"refunded": 0, "decision": decision["decision"]}
        return ctx.call("refund", refund, {"amount": 40}, destructive=True)
    if content.startswith("provision"):
        ctx.call("reserve_machine", reserve_machine, {"size": "large"}, compensate=release_machine)
        raise ProvisioningFailed("no network for the reserved machine")
    if content.startswith("charge"):
        fn = charge_and_hang if ctx.run.attempts <= 1 else charge
        return ctx.call("charge", fn, {"amount": 12}, reconcile=find_charge, destructive=True)
    return {"ignored": content}
