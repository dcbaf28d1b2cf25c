"""Django's own Tasks framework on the inbox: ``@task`` functions enqueued from your code become
deliveries (fenced leases, exactly-once settle, the reaper, the admin), run by
``manage.py run_task_worker``. Run it against a migrated database of the example project, whose
settings already point ``TASKS`` at ``buzz_delivery.tasks.DeliveryBackend``::

    python examples/background_tasks.py            # the embedded server under var/pgdata
    DATABASE_URL=postgres://... python examples/background_tasks.py

On Django 5.2 it needs the ``tasks`` extra (the ``django-tasks`` backport; Django 6 has
``django.tasks``): ``.venv/bin/pip install -e '.[tasks]'`` (the ``test`` extra includes it). In your
project the ``@task`` functions go in an app's ``tasks.py`` (the worker imports those at start; a
stored task path is never imported). Docs: docs/tasks.md.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a standalone script: set Django up (a project's own module needs none of this)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()

from django.conf import settings
from django.core.management import call_command

from buzz_delivery.models import Community

try:
    from buzz_delivery.tasks.compat import task_backends  # noqa: F401  (Django 6's django.tasks, or the backport)
except ImportError as missing:
    sys.exit(f"{missing}: on Django 5.2 install the tasks extra: pip install -e '.[tasks]'")

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the django-tasks backport (the `tasks` extra)
    from django_tasks import task  # type: ignore[no-redef]


@task
def add(a: int, b: int) -> int:
    return a + b


@task(queue_name="emails")
def welcome(email: str) -> str:
    return f"sent a welcome to {email}"


def main() -> dict[str, Any]:
    # The backend's tenant: every task is a delivery of this community (OPTIONS["COMMUNITY"]).
    Community.objects.get_or_create(id=settings.TASKS["default"]["OPTIONS"]["COMMUNITY"])
    sum_result = add.enqueue(2, 3)
    mail_result = welcome.enqueue("ada@example.com")
    print(f"enqueued: {sum_result.status}, {mail_result.status}")

    # `python manage.py run_task_worker --idle-exit 1`: every queue of the backend, until idle.
    summary = io.StringIO()
    call_command("run_task_worker", "--idle-exit", "1", "--poll-interval", "0.2", stdout=summary)

    sum_result.refresh()
    mail_result.refresh()
    print(f"add(2, 3): {sum_result.status} -> {sum_result.return_value}")
    print(f"welcome: {mail_result.status} -> {mail_result.return_value!r}")
    return {"statuses": [str(sum_result.status), str(mail_result.status)], "sum": sum_result.return_value}


if __name__ == "__main__":
    main()
