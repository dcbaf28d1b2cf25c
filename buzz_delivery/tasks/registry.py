"""The tasks this process declared: the only callables a task worker runs.

Every ``Task`` built for a :class:`~buzz_delivery.tasks.DeliveryBackend` (``@task`` at import
of the module that defines it, ``.using(...)``) is validated by the backend, which registers it
here under its ``module_path``. A worker resolves a stored ``task_path`` by looking it up in this
registry, never by importing it: a path that names no registered task fails that one task with
``failure_code`` ``task_not_registered``. The modules that define tasks are imported at worker
start from what the server declares (the installed apps' ``tasks`` modules and the backend's
``OPTIONS["MODULES"]``), never from a stored row.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterable
from typing import Any

from django.utils.module_loading import autodiscover_modules

_lock = threading.Lock()
_tasks: dict[str, Any] = {}


def register(task: Any) -> None:
    """Record ``task`` (a ``Task``) under its ``module_path``; the first one of a path stays
    (``.using()`` copies share the function, and the stored row carries the options)."""
    path = task.module_path
    with _lock:
        if path not in _tasks:
            _tasks[path] = task
        elif _tasks[path].func is not task.func:
            raise ValueError(f"two different task functions are registered as {path!r}")


def registered(path: str) -> Any | None:
    """The ``Task`` registered under ``path``, or None (no import is tried)."""
    return _tasks.get(path)


def paths() -> list[str]:
    """Every registered path, sorted."""
    return sorted(_tasks)


def discover(modules: Iterable[str] = ()) -> None:
    """Import the ``tasks`` module of every installed app, then ``modules`` (names from the
    server's settings), so that their ``@task`` functions register."""
    autodiscover_modules("tasks")
    for name in modules:
        importlib.import_module(name)
