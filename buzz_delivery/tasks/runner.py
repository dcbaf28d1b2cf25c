"""What a task worker does with each claimed delivery: the handler given to the delivery worker
(:func:`buzz_delivery.worker.run_worker`) by ``manage.py run_task_worker``.

For a delivery of the tasks backend it reads the task's row, resolves the task among those this
process registered (never by importing the stored path), sends ``task_started``, runs it (an
``async def`` task through Django's ``Task.call``: ``async_to_sync``, its ``sync_to_async``
calls back in the handler thread), writes the return value or the error fenced by the delivery's
lease, sends ``task_finished``, and returns: the worker then settles the delivery ``finished``.
A task that raised ends ``failed`` (Django's tasks are not retried on error; the error is in the
result). A task that leaves a transaction open ends ``failed`` too (``transaction_left_open``:
its connection is rolled back and closed before the outcome is recorded on a fresh one, see
:mod:`buzz_delivery.usercode`); a signal receiver that does is logged and its transaction rolled
back, and changes nothing else, as one that raises. The task and its receivers run in the
runner's one guard (the worker adds none: ``guards_user_code``).
A worker that dies mid-task leaves the lease to lapse: the reaper returns the delivery to
``pending`` and another worker runs the task again, until the delivery's ``max_attempts``.
A worker that dies after the outcome was recorded, before its settle committed, leaves it
recorded: the next holder reads it with the task, in one statement fenced by its lease
(``services.read_task_of_delivery``), and settles the delivery as it says, without running the
task or sending its signals again.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

from buzz_delivery.tasks import compat
from buzz_delivery.tasks.backend import DeliveryBackend, TaskNotRegistered
from buzz_delivery.usercode import UserCode
from buzz_delivery.worker import PermanentFailure
from buzz_delivery.worker.handlers import FAILURE_MESSAGE_MAX_CHARS, describe, storable_tail, storable_text

logger = logging.getLogger("buzz_delivery.tasks")


class TaskFailed(PermanentFailure):
    """The task raised: its error is recorded in the task's result; the delivery ends failed."""


class task_not_registered(PermanentFailure):
    """The stored task path names no task registered in this worker process."""


class transaction_left_open(PermanentFailure):  # its name is the failure code, as the worker's
    """The task left a transaction open: what it wrote there is rolled back, none of it kept."""


class NotATask(PermanentFailure):
    """The delivery carries no task of this backend (no result row)."""


class LeaseLostBeforeResult(Exception):
    """The lease was lost before the result could be written: the delivery is not settled here."""


def error_of(exc: BaseException) -> dict[str, str]:
    """The stored form of an error: the exception class's path and the traceback text (a long
    one keeps its end, the exception line, and says how much of its beginning was cut)."""
    kind = type(exc)
    text = "".join(traceback.format_exception(exc))
    return {
        "exception_class_path": storable_text(f"{kind.__module__}.{kind.__qualname__}", FAILURE_MESSAGE_MAX_CHARS),
        "traceback": storable_tail(text, FAILURE_MESSAGE_MAX_CHARS),
    }


def left_open_error(left_open: str, raised: BaseException | None) -> dict[str, str]:
    """The stored error of a task that left a transaction open (``left_open``: what, as
    :attr:`~buzz_delivery.usercode.UserCode.left_open` says), and of what it raised too, if anything."""
    kind = transaction_left_open
    text = f"the task left its database connection with {left_open}; nothing it wrote there is kept (rolled back)"
    text = storable_text(text, FAILURE_MESSAGE_MAX_CHARS // 2)
    if raised is not None:
        text += "\n\nThe task also raised:\n"
        text += storable_tail("".join(traceback.format_exception(raised)), FAILURE_MESSAGE_MAX_CHARS - len(text))
    return {"exception_class_path": f"{kind.__module__}.{kind.__qualname__}", "traceback": text}


class TaskRunner:
    """``TaskRunner(backend)(delivery)``: run the task a delivery carries (see the module doc)."""

    # The worker runs it without a guard of its own (buzz_delivery.worker.handlers): the
    # runner's one guard judges the task and its signal receivers, each where it ran.
    guards_user_code = True

    def __init__(self, backend: DeliveryBackend) -> None:
        self.backend = backend

    def __call__(self, delivery: Any) -> None:
        # One guard (buzz_delivery.usercode) for the task's user code: the task itself and the
        # receivers of task_started and task_finished, in the delivery's community as the
        # worker's handler scope. Each is judged where it ran (a checkpoint): what it left open
        # on the connection is rolled back and the connection closed there, so the runner's
        # own statements (the record of the outcome) commit on a connection of their own.
        call = UserCode(delivery.community_id)
        with call:
            self._run(delivery, call)

    def _run(self, delivery: Any, call: UserCode) -> None:
        from buzz_delivery.tasks import services

        held = services.read_task_of_delivery(delivery.community_id, delivery.id, delivery.lease_generation)
        if held is None or held.task.backend != self.backend.alias:
            raise NotATask(f"delivery {delivery.id} carries no task of backend {self.backend.alias!r}")
        stored = held.task
        if self._returned_before(delivery, held.recorded):
            return
        try:
            task = self.backend.task_of(stored)
        except TaskNotRegistered as exc:
            self._record(
                delivery,
                error={
                    "exception_class_path": "LookupError",
                    "traceback": f"not registered: {exc}",
                    "failure_code": task_not_registered.__name__,
                },
            )
            raise task_not_registered(str(exc)) from None
        running = self.backend.result_of(stored, status=compat.TaskResultStatus.RUNNING)
        self._send(compat.task_started, running, call)
        left_open: str | None = None
        try:
            args = list(stored.args)
            if task.takes_context:
                args.insert(0, compat.TaskContext(task_result=running))
            try:
                value = task.call(*args, **stored.kwargs)
            finally:
                left_open = call.checkpoint()
            if left_open is not None:
                raise transaction_left_open(left_open)
            value = compat.normalize_json(value)
            # A value the result row cannot hold fails the task here, where it ran once: left
            # to the recording statement, its refusal would retry the delivery and run the
            # task again, up to max_attempts times, each time refused the same way.
            services.json_text(value, "return_value", services.MAX_RETURN_VALUE_BYTES)
        except BaseException as exc:  # the task's own failure, whatever it raised
            if left_open is not None:  # what it raised too, if anything, follows
                error = left_open_error(left_open, None if isinstance(exc, transaction_left_open) else exc)
                failure: PermanentFailure = transaction_left_open(error["traceback"].partition("\n")[0])
            else:
                error = error_of(exc)
                failure = TaskFailed(f"{error['exception_class_path']}: {describe(exc)}")
            self._record(delivery, error={**error, "failure_code": type(failure).__name__})
            self._send(
                compat.task_finished,
                self.backend.result_of(stored, status=compat.TaskResultStatus.FAILED, errors=[*stored.errors, error]),
                call,
            )
            raise failure from exc
        self._record(delivery, return_value=value)
        self._send(
            compat.task_finished,
            self.backend.result_of(stored, status=compat.TaskResultStatus.SUCCESSFUL, return_value=value),
            call,
        )

    def _returned_before(self, delivery: Any, found: Any) -> bool:
        """False when the task is to run. Otherwise an earlier holder of this delivery ran it,
        recorded its outcome and died before its settle committed: True for a recorded return
        value (the worker settles ``finished``), and a recorded error raises what that holder
        raised (``TaskFailed`` or ``task_not_registered`` by the stored code, chosen among
        these two, never looked up). Either way the task is not called again and
        ``task_started``/``task_finished`` are not sent again: they were sent for that run.
        ``found``: the :class:`~buzz_delivery.tasks.services.RecordedOutcome` read with the task."""
        if found.state == "none":
            return False
        if found.state == "lease_lost":
            raise LeaseLostBeforeResult(f"delivery {delivery.id}: lease lost before its recorded outcome was read")
        if found.state == "returned":
            return True
        error = found.error or {}
        codes = {kind.__name__: kind for kind in (task_not_registered, transaction_left_open)}
        failure = codes.get(str(error.get("failure_code")), TaskFailed)
        path = error.get("exception_class_path")
        raise failure(f"{path if isinstance(path, str) else 'error'}: recorded by an earlier attempt, not run again")

    def _send(self, signal: Any, task_result: Any, call: UserCode) -> None:
        """Send ``task_started``/``task_finished`` to every receiver, logging (not raising) what
        one raises: a receiver is the project's code, not the task's. Raised from here, its
        error would retry the delivery: a task never run (``task_started``) or, its outcome
        already recorded, run again (``task_finished``), up to ``max_attempts`` times. A
        receiver that leaves a transaction open is told the same way (``task_signal_error``,
        ``transaction_left_open``): what it wrote there is rolled back and its connection
        closed (``call``'s checkpoint), and the task's outcome stands."""
        for receiver, outcome in signal.send_robust(type(self.backend), task_result=task_result):
            if isinstance(outcome, BaseException):
                logger.error(
                    "task_signal_error result=%s receiver=%r error=%s: %s",
                    task_result.id,
                    receiver,
                    type(outcome).__name__,
                    describe(outcome),
                    exc_info=outcome,
                )
        left_open = call.checkpoint()
        if left_open is not None:
            logger.error(
                "task_signal_error result=%s signal=%s error=%s: a receiver left its database connection with %s;"
                " nothing it wrote there is kept",
                task_result.id,
                "task_started" if signal is compat.task_started else "task_finished",
                transaction_left_open.__name__,
                left_open,
            )

    def _record(self, delivery: Any, *, return_value: Any = None, error: dict[str, str] | None = None) -> None:
        from buzz_delivery.tasks import services

        if not services.record_task_outcome(
            delivery.community_id, delivery.id, delivery.lease_generation, return_value=return_value, error=error
        ):
            raise LeaseLostBeforeResult(f"delivery {delivery.id}: lease lost before the result was written")
