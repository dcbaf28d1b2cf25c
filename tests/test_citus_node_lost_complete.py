"""Citus: the in-process runtime's ``complete_run`` whose COMMIT lost a worker's connection (the
worker restarted, its backend terminated: ``XX000`` "could not commit transaction for shard N on
at least one active node", an ``InternalError``; the transaction rolled back) is tried once more
on a fresh connection, as a lost connection's ``OperationalError`` is: before, the run was
``lost`` with its handler done, its lease left to lapse and an attempt counted (on its last:
``failed``/``attempts_exhausted``, its calls compensated) for a passing fault.

The real fault, timed: the worker nodes' backends are terminated right before the completion's COMMIT."""

from __future__ import annotations

from unittest import mock

import psycopg
import pytest
from django.db import connection

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import claim_agent_runs
from buzz_delivery.agents.services import sql as agent_sql
from buzz_delivery.testing import CommunityFactory
from project.database_url import database_url
from tests.agents_support import AGENT, new_run
from tests.citus_support import CITUS_MODE, with_database, worker_urls

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CITUS_MODE, reason="a Citus coordinator's COMMIT failing for a lost worker connection"),
]


def _terminate_worker_backends() -> None:
    name = connection.settings_dict["NAME"]
    for url in worker_urls(database_url(connection.settings_dict)):
        with psycopg.connect(with_database(url, name), autocommit=True) as worker:
            worker.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            )


def test_a_completion_whose_commit_lost_a_worker_is_tried_again_not_the_run_lost():
    community = CommunityFactory()
    run_id = new_run(community.id)
    (claim,) = claim_agent_runs(community.id, [AGENT], worker_id="w1", lease_seconds=60)
    commit = connection._commit
    completing: list[str] = []
    injected: list[str] = []

    def note_the_completion(execute, sql, params, many, context):
        if agent_sql.COMPLETE_IF_CURRENT.strip()[:60] in sql:
            completing.append(sql)
        return execute(sql, params, many, context)

    def lose_the_workers_then_commit():  # the first completion's statement ran: before its COMMIT
        if completing and not injected:
            injected.append("lost")
            _terminate_worker_backends()
        return commit()

    with (
        connection.execute_wrapper(note_the_completion),
        mock.patch.object(connection, "_commit", lose_the_workers_then_commit),
    ):
        result = run_claim(claim, lambda ctx: {"ok": True})
    connection.close()  # this session met the lost node: a fresh one from here

    assert injected == ["lost"]  # the fault was met
    assert result == "completed"
    assert len(completing) == 2  # the completion, then once more on a fresh connection
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.output) == ("completed", {"ok": True})
