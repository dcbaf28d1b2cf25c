"""The project's settings without ``buzz_delivery.tasks``: a deployment that installs that app
later (``tests/test_delivery_view.py``)."""

from project.settings import *  # noqa: F403

INSTALLED_APPS = [app for app in INSTALLED_APPS if app != "buzz_delivery.tasks"]  # noqa: F405
TASKS = {"default": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"}}
