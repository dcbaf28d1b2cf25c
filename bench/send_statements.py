"""Statements an orchestrator runs per ``send_message`` step: ``python -m bench.send_statements [N]``.

Starts N one-step runs (a send_message to 2 targets) in a new community of the database
``DATABASE_URL`` names (migrated), runs one orchestrator in this process (concurrency 4) until
idle, and prints the statements it sent per step (every cursor ``execute`` counted, its claims
included) and the database's commits per step (``pg_stat_database``, after a pause for the
statistics to arrive: 11 s before and after). An A/B: run it from each tree (``PYTHONPATH``) on its own database.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import django
import psycopg

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")


def commits(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()[0]


def main() -> None:
    django.setup()
    from buzz_delivery.services import Cause
    from buzz_delivery.testing import CommunityFactory, WorkflowFactory, random32
    from buzz_delivery.workflows.orchestrator import OrchestratorConfig, run_orchestrator
    from buzz_delivery.workflows.services import publish_definition, start_run

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    community = CommunityFactory()
    workflow = WorkflowFactory(community=community)
    step = {"key": "send", "kind": "send_message", "targets": [random32().hex(), random32().hex()], "content": "c"}
    version = publish_definition(community.id, workflow.id, {"steps": [step]})
    for _ in range(n):
        start_run(community.id, workflow.id, {}, cause=Cause.event(os.urandom(32)), version=version.version)
    lock = threading.Lock()
    sent = [0]
    execute = psycopg.Cursor.execute

    def counted(self: psycopg.Cursor, *args: object, **kwargs: object) -> psycopg.Cursor:
        with lock:
            sent[0] += 1
        return execute(self, *args, **kwargs)  # type: ignore[arg-type]

    psycopg.Cursor.execute = counted  # type: ignore[method-assign]
    url = os.environ["DATABASE_URL"]
    time.sleep(11.0)  # an idle backend reports its statistics within 10 s
    before, first = commits(url), sent[0]
    summary = run_orchestrator(
        OrchestratorConfig(community_id=community.id, concurrency=4, idle_exit=1.0, poll_interval=0.5),
        handle_signals=False,
    )
    statements = sent[0] - first
    time.sleep(11.0)  # an idle backend reports its statistics within 10 s
    print(
        f"steps={n} waiting={summary['waiting']} statements/step={statements / n:.2f} "
        f"commits/step={(commits(url) - before) / n:.2f} send_transactions={summary.get('send_statements')}"
    )


if __name__ == "__main__":
    main()
