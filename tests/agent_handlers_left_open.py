"""Handlers for tests/test_agents_aio_left_open_crash.py, run by ``run_agent_worker --async``
subprocesses: a plain tool that leaves its transaction open (a table it created in it is
rolled back), with ``AGENT_KILL=left_open`` killing the process (SIGKILL, once) as the worker
rolls it back, before the call's failure is journaled."""

from __future__ import annotations

import logging
import os
import signal

from django.db import connection, transaction

from buzz_delivery.agents.compensations import compensation
from buzz_delivery.agents.exceptions import ToolCallFailed
from tests.agent_handlers import _ledger, _maybe_die, _write, effect, reconcile, undo


class _DieOnLeftOpen(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if os.environ.get("AGENT_KILL") != "left_open" or not record.getMessage().startswith("user_code_left_open"):
            return
        marker = _ledger().with_suffix(".killed")
        if not marker.exists():
            marker.write_text("left_open")
            os.kill(os.getpid(), signal.SIGKILL)


logging.getLogger("buzz_delivery.usercode").addHandler(_DieOnLeftOpen())


def leaves_open(args: dict, key: str) -> dict:
    """Made (a ledger line), then a write in a transaction it never ends."""
    _write(f"made {key}")
    transaction.set_autocommit(False)
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE {args['table']} (x int)")
    return {"ok": True}


@compensation
def undo_left_open(args: dict, output, key: str) -> None:
    _write(f"undo {key}")


def left_open_then_effect(ctx):
    try:
        ctx.call("leave", leaves_open, {"table": ctx.input["table"]}, compensate=undo_left_open)
        first = "made"
    except ToolCallFailed as exc:
        first = str(exc)
    out = ctx.call("effect", effect, {"n": 2}, compensate=undo, reconcile=reconcile)
    _maybe_die("after", 2)
    return {"first": first, "then": out}
