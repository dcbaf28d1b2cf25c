"""A ``django.tasks`` backend on the delivery inbox (Django 6.x's ``django.tasks``, or the
``django-tasks`` backport on Django 5.2).

Add ``"buzz_delivery.tasks"`` to ``INSTALLED_APPS`` and configure ``TASKS`` with
``"BACKEND": "buzz_delivery.tasks.DeliveryBackend"`` (see :mod:`buzz_delivery.tasks.backend`);
run the tasks with ``manage.py run_task_worker``. See ``docs/tasks.md``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DeliveryBackend"]


def __getattr__(name: str) -> Any:
    # Lazy: Django imports the backend class by its dotted path, maybe before the apps are ready.
    if name == "DeliveryBackend":
        from buzz_delivery.tasks.backend import DeliveryBackend

        return DeliveryBackend
    raise AttributeError(name)
