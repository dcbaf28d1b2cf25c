"""Every batched transition of many runs locks their rows in id order (issue 29, review).

The event-loop worker (and the gateway's batch routes) send a run's heartbeat, journal, result,
completion, failure and compensation steps on different pool connections at once, so two batches
may hold the same runs. ``fail_runs`` locks them in id order (LOCK_RUNS); a statement locking them
in its plan's order (an ``UPDATE ... FROM unnest`` follows the array) could take them the other
way round: a deadlock, ``deadlock_timeout`` of stall, then a retry or a replay. Each batch below
gets its runs in descending id order while another connection holds the higher run's row: it must
wait there holding the lower one already (locked first), not holding nothing (the higher first).
The statements other than ``fail_runs`` failed this test before they locked ``ORDER BY r.id``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction

from buzz_delivery.agents.services import batch as b
from buzz_delivery.agents.services import begin_compensation, fail_run, journal_call, record_call_result
from buzz_delivery.agents.services.types import AgentLease
from tests.agents_support import claim, new_run
from tests.citus_support import waits_for_a_row_lock

pytestmark = pytest.mark.django_db(transaction=True)
UNDO = {"function": "m:undo"}
# Whatever the plan: here the runs are read in their heap's order, not their index's.
PLAN_BY_HEAP = "SET enable_indexscan = off; SET enable_bitmapscan = off; SET enable_indexonlyscan = off"
LOCK = "SELECT id FROM buzz_agents_run WHERE community_id = %s AND id = %s FOR NO KEY UPDATE"


def _with_call(lease: AgentLease, *, recorded: bool) -> None:
    seq = journal_call(lease, "t", {"n": 1}, compensation=UNDO).seq
    if recorded:
        record_call_result(lease, seq, ok=True, output={"n": 1})


def _unwinding(lease: AgentLease, *, begun: bool) -> None:
    _with_call(lease, recorded=True)
    assert fail_run(lease, "handler_error", "x").seqs == (1,)
    if begun:
        assert isinstance(begin_compensation(lease, 1), dict)


# op -> (set a claimed run up, its item, the batch, the outcome type expected for each run)
OPS: dict[str, tuple[Callable[[AgentLease], None], Callable[[AgentLease], Any], Callable[..., list], type]] = {
    "heartbeat_runs": (lambda lease: None, lambda lease: lease, b.heartbeat_runs, b.Renewed),
    "journal_calls": (
        lambda lease: None,
        lambda lease: b.prepare_call(lease, "t", {"n": 1}),
        b.journal_calls,
        b.Journaled,
    ),
    "record_results": (
        lambda lease: _with_call(lease, recorded=False),
        lambda lease: b.prepare_result(lease, 1, ok=True, output={"n": 1}),
        b.record_results,
        b.Recorded,
    ),
    "complete_runs": (
        lambda lease: None,
        lambda lease: b.prepare_completion(lease, {"n": 1}),
        b.complete_runs,
        b.Finished,
    ),
    "fail_runs": (
        lambda lease: None,
        lambda lease: b.prepare_failure(lease, "handler_error", "x"),
        b.fail_runs,
        b.Finished,
    ),
    "begin_compensations": (
        lambda lease: _unwinding(lease, begun=False),
        lambda lease: b.prepare_compensation_begin(lease, 1),
        b.begin_compensations,
        dict,
    ),
    "finish_compensations": (
        lambda lease: _unwinding(lease, begun=True),
        lambda lease: b.prepare_compensation_finish(lease, 1, ok=True),
        b.finish_compensations,
        b.Recorded,
    ),
}


def _holds(community_id: Any, run_id: Any) -> bool:
    """Whether another transaction holds ``run_id``'s row (a NOWAIT lock of it is refused)."""
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(LOCK + " NOWAIT", [community_id, run_id])
    except OperationalError as exc:
        assert "lock" in str(exc), exc
        return True
    return False


@pytest.mark.parametrize("op", list(OPS))
def test_a_batch_locks_its_runs_in_id_order_whatever_the_order_of_its_items(community, op):
    setup, item, send, expected = OPS[op]
    leases = [claim(community.id, new_run(community.id)) for _ in range(2)]
    low, high = sorted(leases, key=lambda lease: lease.run_id)
    for lease in (low, high):
        setup(lease)
    items = [item(high), item(low)]  # descending id order
    with connection.cursor() as cursor:  # and the lower run's row after the higher's in the heap
        cursor.execute(
            "UPDATE buzz_agents_run SET renewals = renewals WHERE community_id = %s AND id = %s",
            [community.id, low.run_id],
        )

    holding, release = threading.Event(), threading.Event()
    pid: list[int] = []
    outcome: list[Any] = []

    def holder() -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(LOCK, [community.id, high.run_id])
                holding.set()
                release.wait(60)
        finally:
            connections.close_all()

    def batcher() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                pid.append(cursor.fetchone()[0])
                cursor.execute(PLAN_BY_HEAP)
            outcome.append(send(community.id, items))
        finally:
            connections.close_all()

    h = threading.Thread(target=holder)
    h.start()
    assert holding.wait(60)
    t = threading.Thread(target=batcher)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not (pid and waits_for_a_row_lock(pid[0], "%buzz_agents_run%")):
            assert t.is_alive() and time.monotonic() < deadline, f"{op} never waited for the held run"
            time.sleep(0.01)
        held_low = _holds(community.id, low.run_id)
    finally:
        release.set()
        h.join(60)
        t.join(60)
    assert held_low, f"{op} took the higher run first (plan order): it can deadlock with fail_runs"
    assert [type(o) for o in outcome[0]] == [expected, expected], outcome
