"""Citus: an agent-run claim under concurrency limits (the community's claim lock, then the claim:
one transaction) whose worker connection is lost before its COMMIT (the worker restarted, its
backend terminated) fails the COMMIT with ``XX000`` ("could not commit transaction for shard N on
at least one active node"), psycopg's ``InternalError``. The services raise it as the
``OperationalError`` of a lost connection (nothing was kept), which the worker loops treat as the
database unavailable for a moment (retried next poll): as an ``InternalError`` it was an internal
error of ``run_agent_worker``'s loop, which stopped the worker (exit 1).

The real fault, timed: the worker nodes' backends are terminated right before the claim's COMMIT."""

from __future__ import annotations

from unittest import mock

import psycopg
import pytest
from django.db import connection
from django.test import override_settings

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import claim_agent_runs
from buzz_delivery.testing import CommunityFactory
from buzz_delivery.worker.renewer import DB_UNAVAILABLE
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


def test_a_limited_claim_whose_commit_lost_a_worker_raises_the_database_unavailable():
    community = CommunityFactory()
    run_id = new_run(community.id)
    commit = connection._commit
    armed = [True]

    def lose_the_workers_then_commit():  # the claim's last statement ran: before its COMMIT
        if armed:
            armed.clear()
            _terminate_worker_backends()
        return commit()

    raised: BaseException | None = None
    with override_settings(BUZZ_DELIVERY={"AGENT_CONCURRENCY_LIMITS": {"community": 5}}):
        with mock.patch.object(connection, "_commit", lose_the_workers_then_commit):
            try:
                claim_agent_runs(community.id, [AGENT], worker_id="w1", lease_seconds=30)
            except Exception as exc:
                raised = exc
        connection.close()  # this session met the lost node: a fresh one from here
        assert not armed  # the claim committed a transaction (the limits' form)
        assert isinstance(raised, DB_UNAVAILABLE), f"{type(raised).__name__}: {raised}"
        assert AgentRun.objects.get(id=run_id).state == "pending"  # nothing kept
        (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w1", lease_seconds=30)  # next poll
        assert claimed.lease.run_id == run_id
