"""run_task_worker on a backend that is not ours says which setting to write (a newcomer's
project with ``buzz_delivery.tasks`` installed and no ``TASKS`` met a bare 'is not a
DeliveryBackend')."""

from __future__ import annotations

from importlib.util import find_spec

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

# Django 6.x's own, or the django-tasks backport's on 5.2
IMMEDIATE = f"{'django.tasks' if find_spec('django.tasks') else 'django_tasks'}.backends.immediate.ImmediateBackend"


def test_a_backend_not_ours_is_refused_naming_the_setting_to_write():
    with override_settings(TASKS={"default": {"BACKEND": IMMEDIATE}}), pytest.raises(CommandError) as refused:
        call_command("run_task_worker", "--max-tasks", "1")

    assert refused.value.returncode == 2
    message = str(refused.value)
    assert "ImmediateBackend, not a buzz_delivery.tasks.DeliveryBackend" in message
    assert '"BACKEND" to "buzz_delivery.tasks.DeliveryBackend"' in message
    assert 'OPTIONS["COMMUNITY"]' in message
