"""A journal read that fails with an error that is not of the connection (here a real
``DataError``: a journal row whose ``created_at`` is ``infinity``, which no Python datetime holds)
leaves that one run to its lease (``lost``) and the threaded worker goes on with the next run, as
the event-loop worker does. Before, the error left ``AgentWorker._context`` (which retried only
the "database unavailable" errors), ended the loop thread and stopped the worker
(``internal_errors`` 1, the other run never run).

(A ``statement_timeout`` is no such error: psycopg's ``QueryCanceled`` is an ``OperationalError``,
so the read is retried as a connection failure and then left to its lease, already.)"""

from __future__ import annotations

import pytest
from django.db import connection

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig
from tests.agents_support import AGENT
from tests.test_agents_aio_journal_read import MADE, fetch, resumed_runs

pytestmark = pytest.mark.django_db(transaction=True)


def handler(ctx):
    first = ctx.call("fetch", fetch, {"q": 1})  # replayed from the journal
    return {"pages": [first["page"], ctx.call("fetch", fetch, {"q": 2})["page"]]}


def test_a_journal_read_error_of_one_run_leaves_that_run_to_its_lease_and_the_worker_goes_on(community):
    MADE.clear()
    bad, good = resumed_runs(community.id, n=2)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_agents_journal SET created_at = 'infinity' WHERE community_id = %s AND run_id = %s",
            [community.id, bad],
        )
    worker = AgentWorker(
        WorkerConfig(
            handler=handler,
            agents=[AGENT],
            communities=[community.id],
            exit_when_idle=True,
            poll_seconds=0.1,
            worker_id="read-error",
            listen=False,
            accept=False,
            concurrency=1,
        )
    )
    counts = worker.run()
    assert counts.get("internal_errors", 0) == 0, counts
    assert (counts.get("lost"), counts.get("completed")) == (1, 1), counts
    states = dict(AgentRun.objects.filter(id__in=[bad, good]).values_list("id", "state"))
    assert states == {bad: "running", good: "completed"}  # the bad one: held until its lease lapses
