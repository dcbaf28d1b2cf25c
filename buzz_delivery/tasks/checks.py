"""System checks of ``buzz_delivery.tasks`` (``manage.py check``), registered by the app's
``ready()``:

- ``buzz_tasks.E001``: the app is installed on Django 5.2 (no ``django.tasks``) without the
  ``django-tasks`` backport (module ``django_tasks``), which every module of the app but its
  models and admin imports: the backend and ``run_task_worker`` would fail.

This module imports neither framework, so the check runs where the backport is missing."""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

import django
from django.core import checks

# The fix, as examples/background_tasks.py words it (an installed package: no "-e .").
INSTALL_HINT = "on Django 5.2 install the tasks extra: pip install 'buzz-delivery[tasks]'"


def backport_missing(django_version: tuple[Any, ...] | None = None) -> bool:
    """Whether Django's Tasks framework is missing: Django before 6 has no ``django.tasks``, and
    the ``django_tasks`` backport cannot be found (``django_version``: ``django.VERSION``)."""
    version = django.VERSION if django_version is None else django_version
    return tuple(version[:2]) < (6, 0) and find_spec("django_tasks") is None


@checks.register(checks.Tags.compatibility)
def check_tasks_framework(
    app_configs: Any = None, *, django_version: tuple[Any, ...] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """``buzz_tasks.E001`` when :func:`backport_missing`."""
    if not backport_missing(django_version):
        return []
    version = django.VERSION if django_version is None else django_version
    return [
        checks.Error(
            f"buzz_delivery.tasks is installed, but Django {version[0]}.{version[1]} has no django.tasks and "
            "the django-tasks backport (module django_tasks) is not installed.",
            hint=INSTALL_HINT[0].upper() + INSTALL_HINT[1:] + ".",
            id="buzz_tasks.E001",
        )
    ]
