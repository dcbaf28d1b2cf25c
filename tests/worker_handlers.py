"""Handlers used by tests/test_worker.py (run inside ``run_delivery_worker`` subprocesses).

``scripted`` acts on the delivery's ``trigger_context``: ``{"wait_for": path}`` waits until that
file exists (two minutes at most), ``{"sleep": seconds}`` sleeps first,
``{"raise": "permanent" | "permanent_attr" | "ordinary"}`` raises (``{"raise": "retry_after",
"seconds": n}`` raises ``RetryAfter(n)``). Each call appends JSON lines
to the file named by ``BUZZ_TEST_HANDLER_LOG`` (if set): what it saw when it started, including
how many other backends of this database sat idle in an open transaction.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from django.db import OperationalError, connection, transaction

from buzz_delivery.backoff import RetryAfter
from buzz_delivery.worker import PermanentFailure


class BadPayload(PermanentFailure):
    """A permanent failure by subclass."""


class QuotaGone(RuntimeError):
    """A permanent failure by class attribute, not by subclass."""

    permanent = True


def _record(event: str, delivery, **extra) -> None:
    path = os.environ.get("BUZZ_TEST_HANDLER_LOG")
    if not path:
        return
    line = {"event": event, "delivery": str(delivery.id), "time": time.time(), **extra}
    with open(path, "a") as log:
        log.write(json.dumps(line) + "\n")


def _open_transactions_elsewhere() -> int:
    try:
        return _count_open_transactions_elsewhere()
    except OperationalError:
        # This thread's connection was cut (test_worker terminates backends): reconnect once.
        connection.close()
        return _count_open_transactions_elsewhere()


def _count_open_transactions_elsewhere() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%%'"
        )
        return cursor.fetchone()[0]


def scripted(delivery) -> str:
    """Sleep and/or raise as the delivery's trigger_context says."""
    script = delivery.trigger_context or {}
    _record(
        "start",
        delivery,
        in_atomic_block=connection.in_atomic_block,
        open_transactions_elsewhere=_open_transactions_elsewhere(),
    )
    gate = script.get("wait_for")
    if gate:  # the test opens the gate when it is ready: no guess of how long the handler runs
        until = time.monotonic() + 120
        while not os.path.exists(gate) and time.monotonic() < until:
            time.sleep(0.02)
    time.sleep(script.get("sleep", 0))
    _record("end", delivery)
    kind = script.get("raise")
    if kind == "kill_thread":  # the runtime's own thread dies after this handler (an internal error)
        _kill_this_thread_soon()
        return "done"
    if kind == "system_exit":
        raise SystemExit(4)
    if kind == "keyboard_interrupt":
        raise KeyboardInterrupt
    if kind == "base_exception":
        raise Stop("stop everything")
    if kind == "long_code":
        raise ThisExceptionClassHasANameMuchLongerThanSixtyFourCharactersWhichNoFailureCodeColumnCanHold("x")
    if kind == "atomic_left_open":
        transaction.atomic().__enter__()
        _sql("SELECT 1")
        return "done"
    if kind == "raw_begin":
        _sql("BEGIN")
        _sql("SELECT 1 FROM buzz_delivery_delivery_record LIMIT 1 FOR UPDATE")
        return "done"
    if kind == "autocommit_off":
        transaction.set_autocommit(False)
        _sql("SELECT 1")
        return "done"
    if kind == "statement_timeout":
        _sql("SET statement_timeout = 1")
        return "done"
    if kind == "terminate_self":
        _sql("SELECT pg_terminate_backend(pg_backend_pid())")
        return "done"
    if kind == "sql":  # an ordinary handler that uses the database: it must work after any of the above
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_sleep(0.02), current_setting('statement_timeout')")
            timeout = cursor.fetchone()[1]
        _record("sql", delivery, statement_timeout=timeout, in_atomic_block=connection.in_atomic_block)
        return "done"
    if kind == "permanent":
        raise BadPayload("payload cannot be parsed")
    if kind == "permanent_attr":
        raise QuotaGone("quota is gone for good")
    if kind == "ordinary":
        raise ValueError("upstream timed out")
    if kind == "retry_after":  # a provider's Retry-After: not retried before script["seconds"]
        raise RetryAfter(script["seconds"], "rate limited upstream")
    if kind == "cancelled":  # a BaseException, not an Exception
        raise asyncio.CancelledError("the event loop went away")
    # Text PostgreSQL cannot store (JSON cannot carry it, so the handler builds it).
    if kind == "nul_permanent":
        raise BadPayload("byte \x00 in the payload " + "x" * 20_000)
    if kind == "surrogate_ordinary":
        raise ValueError("lone surrogate \ud800 from a decoder")
    if kind == "unprintable":
        raise Unprintable()
    return "done"


class Unprintable(RuntimeError):
    """An exception whose own ``__str__`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


class Stop(BaseException):
    """A BaseException that is neither SystemExit nor KeyboardInterrupt."""


class ThisExceptionClassHasANameMuchLongerThanSixtyFourCharactersWhichNoFailureCodeColumnCanHold(PermanentFailure):
    pass


def _sql(text: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(text)


def _kill_this_thread_soon() -> None:
    """Make the runtime's own code fail on this handler thread right after the handler returns
    (its hand-over to the settler raises SystemExit): how a worker thread dying of an internal
    error looks."""
    from buzz_delivery.worker.settler import Settler

    def put(self: Settler, job: object) -> None:
        raise SystemExit("the runtime's own code failed")

    Settler.put = put  # type: ignore[method-assign]


def finish(delivery) -> None:
    """Return at once (settles ``finished``)."""
    _record("start", delivery)


def sleep_without_database(delivery) -> None:
    """Sleep 1.5 s touching neither the database nor deferred fields (for the connection-cut test:
    a handler that used this thread's cut connection would fail and be retried, by design)."""
    _record("start", delivery)
    time.sleep(1.5)


async def async_waits(delivery) -> None:
    """An ``async def`` handler (tests/test_worker_async.py): awaits ``{"sleep": s}`` (an I/O
    wait, e.g. a model call) without holding a thread or a connection, or ``{"block": s}`` blocks
    the loop's thread (a blocking call without await: tests/test_loopwatch.py), then raises as
    ``{"raise": "permanent" | "ordinary" | "base" | "cancelled"}`` says."""
    script = delivery.trigger_context or {}
    _record("start", delivery)
    if script.get("block"):
        time.sleep(float(script["block"]))  # the mistake the loop's watchdog names
    await asyncio.sleep(float(script.get("sleep", 0)))
    _record("end", delivery)
    what = script.get("raise")
    if what == "permanent":
        raise BadPayload("no such recipient")
    if what == "ordinary":
        raise RuntimeError("the provider timed out")
    if what == "base":
        raise SystemExit(3)
    if what == "cancelled":
        raise asyncio.CancelledError()
