"""The event-loop agent worker ends failed runs and steps their compensations through its
batcher (issue 29): runs failing at the same time share one ``fail_runs`` statement, and each
unwinding step (begin, finish) one statement for all the runs at that step, each run ending as
the single forms leave it; a refused batch is replayed one item at a time."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import pytest
from django.db import connection

from buzz_delivery.agents.batcher import Batcher, DbPool, operations
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import Finished, LeaseLost, Unwinding, fail_run, journal_call, record_call_result
from buzz_delivery.agents.services import batch as b
from tests import agent_async_handlers as ah
from tests import agent_handlers as h
from tests.agents_support import claim, new_run
from tests.test_agents_aio import in_process, ledger  # noqa: F401  (ledger: the fixture)

pytestmark = pytest.mark.django_db(transaction=True)


def writing_transactions(table: str, community_id, column: str, ids) -> int:
    """How many transactions last wrote these rows (rows one statement wrote share its xmin)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT count(DISTINCT xmin::text) FROM {table} WHERE community_id = %s AND {column} = ANY(%s)",
            [community_id, list(ids)],
        )
        return cursor.fetchone()[0]


def test_runs_failing_together_unwind_in_batches_each_as_the_single_forms_leave_it(community, ledger):  # noqa: F811
    run_ids = [new_run(community.id) for _ in range(12)]
    _, counts = in_process(community, ah.three_calls_then_fails, in_flight=16, connections=1)

    assert counts["compensated"] == 12 and not counts.get("batch_replays"), counts
    runs = AgentRun.objects.filter(id__in=run_ids)
    assert {(r.state, r.failure_code, r.failure_message) for r in runs} == {
        ("failed", "handler_error", "RuntimeError: the model gave up")
    }
    entries = JournalEntry.objects.filter(run_id__in=run_ids)
    assert entries.count() == 36
    assert set(entries.values_list("status", "compensation_status")) == {("succeeded", "compensated")}
    undone = [line for line in h.ledger_lines() if line.startswith("undo ")]
    for run_id in run_ids:  # each run's three, last first, once each
        assert [u for u in undone if u.startswith(f"undo {run_id}:")] == [
            f"undo {run_id}:{seq}:compensate" for seq in (3, 2, 1)
        ]
    # Batched: one at a time, each entry's compensation and each run's end is its own transaction.
    table = JournalEntry._meta.db_table
    assert writing_transactions(table, community.id, "run_id", run_ids) <= 36 // 3
    assert writing_transactions(AgentRun._meta.db_table, community.id, "id", run_ids) <= 12 // 2


def test_a_refused_fail_batch_is_replayed_one_run_at_a_time_each_outcome_as_fail_runs(community):
    """A batch ``fail_runs`` refuses (here: a lease of another community in the group) is
    replayed one item at a time: the good runs fail as fail_run fails them, the bad item alone
    gets the single form's answer."""
    plain, with_calls, twin = (new_run(community.id) for _ in range(3))
    leases = {run_id: claim(community.id, run_id) for run_id in (plain, with_calls, twin)}
    for lease in (leases[with_calls], leases[twin]):
        for _ in (1, 2):
            seq = journal_call(lease, "t", {"n": 1}, compensation={"function": "m:undo"}).seq
            record_call_result(lease, seq, ok=True, output={"n": 1})
    expected_twin = fail_run(leases[twin], "handler_error", "x")
    foreign = dataclasses.replace(leases[plain], community_id=uuid.uuid4())

    async def scenario():
        pool = DbPool(1)
        batcher = Batcher(pool, operations(15))
        batcher.start()
        try:
            return await asyncio.gather(
                batcher.submit("fail", community.id, plain, b.prepare_failure(leases[plain], "handler_error", "x")),
                batcher.submit(
                    "fail", community.id, with_calls, b.prepare_failure(leases[with_calls], "handler_error", "x")
                ),
                batcher.submit("fail", community.id, uuid.uuid4(), b.prepare_failure(foreign, "handler_error", "x")),
            ), batcher.replays
        finally:
            await batcher.close()
            await asyncio.get_running_loop().run_in_executor(None, pool.close)

    outcomes, replays = asyncio.run(scenario())
    assert replays == 3
    assert outcomes == [Finished("failed"), expected_twin, LeaseLost()]
    assert expected_twin == Unwinding((2, 1))
    assert AgentRun.objects.get(id=plain).state == "failed"
