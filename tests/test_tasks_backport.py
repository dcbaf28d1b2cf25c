"""The ``django-tasks`` backport on Django 5.2: the example project installs it (the ``project``
extra), and where it is missing while ``buzz_delivery.tasks`` is installed, ``manage.py check``
says so (``buzz_tasks.E001``, naming the fix) and ``run_task_worker`` fails in one line instead
of a ``ModuleNotFoundError`` traceback (found in a new-user trial: README's ``.[project]``
lacked the extra)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from importlib.util import find_spec
from pathlib import Path

import django
import pytest
from django.conf import settings
from django.core import checks as django_checks
from django.db import connection

from buzz_delivery.tasks import checks
from project.database_url import database_url

ROOT = Path(__file__).resolve().parent.parent
BEFORE_DJANGO_6 = django.VERSION < (6, 0)


def test_the_project_extra_brings_the_extra_of_every_app_the_example_project_installs():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = {app.rpartition(".")[2] for app in settings.INSTALLED_APPS if app.startswith("buzz_delivery.")}
    wanted &= set(extras)  # the apps that have an extra of their own: gateway, tasks
    brought = {
        extra.strip()
        for requirement in extras["project"]
        if requirement.startswith("buzz-delivery[")
        for extra in requirement.partition("[")[2].rstrip("]").split(",")
    }
    assert {"gateway", "tasks"} <= wanted
    assert wanted <= brought


def test_the_check_reports_a_missing_backport_before_django_6_only(monkeypatch):
    if find_spec("django_tasks") is not None:  # installed (the test extra brings it): no error
        assert checks.check_tasks_framework(django_version=(5, 2, 19, "final", 0)) == []
    monkeypatch.setitem(sys.modules, "django_tasks", None)  # as if the backport were not installed

    errors = checks.check_tasks_framework(django_version=(5, 2, 19, "final", 0))
    assert [e.id for e in errors] == ["buzz_tasks.E001"]
    assert "Django 5.2 has no django.tasks" in errors[0].msg
    assert "pip install 'buzz-delivery[tasks]'" in errors[0].hint
    # Django 6 has django.tasks: the backport is never needed there.
    assert checks.check_tasks_framework(django_version=(6, 0, 0, "final", 0)) == []


def test_the_check_is_registered_by_the_app(monkeypatch):
    monkeypatch.setattr(checks, "backport_missing", lambda django_version=None: True)
    assert "buzz_tasks.E001" in [m.id for m in django_checks.run_checks()]


# manage.py in a real process, as if the backport were not installed.
WITHOUT_BACKPORT = textwrap.dedent(
    """
    import sys
    sys.modules["django_tasks"] = None
    from django.core.management import execute_from_command_line
    execute_from_command_line(["manage.py", *sys.argv[1:]])
    """
)


def manage_without_backport(*args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": "project.settings",
    }
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_BACKPORT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(not BEFORE_DJANGO_6, reason="Django 6 has django.tasks: no backport to miss")
def test_without_the_backport_check_fails_and_the_worker_says_what_to_install_in_one_line():
    checked = manage_without_backport("check")
    assert checked.returncode == 1
    assert "buzz_tasks.E001" in checked.stderr and "pip install 'buzz-delivery[tasks]'" in checked.stderr

    helped = manage_without_backport("run_task_worker", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "--max-tasks" in helped.stdout

    started = manage_without_backport("run_task_worker", "--max-tasks", "1", "--skip-checks")
    assert started.returncode == 2
    assert "Traceback" not in started.stderr
    assert started.stderr.strip() == (
        "CommandError: No module named 'django_tasks': on Django 5.2 install the tasks extra: "
        "pip install 'buzz-delivery[tasks]'"
    )
