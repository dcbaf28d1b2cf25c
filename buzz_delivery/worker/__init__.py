"""The agent runtime behind ``manage.py run_delivery_worker`` (SPEC section 7).

A handler is any callable ``handler(delivery: WorkflowAgentDelivery) -> object``, named by a
dotted path (``package.module:function``). It runs in a worker thread with no database
transaction open (it may use the ORM on its own connection); the delivery is the claimed model
instance (``execution_trace``/``trigger_context`` load on first access). Its return value is
ignored and settles the delivery ``finished``; raising :class:`PermanentFailure` (or an
exception whose class has ``permanent = True``) settles it ``failed`` with ``failure_code`` =
the class name; raising any other exception settles it ``retry`` (SPEC section 6). Because
delivery is at-least-once, a handler must tolerate being called again for the same delivery.

Use :func:`run_worker` with a :class:`WorkerConfig` to embed the runtime in other code.
"""

from buzz_delivery.worker.handlers import PermanentFailure, load_handler
from buzz_delivery.worker.runtime import (
    EXIT_ABANDONED,
    EXIT_ERROR,
    EXIT_OK,
    WorkerConfig,
    WorkerInTransaction,
    WorkerSummary,
    run_worker,
    summary_line,
)

__all__ = [
    "EXIT_ABANDONED",
    "EXIT_ERROR",
    "EXIT_OK",
    "PermanentFailure",
    "WorkerConfig",
    "WorkerInTransaction",
    "WorkerSummary",
    "load_handler",
    "run_worker",
    "summary_line",
]
