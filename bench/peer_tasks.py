"""The no-op jobs of the peer queues (module level, so every worker process can import them)."""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

if find_spec("django.tasks"):
    from django.tasks import task
else:
    from django_tasks import task


@task()
def noop_task() -> None:
    """django-tasks-db's no-op job."""
    return None


def procrastinate_app(url: str) -> Any:
    """A procrastinate app on ``url`` with the no-op task ``bench_noop`` on queue ``bench``."""
    from procrastinate import App, PsycopgConnector

    app = App(connector=PsycopgConnector(conninfo=url))

    @app.task(queue="bench", name="bench_noop")
    def bench_noop() -> None:
        return None

    return app
