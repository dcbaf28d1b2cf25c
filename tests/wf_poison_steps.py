"""Hostile ``function`` steps for the engine's poison matrix (tests/test_wf_poison.py), run by
``python -m tests.wf_poison_worker ARGS...`` (``manage.py run_workflow_worker`` with them
registered).

Each step is one kind of poison a step's code can be: a ``BaseException``, an exception whose
``str()`` raises, a failure code PostgreSQL cannot store, a transaction left open three ways, a
session setting, its own connection terminated, output that is not JSON. ``poison.sql`` is an
ordinary step that uses the database: it must work on any thread after any of them."""

from __future__ import annotations

import json
import os
import time

from django.db import connection, transaction

from buzz_delivery.workflows.registry import PermanentStepFailure, workflow_function


class Unprintable(RuntimeError):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


class Stop(BaseException):
    """A BaseException that is neither SystemExit nor KeyboardInterrupt."""


def _sql(text: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(text)


@workflow_function("poison.system_exit")
def system_exit(input: dict, context: object) -> dict:
    raise SystemExit(3)


@workflow_function("poison.keyboard_interrupt")
def keyboard_interrupt(input: dict, context: object) -> dict:
    raise KeyboardInterrupt


@workflow_function("poison.base_exception")
def base_exception(input: dict, context: object) -> dict:
    raise Stop("stop everything")


@workflow_function("poison.unprintable")
def unprintable(input: dict, context: object) -> dict:
    raise Unprintable()


@workflow_function("poison.bad_code")
def bad_code(input: dict, context: object) -> dict:
    raise PermanentStepFailure("a code too long, with a NUL", failure_code="c" * 100 + "\x00")


@workflow_function("poison.atomic_left_open")
def atomic_left_open(input: dict, context: object) -> dict:
    transaction.atomic().__enter__()
    _sql("CREATE TEMPORARY TABLE poison_left_open (x int)")
    return {}


@workflow_function("poison.raw_begin")
def raw_begin(input: dict, context: object) -> dict:
    _sql("BEGIN")
    _sql("SELECT 1 FROM buzz_workflows_run LIMIT 1 FOR UPDATE")
    return {}


@workflow_function("poison.autocommit_off")
def autocommit_off(input: dict, context: object) -> dict:
    transaction.set_autocommit(False)
    _sql("SELECT 1")
    return {}


@workflow_function("poison.statement_timeout")
def statement_timeout(input: dict, context: object) -> dict:
    _sql("SET statement_timeout = 1")
    return {"set": True}


@workflow_function("poison.terminate_self")
def terminate_self(input: dict, context: object) -> dict:
    _sql("SELECT pg_terminate_backend(pg_backend_pid())")
    return {}


@workflow_function("poison.not_json")
def not_json(input: dict, context: object) -> object:
    return {"value": object()}


@workflow_function("poison.nul_output")
def nul_output(input: dict, context: object) -> dict:
    return {"text": "a\x00b"}


@workflow_function("poison.sql")
def sql(input: dict, context: object) -> dict:
    """An ordinary step that uses the database (slow enough for a 1 ms statement_timeout)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_sleep(0.02), current_setting('statement_timeout')")
        _, timeout = cursor.fetchone()
    return {"statement_timeout": timeout, "in_atomic_block": connection.in_atomic_block}


@workflow_function("liveness.record")
def liveness_record(input: dict, context: object) -> dict:
    """Append when this step's function started (host clock: the database's, on one machine), and
    in which process, to ``BUZZ_TEST_LIVENESS_LOG``; sleep ``input["sleep"]`` seconds."""
    run, key = str(context.run_id), context.step_key  # type: ignore[attr-defined]
    line = {"run": run, "key": key, "at": time.time(), "pid": os.getpid()}
    with open(os.environ["BUZZ_TEST_LIVENESS_LOG"], "a") as out:
        out.write(json.dumps(line) + "\n")
    time.sleep(float(input.get("sleep", 0)))
    return {}
