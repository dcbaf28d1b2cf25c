"""Django settings of the benchmark processes: the example project's, plus django-tasks-db
(a peer of the ``peers`` scenario) when the ``bench`` extra installed it."""

from __future__ import annotations

from importlib.util import find_spec

from project.settings import *  # noqa: F403
from project.settings import DATABASES, INSTALLED_APPS

# Worker processes keep their connections (django-tasks-db's loop calls close_old_connections()
# before every job: with the default CONN_MAX_AGE = 0 it would connect once per job).
for _db in DATABASES.values():
    _db["CONN_MAX_AGE"] = None

if find_spec("django_tasks_db") is not None:
    _TASK_APPS = ["django_tasks_db"] if find_spec("django.tasks") else ["django_tasks", "django_tasks_db"]
    INSTALLED_APPS = [*INSTALLED_APPS, *_TASK_APPS]
    TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend", "QUEUES": ["default"]}}
