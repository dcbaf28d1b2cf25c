"""One community's locked rows never let the step leases of another community lapse in an
orchestrator serving every community (``run_workflow_worker --all``; docs/security.md,
docs/workflows.md).

One renewer thread renews the held steps of every community, one statement per community. A
lifecycle move of community A waiting behind a long transaction of A's own code queues every
write of A's rows behind it, A's renewal too: it waits a bounded time, and B's steps are renewed
meanwhile. Waits poll the database for a condition; nothing is timed.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection

from buzz_delivery.testing import CommunityFactory, EventFactory, WorkflowFactory, random32
from buzz_delivery.workflows import workflow_function
from buzz_delivery.workflows.orchestrator import Orchestrator, OrchestratorConfig, _key
from buzz_delivery.workflows.services import claim_steps
from buzz_delivery.workflows.testing import function_step, send_step
from tests.tenant_locks import identity_held
from tests.test_worker import wait_until
from tests.test_worker_tenant_locks import backends_waiting_for_a_lock, move_stuck_behind_a_long_transaction
from tests.wf_support import start

pytestmark = pytest.mark.django_db(transaction=True)


def claimed_step(community_id, key: str):
    start(WorkflowFactory(community_id=community_id), {"steps": [function_step(key)]})
    (claim,) = claim_steps(community_id, limit=10, lease_seconds=30)
    return claim.lease


def test_an_all_communities_orchestrator_renews_the_steps_of_one_community_while_another_is_stuck(community):
    other = CommunityFactory()
    EventFactory(community=community)  # the long transaction below writes it
    a, b = claimed_step(community.id, "a"), claimed_step(other.id, "b")
    orchestrator = Orchestrator(OrchestratorConfig(community_id=None, lease_seconds=30), threading.Event())
    orchestrator.held.update({_key(a): a, _key(b): b})

    def renew_round() -> None:
        try:
            orchestrator._renew_round([a, b])  # A first: an unbounded renewal of A holds up B's
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        with move_stuck_behind_a_long_transaction(community.id) as moving:
            round_done = pool.submit(renew_round)
            wait_until(round_done.done, timeout=30, what="the renewal round while A's move is stuck")
            round_done.result()
            assert orchestrator.held[_key(b)].lease_until > b.lease_until  # B's step was renewed
            assert orchestrator.held[_key(a)] == a  # A's was left for the next round, still held
            assert orchestrator.counts["renewed"] == 1
            assert not moving.done()
        assert moving.result(timeout=30).deletion_state == "quiescing"


def test_only_an_all_communities_orchestrator_bounds_its_renewals(community):
    def bound(community_id):
        return Orchestrator(OrchestratorConfig(community_id=community_id), threading.Event()).renew_lock_wait_ms

    assert bound(community.id) is None
    assert bound(None) is not None


def test_one_locked_step_row_does_not_keep_the_other_steps_of_its_community_from_renewal(community):
    """A long transaction holds one step row of community A: each round's statement of A's
    steps waits past the bound for it. A's other step, whose row nothing holds, is renewed all
    the same: one lease at a time after the statement waited, the held one tried last from the
    round after it waited (so by the second round), as B's is every round."""
    import psycopg

    from buzz_delivery.workflows.models import Step
    from project.database_url import database_url

    other = CommunityFactory()
    a_locked, a_free, b = (
        claimed_step(community.id, "a1"),
        claimed_step(community.id, "a2"),
        claimed_step(other.id, "b"),
    )
    orchestrator = Orchestrator(OrchestratorConfig(community_id=None, lease_seconds=30), threading.Event())
    orchestrator.held.update({_key(a_locked): a_locked, _key(a_free): a_free, _key(b): b})  # the held one first
    holder = psycopg.connect(database_url(connection.settings_dict))
    try:
        holder.execute(
            f"SELECT 1 FROM {Step._meta.db_table} WHERE community_id = %s AND id = %s FOR UPDATE",
            [community.id, a_locked.step_id],
        )
        for _ in range(2):
            orchestrator._renew_round(list(orchestrator.held.values()))
        assert orchestrator.held[_key(a_free)].lease_until > a_free.lease_until
        assert orchestrator.held[_key(b)].lease_until > b.lease_until
        assert orchestrator.held[_key(a_locked)] == a_locked  # still held, renewed once let go
    finally:
        holder.rollback()
        holder.close()


GATES: dict = {}  # step key -> threading.Event its function waits for (none: it returns at once)


@workflow_function("test.tenant_locks.gated")
def gated(input, context):
    gate = GATES.get(context.step_key)
    if gate is not None:
        assert gate.wait(120), "the test never opened the gate"
    return {"key": context.step_key}


def steps_of(run_ids) -> dict:
    from buzz_delivery.workflows.models import Step

    return {
        (row[0], row[1]): row[2:]
        for row in Step.objects.filter(run_id__in=run_ids).values_list(
            "run_id", "key", "state", "attempts", "lease_generation"
        )
    }


def started_run(community_id, *keys: str):
    """A run of ``keys`` in a chain (each depends on the one before), each the gated function."""
    definition = {
        "steps": [
            function_step(k, "test.tenant_locks.gated", **({"depends_on": [keys[i - 1]]} if i else {}))
            for i, k in enumerate(keys)
        ]
    }
    return start(WorkflowFactory(community_id=community_id), definition).pk


def running_all(**options):
    """An ``--all`` orchestrator in a thread: (stop, thread, summary)."""
    from buzz_delivery.workflows.orchestrator import run_orchestrator

    stop, summary = threading.Event(), {}
    config = OrchestratorConfig(community_id=None, lease_seconds=15, poll_interval=0.2, **options)

    def main():
        try:
            summary.update(run_orchestrator(config, stop=stop, handle_signals=False))
        finally:
            connection.close()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return stop, thread, summary


def test_a_lifecycle_move_stuck_in_one_community_keeps_no_claim_of_another_waiting(community):
    """The dispatcher walks A and B: A's claim waits for a lock at most the bound, then A is
    left a while and B's steps (each second step claimed by a walk after the first) are claimed
    and completed meanwhile (without the bound the dispatcher waits behind A's move). Once A's
    move is given up, A's step is claimed and completed, each step once."""
    other = CommunityFactory()
    EventFactory(community=community)  # the long transaction below writes it
    GATES.clear()
    a_run = started_run(community.id, "a1")
    b_runs = [started_run(other.id, "b1", "b2") for _ in range(2)]
    with move_stuck_behind_a_long_transaction(community.id, rolled_back=True) as moving:
        stop, thread, summary = running_all(concurrency=2)
        try:
            wait_until(
                lambda: {v[0] for v in steps_of(b_runs).values()} == {"succeeded"},
                timeout=60,
                what="B's steps to be claimed and completed while A's move is stuck",
            )
            assert not moving.done()
            assert steps_of([a_run]) == {(a_run, "a1"): ("ready", 0, 0)}
        except BaseException:
            stop.set()
            thread.join(timeout=60)
            raise
    moving.result(timeout=30)  # given up: A stays active
    try:
        wait_until(
            lambda: steps_of([a_run]).get((a_run, "a1"), ("",))[0] == "succeeded",
            timeout=60,
            what="A's step to be claimed once A's writes are let go",
        )
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert {v[1:] for v in steps_of([a_run, *b_runs]).values()} == {(1, 1)}  # each claimed once
    assert (summary["succeeded"], summary["errors"], summary["exit_code"]) == (5, 0, 0), summary


def test_a_lifecycle_move_stuck_in_one_community_keeps_no_completion_of_another_waiting(community):
    """A's step and B's step are running; A's move gets stuck, then A's step returns: the
    completer's transaction of A waits for a lock at most the bound, A's output is kept (its
    lease still renewed), and B's step, returning after it, is completed meanwhile (without the
    bound the completer waits behind A's move). Once A's move is given up, A's output is
    recorded, once."""
    other = CommunityFactory()
    EventFactory(community=community)  # the long transaction below writes it
    GATES.clear()
    GATES.update(a1=threading.Event(), b1=threading.Event())
    a_run, b_run = started_run(community.id, "a1"), started_run(other.id, "b1")
    stop, thread, summary = running_all(concurrency=2)
    try:
        wait_until(
            lambda: {v[0] for v in steps_of([a_run, b_run]).values()} == {"running"},
            timeout=60,
            what="both steps to be claimed",
        )
        with move_stuck_behind_a_long_transaction(community.id, rolled_back=True) as moving:
            waiting = backends_waiting_for_a_lock()  # the move
            GATES["a1"].set()  # A's output goes to the completer: its transaction meets the move
            wait_until(
                lambda: backends_waiting_for_a_lock() > waiting,
                timeout=60,
                what="the completer's transaction of A to wait for a lock",
            )
            GATES["b1"].set()
            wait_until(
                lambda: steps_of([b_run])[(b_run, "b1")][0] == "succeeded",
                timeout=60,
                what="B's step to be completed while A's move is stuck",
            )
            assert not moving.done()
            assert steps_of([a_run]) == {(a_run, "a1"): ("running", 1, 1)}
        moving.result(timeout=30)  # given up: A stays active
        wait_until(
            lambda: steps_of([a_run])[(a_run, "a1")][0] == "succeeded",
            timeout=60,
            what="A's output to be recorded once A's writes are let go",
        )
    finally:
        for gate in GATES.values():
            gate.set()
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert {v[1:] for v in steps_of([a_run, b_run]).values()} == {(1, 1)}
    assert (summary["succeeded"], summary["errors"], summary["lease_lost"]) == (2, 0, 0), summary


def waiting_here() -> int:
    """Sessions of this test's database waiting for a lock now (not another database's)."""
    from tests.citus_support import CITUS_MODE

    if CITUS_MODE:
        return backends_waiting_for_a_lock()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        return cursor.fetchone()[0]


def test_an_output_whose_run_row_is_held_past_the_bound_is_kept_not_dropped(community):
    """A long transaction holds A's run row (not a move: the batch's ``SKIP LOCKED`` of the runs
    passes it over, and the step is completed on its own, which waits for the row). That
    completion waits the bound, changes nothing, and A's output is kept for A's next turn, not
    dropped as an error (its step then ran again once its lease lapsed). Once the row is let go,
    the output is recorded, the step having run once."""
    import psycopg

    from buzz_delivery.workflows.models import Run
    from project.database_url import database_url

    other = CommunityFactory()
    GATES.clear()
    GATES.update(a1=threading.Event())
    a_run, b_run = started_run(community.id, "a1"), started_run(other.id, "b1")
    stop, thread, summary = running_all(concurrency=2)
    holder = psycopg.connect(database_url(connection.settings_dict))
    try:
        wait_until(
            lambda: steps_of([a_run])[(a_run, "a1")][0] == "running",
            timeout=60,
            what="A's step to be claimed",
        )
        waiting = waiting_here()
        holder.execute(
            f"SELECT 1 FROM {Run._meta.db_table} WHERE community_id = %s AND run_id = %s FOR UPDATE",
            [community.id, a_run],
        )
        GATES["a1"].set()  # A's output goes to the completer: its completion meets the held row
        wait_until(lambda: waiting_here() > waiting, timeout=60, what="A's completion to wait for the run row")
        wait_until(lambda: waiting_here() == waiting, timeout=60, what="A's completion to give up its wait")
        assert steps_of([a_run]) == {(a_run, "a1"): ("running", 1, 1)}
        holder.rollback()
        wait_until(
            lambda: steps_of([a_run])[(a_run, "a1")][0] == "succeeded",
            timeout=60,
            what="A's output to be recorded once its run row is let go",
        )
    finally:
        holder.rollback()
        holder.close()
        for gate in GATES.values():
            gate.set()
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert steps_of([a_run, b_run])[(a_run, "a1")][1:] == (1, 1)  # claimed once: its function ran once
    assert (summary["errors"], summary["lease_lost"]) == (0, 0), summary


def test_an_orchestrator_stopped_while_an_output_is_kept_leaves_no_completer_behind(community):
    """A's output is kept (its run row held past the bound) when the orchestrator is stopped: at
    the end of its grace it returns the step as abandoned, and its completer stops with it (its
    lease lapses and the step is claimed again, as any step abandoned at the grace's end). Before,
    the completer thread outlived the orchestrator, holding its connection, and recorded the
    output after the orchestrator had counted it abandoned."""
    import psycopg

    from buzz_delivery.workflows.models import Run
    from project.database_url import database_url

    GATES.clear()
    GATES.update(a1=threading.Event())
    a_run = started_run(community.id, "a1")
    CommunityFactory()  # a second community: the orchestrator bounds its lock waits (--all)
    stop, thread, summary = running_all(concurrency=1, shutdown_grace=1.0)
    holder = psycopg.connect(database_url(connection.settings_dict))
    try:
        wait_until(lambda: steps_of([a_run])[(a_run, "a1")][0] == "running", timeout=60, what="A's step to be claimed")
        waiting = waiting_here()
        holder.execute(
            f"SELECT 1 FROM {Run._meta.db_table} WHERE community_id = %s AND run_id = %s FOR UPDATE",
            [community.id, a_run],
        )
        GATES["a1"].set()
        wait_until(lambda: waiting_here() > waiting, timeout=60, what="A's completion to wait for the run row")
        wait_until(lambda: waiting_here() == waiting, timeout=60, what="A's completion to give up its wait")
        stop.set()
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert summary["abandoned"] == 1, summary
        wait_until(
            lambda: not any(t.name == "buzz-workflows-completer" and t.is_alive() for t in threading.enumerate()),
            timeout=20,
            what="the completer to stop with the orchestrator (the row is still held)",
        )
        holder.rollback()  # the row let go: nothing is left to record the output
        assert steps_of([a_run]) == {(a_run, "a1"): ("running", 1, 1)}
    finally:
        holder.rollback()
        holder.close()
        for gate in GATES.values():
            gate.set()
        stop.set()
        thread.join(timeout=60)


def test_one_held_send_does_not_keep_the_other_sends_of_its_batch_waiting(community):
    """Two send steps of A are claimed together and sent in one batch (``send_messages``: the
    delivery-identity locks of all its steps, then their rows). A long transaction of another
    session holds the identity lock of one of them (taken before the claim, which does not take
    it). The batch waits past the bound and changes nothing; its sends then go one at a time,
    each within the bound: the free one's deliveries are committed while the lock stays held
    (before, the whole batch was kept, turn after turn, until the lock was let go), and the held
    one, which waited alone, is kept (its lease still renewed) and sent once the lock is let go:
    each step claimed once, one delivery per target, one message event each. (The held one,
    ready first, is claimed and tried alone first: kept, it comes first in its community's next
    batch too, so it must be tried last from then on, or it kept the free one waiting again.)"""
    from buzz_delivery.models import Event, WorkflowAgentDelivery
    from buzz_delivery.workflows import executor
    from buzz_delivery.workflows.models import Step

    workflow = WorkflowFactory(community=community)
    targets = [random32(), random32()]
    held_run, free_run = (
        start(workflow, {"steps": [send_step("send", targets, content=content)]}).pk for content in ("held", "free")
    )

    def sent(run_id) -> tuple[int, int]:
        """(deliveries, message events) of the run's send."""
        return (
            WorkflowAgentDelivery.objects.filter(community_id=community.id, run_id=run_id).count(),
            Event.objects.filter(community_id=community.id, event_id=executor.message_event_id(run_id, "send")).count(),
        )

    def lease_until(run_id):
        return Step.objects.get(community_id=community.id, run_id=run_id, key="send").lease_until

    with identity_held(community.id, held_run, "send") as release:
        waiting = waiting_here()
        stop, thread, summary = running_all(concurrency=2)
        try:
            wait_until(lambda: waiting_here() > waiting, timeout=60, what="a send of A to wait for the held identity")
            wait_until(
                lambda: steps_of([free_run])[(free_run, "send")][0] == "waiting",
                timeout=60,
                what="the free send to be sent while the other's identity is held",
            )
            assert sent(free_run) == (2, 1)
            assert steps_of([held_run]) == {(held_run, "send"): ("running", 1, 1)}
            assert sent(held_run) == (0, 0)
            kept_until = lease_until(held_run)
            wait_until(
                lambda: lease_until(held_run) > kept_until,
                timeout=60,
                what="the kept send's lease to be renewed while its identity is held",
            )
            release()
            wait_until(
                lambda: steps_of([held_run])[(held_run, "send")][0] == "waiting",
                timeout=60,
                what="the held send to be sent once its identity is let go",
            )
        finally:
            release()
            stop.set()
            thread.join(timeout=60)
    assert not thread.is_alive()
    assert sent(held_run) == sent(free_run) == (2, 1)
    assert {v[1:] for v in steps_of([held_run, free_run]).values()} == {(1, 1)}  # each claimed once
    assert (summary["waiting"], summary["errors"], summary["lease_lost"]) == (2, 0, 0), summary
