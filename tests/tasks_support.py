"""Task functions of the django.tasks backend tests (registered when this module is imported)."""

from __future__ import annotations

import asyncio

from django.core.mail import send_mail

from buzz_delivery.tasks.compat import TaskContext
from buzz_delivery.tasks.compat import task_backends as _backends  # noqa: F401  (configured first)

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task  # type: ignore[no-redef]

COMMUNITY = "01900000-0000-7000-8000-00000000da5c"  # project/settings.py's TASKS default


@task
def add(a: int, b: int) -> int:
    return a + b


@task
async def add_later(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


@task
def explode(message: str) -> None:
    raise ValueError(message)


@task(takes_context=True)
def who_am_i(context: TaskContext) -> dict:
    return {"id": context.task_result.id, "attempt": context.attempt}


@task(queue_name="emails", priority=10)
def email_users(emails: list[str], subject: str, message: str) -> int:
    """Django's documented example (docs/topics/tasks)."""
    return send_mail(subject=subject, message=message, from_email=None, recipient_list=emails)


RUNS: list[str] = []  # the tasks below that ran, in this process


class OddError(Exception):
    """An exception whose class claims a module name PostgreSQL cannot store (a NUL)."""


OddError.__module__ = "odd\x00module"


@task
def returns_nan() -> float:
    RUNS.append("returns_nan")
    return float("nan")


@task
def returns_nul() -> str:
    RUNS.append("returns_nul")
    return "a\x00b"


@task
def returns_surrogate() -> dict:
    RUNS.append("returns_surrogate")
    return {"key": "\ud800"}


@task
def raises_odd() -> None:
    RUNS.append("raises_odd")
    raise OddError("odd")


@task(takes_context=True)
def mark_and_wait(context: TaskContext, log: str, gate: str) -> str:
    """Append ``<result id> <attempt>`` to ``log``, then wait (up to 30 s) for the file ``gate``."""
    import os
    import time

    with open(log, "a") as out:
        out.write(f"{context.task_result.id} {context.attempt}\n")
    deadline = time.monotonic() + 30
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    return context.task_result.id


@task
async def count_results_async() -> list:
    """The task rows its community holds, read from an async task through the ORM (its thread
    and connection: the handler's, in the delivery's community)."""
    import threading

    from asgiref.sync import sync_to_async

    from buzz_delivery.tasks.models import TaskResult

    def count() -> list:
        return [TaskResult.objects.count(), threading.get_ident()]

    return [*(await sync_to_async(count)()), threading.get_ident()]


@task
def count_results() -> list:
    """As :func:`count_results_async`, from a sync task."""
    import threading

    from buzz_delivery.tasks.models import TaskResult

    return [TaskResult.objects.count(), threading.get_ident(), threading.get_ident()]


@task(takes_context=True)
def mark_and_hold(context: TaskContext, log: str, hold: str, outcome: str) -> str | None:
    """Append ``<result id> <attempt>`` to ``log``, then return ``"<result id> <attempt>"``
    (``outcome`` ``"value"``), return None (``"none"``) or raise ``ValueError`` (``"raise"``).
    With ``hold`` set, :func:`hold_after_recording` keeps the worker in its ``task_finished``
    (the outcome recorded, the settle not yet made) the first time, to be killed there."""
    with open(log, "a") as out:
        out.write(f"{context.task_result.id} {context.attempt}\n")
    if outcome == "raise":
        raise ValueError(f"attempt {context.attempt}")
    return None if outcome == "none" else f"{context.task_result.id} {context.attempt}"


def hold_after_recording(sender, task_result, **kwargs) -> None:
    """A ``task_finished`` receiver: for :func:`mark_and_hold` with a ``hold`` path, the first
    time, create ``hold`` (the outcome is recorded) and wait up to 60 s, for the test to kill
    this worker process with SIGKILL before its settle is made."""
    import os
    import time

    if task_result.task.func is not mark_and_hold.func or not task_result.args[1]:
        return
    hold = task_result.args[1]
    if os.path.exists(hold):
        return
    open(hold, "w").close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)


def _connect_hold() -> None:
    from buzz_delivery.tasks import DeliveryBackend
    from buzz_delivery.tasks.compat import task_finished

    task_finished.connect(hold_after_recording, sender=DeliveryBackend, dispatch_uid="tests.hold_after_recording")


_connect_hold()


@task
def leaves_transaction_open(how: str, table: str, then_raise: bool = False) -> str:
    """Write a row into ``table`` inside a transaction it leaves open: ``how`` is ``autocommit``
    (``set_autocommit(False)``), ``atomic`` (an ``atomic()`` entered, never exited) or ``begin``
    (a raw ``BEGIN``). The table's name is the test's own, never a caller's."""
    from django.db import connection, transaction

    if how == "autocommit":
        transaction.set_autocommit(False)
    elif how == "atomic":
        transaction.atomic().__enter__()
    with connection.cursor() as cursor:
        if how == "begin":
            cursor.execute("BEGIN")
        cursor.execute(f"INSERT INTO {table} (note) VALUES ('written inside the open transaction')")
    if then_raise:
        raise ValueError("and then it raised")
    return "returned"


@task
def raises_with_a_long_cause() -> None:
    """Raise an error whose traceback (its cause's long message first) is longer than what an
    error keeps: its last line, the error it raised, is what must be kept."""
    try:
        raise KeyError("a long cause " + "x" * 30_000)
    except KeyError as exc:
        raise ValueError("the final exception line") from exc
