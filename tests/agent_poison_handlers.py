"""Hostile agent handlers for the agent worker's poison matrix (tests/test_agents_poison.py), run
by ``run_agent_worker --handler tests.agent_poison_handlers:poison``: the run's input ``kind``
names one (``ordinary`` is a handler that uses the database: it must work after any of them).

Each makes one journaled call (``made <key>`` in the ``AGENT_LEDGER`` file every time the tool
runs, ``ran <key>:compensate`` every time its compensation runs) where the kind allows, so a
test can count that no tool ran twice and that what a failed run did is undone once."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from django.db import connection, transaction

from buzz_delivery.agents.conf import get_settings
from buzz_delivery.agents.exceptions import AgentError
from tests.agent_handlers import counted_undo


class Unprintable(RuntimeError):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


class Stop(BaseException):
    """A BaseException that is neither SystemExit nor KeyboardInterrupt."""


class LongCode(AgentError):
    failure_code = "c" * 100 + "\x00"


def _write(line: str) -> None:
    with open(os.environ["AGENT_LEDGER"], "a") as f:
        f.write(line + "\n")


def made(args: dict, key: str) -> dict:
    """A tool that is not idempotent on purpose: ``made <key>`` every time it runs."""
    _write(f"made {key}")
    return {"n": args["n"]}


def exits(args: dict, key: str) -> dict:
    _write(f"made {key}")
    raise SystemExit(5)


def _call(ctx: Any, n: int = 1, tool: Any = made) -> Any:
    return ctx.call("made", tool, {"n": n}, compensate=counted_undo)


def _sql(text: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(text)


def ordinary(ctx: Any) -> dict:
    _call(ctx)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_sleep(0.02), current_setting('statement_timeout')")
        _, timeout = cursor.fetchone()
    return {"statement_timeout": timeout, "in_atomic_block": connection.in_atomic_block}


def not_json(ctx: Any) -> object:
    return {"value": object()}


def nul_output(ctx: Any) -> dict:
    return {"text": "a\x00b"}


def too_large(ctx: Any) -> str:
    return "x" * (get_settings().max_output_bytes + 1)


def unprintable(ctx: Any) -> dict:
    raise Unprintable()


def long_code(ctx: Any) -> dict:
    raise LongCode("a failure code of 101 characters")


def system_exit(ctx: Any) -> dict:
    raise SystemExit(3)


def keyboard_interrupt(ctx: Any) -> dict:
    raise KeyboardInterrupt


def cancelled(ctx: Any) -> dict:
    raise asyncio.CancelledError()


def base_exception(ctx: Any) -> dict:
    raise Stop("stop everything")


def exit_mid_call(ctx: Any) -> dict:
    _call(ctx, tool=exits)  # the tool raises SystemExit: its entry is left pending
    return {}


def terminate_self(ctx: Any) -> dict:
    _call(ctx)
    _sql("SELECT pg_terminate_backend(pg_backend_pid())")
    return {}


def terminate_runtime(ctx: Any) -> dict:
    """Terminates the backend of the runtime's own connection (an operator's pg_terminate_backend)."""
    _call(ctx)
    pid = ctx.lane._runtime_db.connection.info.backend_pid
    _sql(f"SELECT pg_terminate_backend({int(pid)})")
    return {"after": "terminated"}


def atomic_left_open(ctx: Any) -> dict:
    transaction.atomic().__enter__()
    _sql("CREATE TEMPORARY TABLE poison_left_open (x int)")
    _call(ctx)  # journaled and recorded on the runtime's connection, never in this transaction
    return {}


def raw_begin(ctx: Any) -> dict:
    _sql("BEGIN")
    _sql("SELECT pg_advisory_xact_lock(28)")  # a lock a leaked transaction would keep holding
    _call(ctx)
    return {}


def autocommit_off(ctx: Any) -> dict:
    transaction.set_autocommit(False)
    _sql("SELECT 1")
    _call(ctx)
    return {}


def statement_timeout(ctx: Any) -> dict:
    _sql("SET statement_timeout = 1")
    _call(ctx)  # the runtime's statements are not under it
    return {"set": True}


def poison(ctx: Any) -> Any:
    return globals()[ctx.input["kind"]](ctx)
