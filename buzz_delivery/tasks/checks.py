"""System checks of ``buzz_delivery.tasks`` (``manage.py check``), registered by the app's
``ready()``:

- ``buzz_tasks.E001``: the app is installed on Django 5.2 (no ``django.tasks``) without the
  ``django-tasks`` backport (module ``django_tasks``), which every module of the app but its
  models and admin imports: the backend and ``run_task_worker`` would fail.

- ``buzz_delivery.E101``/``E102``: a ``DeliveryBackend`` of ``TASKS`` whose ``OPTIONS`` are
  unusable, or whose queue shares its target with another backend of its community
  (:meth:`~buzz_delivery.tasks.backend.DeliveryBackend.configuration_errors`). Here, not in the
  backend's ``check()``: Django calls that only where ``django.tasks`` is imported (on 5.2,
  where the ``django_tasks`` app is installed, which this app does not ask for).

- ``buzz_delivery.W103``: a ``DeliveryBackend``'s ``OPTIONS["COMMUNITY"]`` names no community
  (its ``enqueue`` would raise ``ImproperlyConfigured``). A database check, as Django's own and
  ``W020``: only ``manage.py check --database default`` (and ``migrate``) run it, so a plain
  ``manage.py check`` needs no database; a database that cannot be read skips it silently.

This module imports neither framework at its top, so the checks run where the backport is
missing (the backends' check is then skipped: E001 says what is wrong)."""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

import django
from django.conf import settings
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


@checks.register()
def check_delivery_backends(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``buzz_delivery.E101``/``E102`` of every ``DeliveryBackend`` in ``TASKS``."""
    if backport_missing():
        return []
    from buzz_delivery.tasks.backend import DeliveryBackend
    from buzz_delivery.tasks.compat import task_backends

    errors: list[checks.CheckMessage] = []
    for alias in getattr(settings, "TASKS", None) or {}:
        try:
            backend = task_backends[alias]
        except Exception:  # a backend that cannot be built: the framework's error
            continue
        if isinstance(backend, DeliveryBackend):
            errors.extend(backend.configuration_errors())
    return errors


@checks.register(checks.Tags.database)
def check_delivery_backend_communities(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """``buzz_delivery.W103`` for each ``DeliveryBackend`` whose community does not exist (one
    read for them all, :func:`~buzz_delivery.services.missing_communities`)."""
    if not databases or "default" not in databases or backport_missing():
        return []
    from django.db import DatabaseError

    from buzz_delivery.services import missing_communities
    from buzz_delivery.tasks.backend import _delivery_backends

    backends = _delivery_backends()  # those whose OPTIONS are usable (E101 reports the others)
    try:
        missing = set(missing_communities([b.community_id for b in backends]))
    except DatabaseError:  # no database yet, or no tables yet (migrate's own check)
        return []
    return [
        checks.Warning(
            backend.no_such_community(),
            hint="Create the community before the first enqueue (a data migration, or "
            "Community.objects.get_or_create(id=...)); run_task_worker waits for it.",
            id="buzz_delivery.W103",
        )
        for backend in backends
        if backend.community_id in missing
    ]
