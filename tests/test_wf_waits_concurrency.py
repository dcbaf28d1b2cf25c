"""Engine waits under real concurrency (issue 33): real threads on their own connections.

- one event sent by 8 threads at once to 50 waiting runs resumes each exactly once;
- 8 threads sending the 50 keys of 50 runs in different orders resume each once, deadlock-free;
- waits starting while their events are sent are never left waiting (the send and the wait meet
  on the event's row);
- a cancel racing an event leaves each step ended once (an audit trigger counts every terminal
  move of every step).
"""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest
from django.db import connection, connections

from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows import executor
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.services import cancel_run, claim_steps, send_event
from buzz_delivery.workflows.testing import run_until_idle
from tests.citus_support import CITUS_MODE
from tests.conftest import BARRIER_TIMEOUT
from tests.wf_support import start

pytestmark = pytest.mark.django_db(transaction=True)
TERMINAL = ["succeeded", "failed", "skipped", "canceled"]

# One statement per execute (Citus propagates DDL one statement at a time). On the cluster the
# audit table is distributed beside the steps, by community, so the trigger on a step's shard
# writes to the audit shard on the same node.
AUDIT = [
    "CREATE TABLE IF NOT EXISTS wait_step_audit (community_id uuid NOT NULL, step_id uuid NOT NULL,"
    " old_state text NOT NULL, new_state text NOT NULL)",
    *(
        ["SELECT create_distributed_table('wait_step_audit', 'community_id', colocate_with => 'buzz_workflows_step')"]
        if CITUS_MODE
        else []
    ),
    """CREATE OR REPLACE FUNCTION wait_step_audit() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    INSERT INTO wait_step_audit VALUES (NEW.community_id, NEW.id, OLD.state, NEW.state);
    RETURN NULL;
END;
$$""",
    "DROP TRIGGER IF EXISTS wait_step_audit ON buzz_workflows_step",
    "CREATE TRIGGER wait_step_audit AFTER UPDATE OF state ON buzz_workflows_step"
    " FOR EACH ROW WHEN (NEW.state IS DISTINCT FROM OLD.state) EXECUTE FUNCTION wait_step_audit()",
]
DROP_AUDIT = [
    "DROP TRIGGER IF EXISTS wait_step_audit ON buzz_workflows_step",
    "DROP FUNCTION IF EXISTS wait_step_audit()",
    "DROP TABLE IF EXISTS wait_step_audit",
]


@pytest.fixture
def audit():
    """Every state change of a step, whatever moved it; yields how often each became terminal."""
    with connection.cursor() as cursor:
        for statement in AUDIT:
            cursor.execute(statement)

    def terminal_moves() -> dict:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT step_id, count(*) FILTER (WHERE new_state = ANY(%(t)s)),"
                " count(*) FILTER (WHERE old_state = ANY(%(t)s)) FROM wait_step_audit GROUP BY step_id",
                {"t": TERMINAL},
            )
            return {row[0]: row[1:] for row in cursor.fetchall()}

    yield terminal_moves
    with connection.cursor() as cursor:
        for statement in DROP_AUDIT:
            cursor.execute(statement)


def in_threads(n: int, target) -> list:
    barrier = threading.Barrier(n, timeout=BARRIER_TIMEOUT)
    results: list = [None] * n
    errors: list = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            results[i] = target(i)
        except Exception as exc:  # reported below: a thread's failure fails the test
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def waiting_runs(community, n: int, key) -> list[Run]:
    workflow = WorkflowFactory(community=community)
    definition = {"steps": [{"key": "paid", "kind": "wait_event", "event": "payment", "event_key": key}]}
    runs = [start(workflow, definition, {"i": i}) for i in range(n)]
    run_until_idle(community.id)
    assert Step.objects.filter(community_id=community.id, key="paid", state="waiting").count() == n
    return runs


def test_one_event_sent_by_8_threads_at_once_resumes_each_of_50_waiting_runs_exactly_once(community, audit):
    runs = waiting_runs(community, 50, "order-1")

    results = in_threads(8, lambda i: send_event(community.id, "payment", "order-1", {"sender": i}).resumed)

    assert sorted(results) == [0] * 7 + [50]  # the first send resumed every step; the others none
    steps = Step.objects.filter(community_id=community.id, key="paid")
    assert {s.state for s in steps} == {"succeeded"}
    assert len({s.output["sender"] for s in steps}) == 1
    assert all([e["event"] for e in s.history].count("event") == 1 for s in steps)
    moves = audit()
    assert all(moves[s.id] == (1, 0) for s in steps)  # terminal once, never left
    assert {r.state for r in Run.objects.filter(pk__in=[r.pk for r in runs])} == {"succeeded"}


def test_8_threads_sending_50_keys_in_different_orders_resume_each_run_once(community, audit):
    runs = waiting_runs(community, 50, {"$ref": "input.i"})

    def send_all(i: int) -> int:
        keys = list(range(50))
        random.Random(i).shuffle(keys)
        return sum(send_event(community.id, "payment", str(k), {"sender": i}).resumed for k in keys)

    assert sum(in_threads(8, send_all)) == 50
    moves = audit()
    for run in runs:
        step = Step.objects.get(run_id=run.pk, key="paid")
        assert step.state == "succeeded" and moves[step.id] == (1, 0)


def test_waits_starting_while_their_events_are_sent_are_never_left_waiting(community, audit):
    workflow = WorkflowFactory(community=community)
    definition = {
        "steps": [{"key": "paid", "kind": "wait_event", "event": "payment", "event_key": {"$ref": "input.i"}}]
    }
    runs = [start(workflow, definition, {"i": i}) for i in range(40)]
    claims = claim_steps(community.id, limit=100, lease_seconds=120)
    assert len(claims) == 40
    random.Random(7).shuffle(claims)

    def work(i: int) -> None:
        if i < 4:  # the holders park their steps (or take a kept event)
            for claim in claims[i::4]:
                executor.execute(claim)
        else:  # senders, each key once, in their own order
            keys = list(range(i - 4, 40, 4))
            random.Random(i).shuffle(keys)
            for k in keys:
                send_event(community.id, "payment", str(k), {"k": k})

    in_threads(8, work)

    moves = audit()
    for run in runs:
        step = Step.objects.get(run_id=run.pk, key="paid")
        assert (step.state, step.output) == ("succeeded", {"k": run.input["i"]})
        assert moves[step.id] == (1, 0)


def test_a_cancel_racing_an_event_leaves_each_step_ended_once(community, audit):
    runs = waiting_runs(community, 50, {"$ref": "input.i"})
    rounds = threading.Barrier(2, timeout=BARRIER_TIMEOUT)  # each run: the cancel and the send let go at once

    def race(i: int) -> None:
        for k, run in enumerate(runs):
            rounds.wait()
            if i:
                cancel_run(community.id, run.pk)
            else:
                send_event(community.id, "payment", str(k), {"k": k})

    in_threads(2, race)

    moves = audit()
    outcomes = Counter()
    for run in runs:
        step = Step.objects.get(run_id=run.pk, key="paid")
        row = Run.objects.get(pk=run.pk)
        assert moves[step.id] == (1, 0), (step.state, moves[step.id])
        assert row.steps_left == 0
        if step.state == "succeeded":  # the event came first and ended the run; the cancel found it ended
            assert step.output == {"k": run.input["i"]} and row.state == "succeeded"
        else:  # the cancel came first; the event found nothing waiting
            assert (step.state, row.state) == ("canceled", "canceled")
        outcomes[step.state] += 1
    print(f"\nevent first / cancel first: {dict(outcomes)}")
