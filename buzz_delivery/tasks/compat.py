"""Django's Tasks framework where it lives: ``django.tasks`` on Django 6.x, the ``django-tasks``
backport (module ``django_tasks``) on Django 5.2. Everything else of this package imports it
from here."""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

if find_spec("django.tasks") is not None:
    from django.tasks import task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import (
        DEFAULT_TASK_PRIORITY,
        DEFAULT_TASK_QUEUE_NAME,
        TASK_MAX_PRIORITY,
        TASK_MIN_PRIORITY,
        Task,
        TaskContext,
        TaskError,
        TaskResult,
        TaskResultStatus,
    )
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started

    FRAMEWORK = "django.tasks"
else:  # Django 5.2: the backport
    from django_tasks import task_backends  # type: ignore[no-redef,assignment,unused-ignore]
    from django_tasks.backends.base import BaseTaskBackend  # type: ignore[no-redef,assignment,unused-ignore]
    from django_tasks.base import (  # type: ignore[no-redef,assignment,unused-ignore]
        DEFAULT_TASK_PRIORITY,
        DEFAULT_TASK_QUEUE_NAME,
        TASK_MAX_PRIORITY,
        TASK_MIN_PRIORITY,
        Task,
        TaskContext,
        TaskError,
        TaskResult,
        TaskResultStatus,
    )
    from django_tasks.exceptions import InvalidTaskError as InvalidTask  # type: ignore[no-redef,assignment,unused-ignore]
    from django_tasks.exceptions import TaskResultDoesNotExist  # type: ignore[no-redef,assignment,unused-ignore]
    from django_tasks.signals import task_enqueued, task_finished, task_started  # type: ignore[no-redef,assignment,unused-ignore]

    FRAMEWORK = "django_tasks"


def normalize_json(value: Any) -> Any:
    """The JSON form of ``value`` Django's task results hold (tuples become lists...)."""
    if FRAMEWORK == "django.tasks":
        from django.utils.json import normalize_json as normalize
    else:
        from django_tasks.utils import normalize_json as normalize  # type: ignore[no-redef,assignment,unused-ignore]
    return normalize(value)


__all__ = [
    "DEFAULT_TASK_PRIORITY",
    "DEFAULT_TASK_QUEUE_NAME",
    "FRAMEWORK",
    "TASK_MAX_PRIORITY",
    "TASK_MIN_PRIORITY",
    "BaseTaskBackend",
    "InvalidTask",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "normalize_json",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]
