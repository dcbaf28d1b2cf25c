"""Agent handlers and tools of the agent tests, run in-process or by ``run_agent_worker``
subprocesses. Side effects go to an append-only ledger file (``AGENT_LEDGER``), which survives a
SIGKILL, so a test can count how often each call and compensation really happened.
``AGENT_KILL``: ``<point>:<n>`` kills the process (SIGKILL) at that point of call ``n``, once
(a marker file next to the ledger stops the next worker from dying there too)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from buzz_delivery.agents.compensations import compensation
from buzz_delivery.agents.runtime import NOT_MADE


def _ledger() -> Path:
    return Path(os.environ["AGENT_LEDGER"])


def ledger_lines() -> list[str]:
    path = _ledger()
    return path.read_text().splitlines() if path.exists() else []


def _write(line: str) -> None:
    with open(_ledger(), "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _maybe_die(point: str, n: int) -> None:
    if os.environ.get("AGENT_KILL") != f"{point}:{n}":
        return
    marker = _ledger().with_suffix(".killed")
    if marker.exists():
        return
    marker.write_text(point)
    os.kill(os.getpid(), signal.SIGKILL)


def effect(args: dict, key: str) -> dict:
    """A tool whose effect is a ledger line ``call <key>`` (idempotent by key)."""
    n = args["n"]
    _maybe_die("inside_before_effect", n)
    if f"call {key}" not in ledger_lines():
        _write(f"call {key}")
    _maybe_die("inside_after_effect", n)
    return {"n": n}


def reconcile(args: dict, key: str):
    """Ask the 'tool' whether the call with this key happened."""
    return {"n": args["n"]} if f"call {key}" in ledger_lines() else NOT_MADE


@compensation
def undo(args: dict, output, key: str) -> None:
    """Compensation: a ledger line ``undo <key>``, once per key (idempotent)."""
    if f"undo {key}" not in ledger_lines():
        _write(f"undo {key}")
    _maybe_die("undo", args["n"])


@compensation
def broken_undo(args: dict, output, key: str) -> None:
    raise RuntimeError("the refund API is down")


def three_calls(ctx):
    total = 0
    for n in (1, 2, 3):
        _maybe_die("before", n)
        total += ctx.call("effect", effect, {"n": n}, compensate=undo, reconcile=reconcile)["n"]
        _maybe_die("after", n)
    return {"sum": total, "agent": "three_calls"}


def three_calls_no_reconcile(ctx):
    total = 0
    for n in (1, 2, 3):
        total += ctx.call("effect", effect, {"n": n}, compensate=undo)["n"]
    return {"sum": total}


def four_calls_fail(ctx):
    for n in (1, 2, 3):
        ctx.call("effect", effect, {"n": n}, compensate=undo, reconcile=reconcile)
    ctx.call("explode", _explode, {"n": 4})
    return {"never": True}


def _explode(args: dict, key: str) -> dict:
    raise RuntimeError("call 4 failed")


def approve_then_call(ctx):
    first = ctx.call("effect", effect, {"n": 1}, compensate=undo, reconcile=reconcile)
    decision = ctx.request_approval("may I?", 600)
    _write(f"resumed {ctx.run.id}")
    if decision["decision"] != "approved":
        return {"decision": decision["decision"]}
    second = ctx.call("effect", effect, {"n": 2}, compensate=undo, reconcile=reconcile)
    return {"decision": "approved", "calls": [first["n"], second["n"]]}


def noop_three(ctx):
    for n in (1, 2, 3):
        ctx.call("noop", _noop, {"n": n})
    return {"ok": True}


def _noop(args: dict, key: str) -> dict:
    return args


def by_agent(ctx):
    """Dispatch on the run's input ``mode`` (the end-to-end test's three agents)."""
    mode = ctx.input.get("mode") or os.environ.get("AGENT_MODE_" + bytes(ctx.run.agent_pubkey).hex()[:8], "calls")
    if mode == "approval":
        return approve_then_call(ctx)
    if mode == "fail":
        return four_calls_fail(ctx)
    return three_calls(ctx)


def streams(ctx):
    """Emits its output as it goes (issue 29), between two journaled calls."""
    ctx.emit("thinking… ")
    ctx.call("effect", effect, {"n": 1})
    ctx.emit("done")
    return {"agent": "streams"}


def by_input(ctx):
    """Run the handler of this module that the run's input names (``{"handler": "three_calls"}``)."""
    return globals()[ctx.input["handler"]](ctx)


@compensation
def counted_undo(args: dict, output, key: str) -> None:
    """Compensation that is NOT idempotent on purpose: a ledger line ``ran <key>`` every time it
    runs, so a test sees a compensation made twice."""
    _write(f"ran {key}")


def hangs(ctx):
    """Writes ``entered <run id>`` to the ledger, then never returns on its own."""
    _write(f"entered {ctx.lease.run_id}")
    import time

    while True:
        time.sleep(0.1)


@compensation
def undo_as_login(args: dict, output, key: str) -> None:
    """A compensation that records which role and community it runs as (SPEC 13: user code runs
    as the login role, its community as context, like a handler)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT current_user = session_user, current_setting('buzz.community_id', true)")
        as_login, community = cursor.fetchone()
    _write(f"role {key}:{as_login}:{community}")


def not_a_compensation(args, output, key: str) -> None:
    """Importable, callable with a compensation's arguments, and registered by nobody: a stored
    descriptor naming it must never run it (issue 27). Writes ``forbidden <key>`` if it runs."""
    _write(f"forbidden {key}")


def two_calls_then_hold(ctx):
    """Two calls whose compensation is ``counted_undo`` (a ledger line per execution), then
    ``holding <run id>`` in the ledger and a wait until a heartbeat tells the run was cancelled
    (at most 60 s)."""
    import time

    for n in (1, 2):
        ctx.call("effect", effect, {"n": n}, compensate=counted_undo)
    _write(f"holding {ctx.lease.run_id}")
    deadline = time.monotonic() + 60
    while not ctx.cancelled:
        if time.monotonic() > deadline:
            raise TimeoutError("the run was never cancelled")
        time.sleep(0.05)
    return {"cancelled": True}


def _stamped(args: dict, key: str) -> dict:
    return {"i": args["i"], "at": time.time()}


def five_rated_calls(ctx):
    """Five calls under the rate key ``probe`` (tests/test_rate_limits_processes.py): each waits
    for its unit, never fails; the tool notes when it ran."""
    for i in range(5):
        ctx.call("probe", _stamped, {"i": i}, rate_key="probe")
    return {"waits": ctx.rate_waits}


def quick(ctx):
    """Return at once (no call): the run completes."""
    return {"ok": True}


def fails_with_code(ctx):
    """Fails at once (no call made) with an AgentError whose code is ``quota_spent``."""
    from buzz_delivery.agents.exceptions import AgentError

    class Spent(AgentError):
        failure_code = "quota_spent"

    raise Spent("the month's quota is spent")
