"""Handlers for the remote worker tests (``python -m buzz_delivery.gateway.client work``).

``scripted``: by step id prefix: ``perm_`` raises a permanent failure, ``retry_`` a plain
exception, anything else returns. Appends the delivery id to ``GATEWAY_HANDLER_LOG`` when it
starts, sleeps ``GATEWAY_HANDLER_SLEEP`` seconds, then waits (60 s at most) for the file
``GATEWAY_HANDLER_GATE`` to exist when that is set (except for ``quick_`` steps).
"""

from __future__ import annotations

import os
import time

from buzz_delivery.gateway.client import PermanentFailure
from buzz_delivery.gateway.remote_runs import compensation


class BadPayload(PermanentFailure):
    pass


def scripted(delivery: dict) -> None:
    log = os.environ.get("GATEWAY_HANDLER_LOG")
    if log:
        with open(log, "a") as out:
            out.write(delivery["id"] + "\n")
    time.sleep(float(os.environ.get("GATEWAY_HANDLER_SLEEP", "0")))
    gate = os.environ.get("GATEWAY_HANDLER_GATE") if not delivery["step_id"].startswith("quick_") else None
    deadline = time.monotonic() + 60
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:  # held until the test opens it
        time.sleep(0.02)
    step = delivery["step_id"]
    if step.startswith("perm_"):
        raise BadPayload("cannot parse")
    if step.startswith("retry_"):
        raise RuntimeError("try again")
    # The poison matrix (issue 28): each must end only its own delivery.
    if step.startswith("exit_"):
        raise SystemExit(5)
    if step.startswith("kbd_"):
        raise KeyboardInterrupt
    if step.startswith("base_"):
        raise Stop("stop everything")
    if step.startswith("unprintable_"):
        raise Unprintable()
    if step.startswith("longcode_"):
        raise ThisExceptionClassHasANameMuchLongerThanSixtyFourCharactersWhichNoFailureCodeColumnCanHold("x")
    if step.startswith("nul_"):
        raise BadPayload("a NUL \x00 and a lone surrogate \ud800 in the message")


class Stop(BaseException):
    """A BaseException that is neither SystemExit nor KeyboardInterrupt."""


class Unprintable(RuntimeError):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


class ThisExceptionClassHasANameMuchLongerThanSixtyFourCharactersWhichNoFailureCodeColumnCanHold(PermanentFailure):
    pass


# --- agent-run handlers of ``work-runs`` (remote_runs): side effects in GATEWAY_RUN_LEDGER -----


def _ledger_lines() -> list[str]:
    path = os.environ["GATEWAY_RUN_LEDGER"]
    return open(path).read().splitlines() if os.path.exists(path) else []


def _append(line: str) -> None:
    with open(os.environ["GATEWAY_RUN_LEDGER"], "a") as out:
        out.write(line + "\n")


def effect(args: dict, key: str) -> dict:
    """A tool whose effect is a ledger line ``call <key>`` (idempotent by key)."""
    if f"call {key}" not in _ledger_lines():
        _append(f"call {key}")
    return {"n": args["n"]}


def reconcile(args: dict, key: str):
    from buzz_delivery.gateway.remote_runs import NOT_MADE

    return {"n": args["n"]} if f"call {key}" in _ledger_lines() else NOT_MADE


@compensation
def undo(args: dict, output, key: str) -> None:
    """Compensation: a ledger line ``undo <key>`` every time it runs."""
    _append(f"undo {key}")


def forbidden(args, output, key: str) -> None:
    """Importable, never registered: a compensation descriptor naming it must never run it."""
    _append(f"forbidden {key}")


def three_calls(ctx) -> dict:
    """Three journaled calls; input ``{"fail": true}`` raises after them (so they are undone)."""
    total = sum(ctx.call("effect", effect, {"n": n}, compensate=undo, reconcile=reconcile)["n"] for n in (1, 2, 3))
    if ctx.input.get("fail"):
        raise RuntimeError("the fourth step is broken")
    return {"sum": total}


def slow_three_calls(ctx) -> dict:
    """``three_calls`` that waits ``GATEWAY_HANDLER_SLEEP`` seconds first (leases get renewed)."""
    time.sleep(float(os.environ.get("GATEWAY_HANDLER_SLEEP", "0")))
    return three_calls(ctx)


def poison_run(ctx):
    """``work-runs`` poison matrix: input ``kind`` picks how the handler misbehaves."""
    from buzz_delivery.gateway.remote_runs import RemoteRunError

    kind = ctx.input.get("kind")
    if kind == "exit":
        raise SystemExit(6)
    if kind == "unprintable":
        raise Unprintable()
    if kind == "long_code":
        error = RemoteRunError("a code too long")
        error.failure_code = "c" * 100 + "\x00"
        raise error
    if kind == "not_json":
        return {"value": object()}
    if kind == "nul_output":
        return {"text": "a\x00b"}
    return {"ok": kind}


@compensation
def undo_raises_huge(args: dict, output, key: str) -> None:
    """A compensation whose error text is over the 10,000 characters a journal entry keeps."""
    _append(f"undo-attempt {key}")
    raise RuntimeError("u" * 20_000)


@compensation
def undo_raises_nul(args: dict, output, key: str) -> None:
    """A compensation whose error text holds a NUL (PostgreSQL text cannot store it)."""
    _append(f"undo-attempt {key}")
    raise RuntimeError("before\x00after")


def fails_with_code(ctx):
    """Fails at once (no call made) with a RemoteRunError whose code is ``quota_spent``."""
    from buzz_delivery.gateway.remote_runs import RemoteRunError

    class Spent(RemoteRunError):
        failure_code = "quota_spent"

    raise Spent("the month's quota is spent")
