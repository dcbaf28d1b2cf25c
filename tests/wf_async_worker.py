"""``manage.py run_workflow_worker ARGS...`` with the async steps of tests/wf_async_steps.py
registered: ``python -m tests.wf_async_worker ARGS...`` (the real command, a real process)."""

from __future__ import annotations

import os
import sys

import django

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    django.setup()
    from django.core.management import execute_from_command_line

    import tests.wf_async_steps  # noqa: F401  (registers the steps)

    execute_from_command_line(["manage.py", "run_workflow_worker", *sys.argv[1:]])
