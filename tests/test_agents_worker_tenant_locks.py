"""One community's locked rows never let the run leases of another community the agent worker
serves lapse (docs/security.md, docs/agents.md).

``run_agent_worker`` serves several communities (``--community`` given more than once, or every
community with work): one :class:`~buzz_delivery.agents.runtime.Heartbeat` thread renews every
run lease it holds. A lifecycle move of community A waiting behind a long transaction of A's
own code queues every write of A's rows behind it, A's renewals too: they wait a bounded time,
and B's renewals go on meanwhile. Waits poll the database for a condition; nothing is timed.
"""

from __future__ import annotations

import pytest

from buzz_delivery.agents import services as s
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.runtime import Context, Heartbeat
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig
from buzz_delivery.testing import CommunityFactory
from tests.agents_support import AGENT, new_run
from tests.tenant_locks import a_move_can_get_stuck, rows_held
from tests.test_worker import wait_until
from tests.test_worker_tenant_locks import backends_waiting_for_a_lock, move_stuck_behind_a_long_transaction

pytestmark = pytest.mark.django_db(transaction=True)


def heartbeat_at(run_id):
    return AgentRun.objects.get(id=run_id).heartbeat_at


def test_a_lifecycle_move_stuck_in_one_community_lets_no_run_lease_of_another_lapse(community):
    other = CommunityFactory()
    a_move_can_get_stuck(community)
    a_run, b_run = new_run(community.id), new_run(other.id)
    (a_claim,) = s.claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    (b_claim,) = s.claim_agent_runs(other.id, [AGENT], worker_id="w", lease_seconds=30)
    assert (a_claim.lease.run_id, b_claim.lease.run_id) == (a_run, b_run)
    heartbeat = Heartbeat(every=0.2, lease_seconds=30, bound_lock_waits=True)
    a_ctx, b_ctx = Context(a_claim), Context(b_claim)
    heartbeat.hold(a_ctx)  # A first: an unbounded renewal of A would hold up B's behind it
    heartbeat.hold(b_ctx)
    a_before = heartbeat_at(a_run)
    try:
        with move_stuck_behind_a_long_transaction(community.id) as moving:
            heartbeat.start()
            # B's lease is renewed twice (each renewal a round after the one before) while A's move
            # is stuck and A's renewals cannot go through.
            first = b_ctx.lease.lease_until
            wait_until(lambda: b_ctx.lease.lease_until != first, timeout=30, what="B's first renewal")
            second = b_ctx.lease.lease_until
            wait_until(lambda: b_ctx.lease.lease_until != second, timeout=30, what="B's second renewal")
            assert heartbeat_at(b_run) is not None
            assert not moving.done()
            assert heartbeat_at(a_run) == a_before
            assert a_ctx.lease == a_claim.lease and not a_ctx.lost.is_set()
        assert moving.result(timeout=30).deletion_state == "quiescing"
    finally:
        heartbeat.stop.set()
        if heartbeat.ident is not None:
            heartbeat.join(timeout=30)
    assert not heartbeat.is_alive()
    assert not b_ctx.lost.is_set()


def test_only_an_agent_worker_serving_several_communities_bounds_its_renewals(community):
    other = CommunityFactory()

    def bound(communities):
        config = WorkerConfig(handler=lambda ctx: None, agents=[AGENT], communities=communities, worker_id="w")
        return AgentWorker(config).heartbeat.lock_wait_ms

    assert bound([community.id]) is None
    assert bound([community.id, community.id]) is None
    assert bound([community.id, other.id]) is not None
    assert bound([]) is not None  # every community with work


def test_one_locked_run_row_does_not_keep_the_other_run_leases_of_its_community_from_renewal(community):
    """A long transaction holds one run row of community A: that run's renewals wait past the
    bound, every round. A's other run, whose row nothing holds, is renewed all the same (its
    community's rounds do not always start with the locked run), as B's is."""
    other = CommunityFactory()
    a_locked, a_free, b_run = new_run(community.id), new_run(community.id), new_run(other.id)
    (locked_claim,) = s.claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    (free_claim,) = s.claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    (b_claim,) = s.claim_agent_runs(other.id, [AGENT], worker_id="w", lease_seconds=30)
    assert [c.lease.run_id for c in (locked_claim, free_claim, b_claim)] == [a_locked, a_free, b_run]
    heartbeat = Heartbeat(every=0.2, lease_seconds=30, bound_lock_waits=True)
    locked_ctx, free_ctx, b_ctx = Context(locked_claim), Context(free_claim), Context(b_claim)
    for ctx in (locked_ctx, free_ctx, b_ctx):  # the locked run first: renewed first
        heartbeat.hold(ctx)
    try:
        with rows_held(AgentRun, community.id, a_locked):
            heartbeat.start()
            for ctx in (free_ctx, b_ctx):  # twice each: each renewal a round after the one before
                for _ in range(2):
                    before = ctx.lease.lease_until
                    wait_until(lambda c=ctx, b=before: c.lease.lease_until != b, timeout=30, what="a renewal")
            assert locked_ctx.lease == locked_claim.lease and not locked_ctx.lost.is_set()
    finally:
        heartbeat.stop.set()
        if heartbeat.ident is not None:
            heartbeat.join(timeout=30)
    assert not heartbeat.is_alive()
    assert not (free_ctx.lost.is_set() or b_ctx.lost.is_set())


def run_states(ids) -> dict:
    return dict(AgentRun.objects.filter(id__in=ids).values_list("id", "state"))


def claims_of(ids) -> dict:
    return dict(AgentRun.objects.filter(id__in=ids).values_list("id", "lease_generation"))


def completes(ctx):
    return {"done": str(ctx.lease.run_id)}


def started(config: WorkerConfig):
    from tests.test_agents_worker import start

    worker = AgentWorker(config)
    thread, out = start(worker)
    return worker, thread, out


def stopped(worker: AgentWorker, thread) -> None:
    worker.stop()
    thread.join(timeout=60)
    assert not thread.is_alive()


def loop_worker_started(worker):
    """The event-loop worker ``worker`` run in a thread; returns the thread and the dict its
    counts go to once it returns."""
    import threading

    out: dict = {}

    def main():
        from django.db import connections

        try:
            out.update(worker.run())
        finally:
            connections.close_all()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return thread, out


def test_a_lifecycle_move_stuck_in_one_community_keeps_no_claim_of_another_waiting(community):
    """One loop thread claims round robin over A and B: A's claim waits for a lock at most the
    bound, then A is left for a while and B's runs are claimed and run meanwhile (without the
    bound the thread waits behind A's move and B's runs stay pending). Once A's move is given
    up, A's runs are claimed and run, each once."""
    other = CommunityFactory()
    a_move_can_get_stuck(community)
    a_runs = [new_run(community.id) for _ in range(2)]
    b_runs = [new_run(other.id) for _ in range(3)]
    config = WorkerConfig(
        handler=completes,
        agents=[AGENT],
        communities=[community.id, other.id],
        concurrency=1,
        lease_seconds=15,
        poll_seconds=0.2,
        listen=False,
        accept=False,
        worker_id="w",
    )
    with move_stuck_behind_a_long_transaction(community.id, rolled_back=True) as moving:
        worker, thread, out = started(config)
        try:
            wait_until(
                lambda: set(run_states(b_runs).values()) == {"completed"},
                timeout=60,
                what="B's runs to be claimed and run while A's move is stuck",
            )
            assert not moving.done()
            assert run_states(a_runs) == dict.fromkeys(a_runs, "pending")
            assert claims_of(a_runs) == dict.fromkeys(a_runs, 0)
        except BaseException:
            stopped(worker, thread)
            raise
    moving.result(timeout=30)  # given up: A stays active
    try:
        wait_until(
            lambda: set(run_states(a_runs).values()) == {"completed"},
            timeout=60,
            what="A's runs to be claimed once A's writes are let go",
        )
    finally:
        stopped(worker, thread)
    assert claims_of([*a_runs, *b_runs]) == dict.fromkeys([*a_runs, *b_runs], 1)  # each claimed once
    assert (out["claimed"], out["completed"], out.get("internal_errors", 0)) == (5, 5, 0), out
    assert out["lock_waits"] >= 1


def test_a_lifecycle_move_stuck_in_one_community_keeps_no_acceptance_of_another_waiting(community, make_binding):
    """Acceptance claims and accepts the deliveries to the worker's agent in A and B: A's claim
    waits for a lock at most the bound, then A is left and B's deliveries are accepted into runs
    and run meanwhile. Once A's move is given up, A's deliveries are accepted, each into one run."""
    from buzz_delivery.models import WorkflowAgentDelivery
    from buzz_delivery.testing import random32
    from tests.test_worker import commit, statuses
    from tests.test_worker_pairs import other_community_binding

    agent = random32()
    other, make_other = other_community_binding()
    a_ids = commit(make_binding, agent, 2)
    b_ids = commit(make_other, agent, 2)
    config = WorkerConfig(
        handler=completes,
        agents=[agent],
        communities=[community.id, other.id],
        concurrency=1,
        lease_seconds=15,
        poll_seconds=0.2,
        listen=False,
        worker_id="w",
    )

    def runs_of(ids) -> dict:
        return dict(AgentRun.objects.filter(delivery_id__in=ids).values_list("delivery_id", "state"))

    with move_stuck_behind_a_long_transaction(community.id, rolled_back=True) as moving:
        worker, thread, out = started(config)
        try:
            wait_until(
                lambda: runs_of(b_ids) == dict.fromkeys(b_ids, "completed"),
                timeout=60,
                what="B's deliveries to be accepted and run while A's move is stuck",
            )
            assert not moving.done()
            assert statuses(a_ids) == dict.fromkeys(a_ids, "pending")
            assert runs_of(a_ids) == {}
        except BaseException:
            stopped(worker, thread)
            raise
    moving.result(timeout=30)  # given up: A stays active
    try:
        wait_until(
            lambda: runs_of(a_ids) == dict.fromkeys(a_ids, "completed"),
            timeout=60,
            what="A's deliveries to be accepted and run once A's writes are let go",
        )
    finally:
        stopped(worker, thread)
    ids = [*a_ids, *b_ids]
    assert statuses(ids) == dict.fromkeys(ids, "finished")
    assert AgentRun.objects.filter(delivery_id__in=ids).count() == 4  # one run each
    rows = WorkflowAgentDelivery.objects.filter(id__in=ids)
    assert {r.id: [e["event"] for e in r.history].count("settle") for r in rows} == dict.fromkeys(ids, 1)
    assert (out["accepted"], out["completed"], out.get("internal_errors", 0)) == (4, 4, 0), out


GATES: dict = {}  # community id (text) -> threading.Event the loop test's handlers wait for


async def _echo(args: dict, key: str) -> dict:
    return {"n": args["n"]}


async def gated_call(ctx):
    """Waits for its community's gate, then one journaled call (a journal batch, a record
    batch) and its completion (a complete batch)."""
    import asyncio

    gate = GATES[str(ctx.lease.community_id)]
    while not gate.is_set():
        await asyncio.sleep(0.02)
    out = await ctx.call("echo", _echo, {"n": 1})
    return {"n": out["n"]}


def test_a_lifecycle_move_stuck_in_one_community_holds_no_pooled_connection_of_the_event_loop_worker(community):
    """The event-loop worker on one pool connection holds a run of A and one of B. A's move
    gets stuck, then A's handler journals a call: its batch waits for a lock at most the bound
    and gives the connection back, A is left a while, and B's run journals, records and
    completes meanwhile (without the bound A's batch holds the only connection and B's batches
    wait behind it). Once A's move is given up, A's batch goes again: A's run completes, its
    call journaled once."""
    import threading

    from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig
    from buzz_delivery.agents.models import JournalEntry

    other = CommunityFactory()
    a_move_can_get_stuck(community)
    a_run, b_run = new_run(community.id), new_run(other.id)
    GATES.update({str(community.id): threading.Event(), str(other.id): threading.Event()})
    worker = AsyncAgentWorker(
        AsyncWorkerConfig(
            handler=gated_call,
            agents=[AGENT],
            communities=[community.id, other.id],
            connections=1,
            in_flight=10,
            lease_seconds=15,
            poll_seconds=0.2,
            listen=False,
            accept=False,
            worker_id="aio",
        )
    )
    thread, out = loop_worker_started(worker)
    try:
        wait_until(lambda: set(run_states([a_run, b_run]).values()) == {"running"}, timeout=60, what="both claims")
        with move_stuck_behind_a_long_transaction(community.id, rolled_back=True) as moving:
            waiting = backends_waiting_for_a_lock()  # the move
            GATES[str(community.id)].set()  # A's call: its journal batch meets the move
            wait_until(
                lambda: backends_waiting_for_a_lock() > waiting,
                timeout=60,
                what="A's journal batch to wait for a lock",
            )
            GATES[str(other.id)].set()
            wait_until(
                lambda: run_states([b_run]) == {b_run: "completed"},
                timeout=60,
                what="B's run to journal, record and complete while A's move is stuck",
            )
            assert not moving.done()
            assert run_states([a_run]) == {a_run: "running"}
            assert not JournalEntry.objects.filter(run_id=a_run).exists()
        moving.result(timeout=30)  # given up: A stays active
        wait_until(
            lambda: run_states([a_run]) == {a_run: "completed"},
            timeout=60,
            what="A's run to complete once A's writes are let go",
        )
    finally:
        for gate in GATES.values():
            gate.set()
        worker.stop()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert {r: JournalEntry.objects.filter(run_id=r).count() for r in (a_run, b_run)} == {a_run: 1, b_run: 1}
    assert claims_of([a_run, b_run]) == {a_run: 1, b_run: 1}
    assert (out["completed"], out.get("internal_errors", 0)) == (2, 0), out


def test_a_lifecycle_move_stuck_in_one_community_keeps_no_claim_of_the_event_loop_worker_waiting(community):
    """The event-loop worker on one pool connection claims round robin over A and B: A's claim
    waits for a lock at most the bound and gives the connection back, A is left a while, and
    B's runs are claimed and run meanwhile (without the bound A's claim holds the only
    connection). Once A's move is given up, A's runs are claimed and run, each once."""
    import threading

    from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig

    other = CommunityFactory()
    a_move_can_get_stuck(community)
    a_runs = [new_run(community.id) for _ in range(2)]
    b_runs = [new_run(other.id) for _ in range(2)]
    GATES.clear()  # gated_call: no gate set for a community means it waits; open both
    GATES.update({str(community.id): threading.Event(), str(other.id): threading.Event()})
    for gate in GATES.values():
        gate.set()
    worker = AsyncAgentWorker(
        AsyncWorkerConfig(
            handler=gated_call,
            agents=[AGENT],
            communities=[community.id, other.id],
            connections=1,
            lease_seconds=15,
            poll_seconds=0.2,
            listen=False,
            accept=False,
            worker_id="aio",
        )
    )
    with move_stuck_behind_a_long_transaction(community.id, rolled_back=True) as moving:
        thread, out = loop_worker_started(worker)
        try:
            wait_until(
                lambda: set(run_states(b_runs).values()) == {"completed"},
                timeout=60,
                what="B's runs to be claimed and run while A's move is stuck",
            )
            assert not moving.done()
            assert claims_of(a_runs) == dict.fromkeys(a_runs, 0)
        except BaseException:
            worker.stop()
            thread.join(timeout=60)
            raise
    moving.result(timeout=30)  # given up: A stays active
    try:
        wait_until(
            lambda: set(run_states(a_runs).values()) == {"completed"},
            timeout=60,
            what="A's runs to be claimed once A's writes are let go",
        )
    finally:
        worker.stop()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert claims_of([*a_runs, *b_runs]) == dict.fromkeys([*a_runs, *b_runs], 1)
    assert (out["claimed"], out["completed"], out.get("internal_errors", 0)) == (4, 4, 0), out
    assert out["lock_waits"] >= 1


def test_loop_threads_do_not_spin_while_another_thread_retries_the_carried_deliveries(community, make_binding):
    """A delivery of A claimed by acceptance waits to be accepted (A's accept waited past the
    bound, its skip is over) and one loop thread is in the acceptance round that tries it
    again (its accept waiting for the lock again: held here by the test). The worker's other
    loop threads find nothing and wait a poll interval (or until woken), as when nothing is
    carried: before, each polled again at once (a wait of 0 s) for as long as that round
    lasted, a claim statement of each community per turn, a busy loop."""
    from buzz_delivery import services as core
    from buzz_delivery.testing import random32
    from tests.test_worker import commit

    agent = random32()
    other = CommunityFactory()
    commit(make_binding, agent, 1)
    (carried,) = core.claim_deliveries(community.id, agent, limit=1, lease_seconds=15, holder="w")
    config = WorkerConfig(
        handler=completes,
        agents=[agent],
        communities=[community.id, other.id],
        concurrency=2,
        lease_seconds=15,
        poll_seconds=1.0,
        listen=False,
        worker_id="w",
    )
    worker = AgentWorker(config)
    assert worker.acceptance is not None
    worker.acceptance.carried = [carried]  # its community's skip is over: to be tried again
    waits: list[float] = []
    real_wait = worker.waker.wait

    def wait(token, timeout):
        waits.append(timeout)
        return real_wait(token, timeout)

    worker.waker.wait = wait  # type: ignore[method-assign]
    worker.acceptance._busy.acquire()  # a loop thread's round, waiting for A's lock again
    from tests.test_agents_worker import start

    thread, out = start(worker)
    try:
        wait_until(lambda: len(waits) >= 4, timeout=60, what="the loop threads to wait four times")
        assert min(waits[:4]) > 0, waits[:20]
    finally:
        worker.acceptance._busy.release()
        stopped(worker, thread)
    assert out.get("internal_errors", 0) == 0, out
