"""A worker's batch settle of deliveries of two workflow runs and the agents' maintenance pass
ending agent runs started from those same two runs, at once (each run has a ``send_message``
step and an ``await: agent_run`` step in flight, in parallel): the lock order of
``tests/test_settle_vs_agents_complete_lock_order.py``, with the reaper on the agents' side.

The settle locks the core's run rows in run id order, then its fan-in locks the engine run rows
(``buzz_workflows_run``) in delivery id order. The pass ends the runs it times out
(``TIME_OUT_OVERDUE_RUNS``) and those whose last attempt lapsed (``EXHAUST_LAPSED_RUNS``), two
statements of one transaction, and the way back (``buzz_agents_run_ended``) locks each one's
engine run row in the order they end them. Met the other way round, each held an engine run row
the other waited for ("deadlock detected").

Deterministic as the completion's test: the first run's delivery has the lower id on the
settle's side, the second run's agent run is ended first on the reaper's side (the lower agent
run id, or the earlier statement), and a transaction holding the first run's engine row lines
them up."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection, transaction

from buzz_delivery import services as core
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import Accepted, accept_delivery, claim_agent_runs, reap_agent_runs
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.services import Cause, Settled
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.models import Step
from buzz_delivery.workflows.services import publish_definition, start_run
from buzz_delivery.workflows.testing import run_until_idle, send_step
from tests.agents_support import backdate_run_lease
from tests.conftest import BARRIER_TIMEOUT, collecting, lock_waits_reach
from tests.lock_order_support import LOCK_WORKFLOW_RUN, hold_row, two_runs_in_flight

LOCK_CORE_RUN = "SELECT 1 FROM buzz_delivery_workflow_run WHERE community_id = %s AND id = %s FOR NO KEY UPDATE"


def overdue(run_id) -> None:
    """Time passing: the run is past its ``timeout_at``."""
    with connection.cursor() as cursor:
        cursor.execute("UPDATE buzz_agents_run SET timeout_at = now() - interval '1 second' WHERE id = %s", [run_id])


def lapsed_on_its_last_attempt(run_id) -> None:
    """Time passing: the run's earlier attempts were used and its lease lapsed."""
    with connection.cursor() as cursor:
        cursor.execute("UPDATE buzz_agents_run SET attempts = max_attempts - 1 WHERE id = %s", [run_id])
    backdate_run_lease(run_id)


# How the pass ends each agent run: the second workflow run's (lower agent run id) first, then
# the first's. "mixed": one statement ends the second's, a later one the first's.
FORMS = {
    "timeout": ((overdue, overdue), {"timed_out": 2}, ("timeout", "timeout")),
    "exhausted": ((lapsed_on_its_last_attempt,) * 2, {"exhausted": 2}, ("failed", "failed")),
    "mixed": ((overdue, lapsed_on_its_last_attempt), {"timed_out": 1, "exhausted": 1}, ("timeout", "failed")),
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("form", list(FORMS))
def test_a_multi_run_settle_and_the_agents_reaper_ending_runs_of_the_same_runs_never_deadlock(community, form):
    ages, counted, ended = FORMS[form]
    runs = two_runs_in_flight(community)
    first, second, leases, agent_runs = runs.first, runs.second, runs.leases, runs.agent_runs
    assert len(claim_agent_runs(community.id, [runs.agent], worker_id="w", limit=10, lease_seconds=60)) == 2
    for age, run_id in zip(ages, agent_runs, strict=True):
        age(run_id)
    connection.close()

    errors: list[BaseException] = []
    found: dict[str, object] = {}
    holding, release = threading.Event(), threading.Event()
    guarded = collecting(errors)

    @guarded
    def engine() -> None:  # the engine at work on the first run: holds its row for a moment
        hold_row(LOCK_WORKFLOW_RUN, [community.id, first.pk], holding, release)

    # Each side in a transaction of its own: a deadlock's victim raises instead of running again.
    @guarded
    def settle() -> None:
        with transaction.atomic():
            found["settle"] = core.finish_deliveries(leases)

    @guarded
    def reap() -> None:
        with transaction.atomic():
            found["reap"] = reap_agent_runs()

    with ThreadPoolExecutor(max_workers=3) as pool:
        held = pool.submit(engine)
        assert holding.wait(BARRIER_TIMEOUT)
        settled = pool.submit(settle)
        lock_waits_reach(1, 5.0)  # the settle holds both core runs and waits for the first engine run
        reaped = pool.submit(reap)
        lock_waits_reach(2, 5.0)  # the pass waits too (before the fix: holding the second)
        release.set()  # the settle takes the first engine run, then needs the second
        held.result(BARRIER_TIMEOUT)
        settled.result(BARRIER_TIMEOUT)
        reaped.result(BARRIER_TIMEOUT)

    assert not errors, [str(e).splitlines()[0] for e in errors]
    assert found["settle"] == [Settled(status="finished")] * 2
    result = found["reap"]
    assert {k: getattr(result, k) for k in ("timed_out", "exhausted", "reclaimed", "skipped_busy")} == {
        "timed_out": 0,
        "exhausted": 0,
        "reclaimed": 0,
        "skipped_busy": 0,
        **counted,
    }
    for run, run_id, state in zip((second, first), agent_runs, ended, strict=True):
        assert AgentRun.objects.get(id=run_id).state == state
        assert Step.objects.get(run_id=run.pk, key="ask").state == "failed"  # its one agent run counted, failed


@pytest.mark.django_db(transaction=True)
def test_a_pass_ending_agent_runs_of_one_workflow_run_takes_no_lock_of_its_core_row(community):
    """Its ends lock at most that run's engine row, as a one-run settle: no cycle to break, and
    the pass does not queue behind the settles of that run (held here by another transaction:
    waiting for it would cost the pass its lock_timeout and the community this pass)."""
    agents = [random32(), random32()]
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, {"steps": [send_step("ask", agents, **{"await": "agent_run"})]})
    run = start_run(community.id, workflow.id, {}, cause=Cause.event(os.urandom(32)))
    run_until_idle(community.id)
    agent_runs = []
    for agent in agents:
        d = WorkflowAgentDelivery.objects.get(run_id=run.pk, step_id="ask", target_pubkey=agent)
        accepted = accept_delivery(core.claim_delivery(community.id, agent, delivery_id=d.id, lease_seconds=60).lease)
        assert isinstance(accepted, Accepted)
        agent_runs.append(accepted.run_id)
        overdue(accepted.run_id)
    connection.close()

    errors: list[BaseException] = []
    holding, release = threading.Event(), threading.Event()

    @collecting(errors)
    def settle_of_the_run() -> None:  # holds the run's core row, as a multi-run settle would
        hold_row(LOCK_CORE_RUN, [community.id, run.pk], holding, release)

    with ThreadPoolExecutor(max_workers=1) as pool:
        held = pool.submit(settle_of_the_run)
        assert holding.wait(BARRIER_TIMEOUT)
        try:
            result = reap_agent_runs()
        finally:
            release.set()
        held.result(BARRIER_TIMEOUT)

    assert not errors, errors
    assert (result.timed_out, result.skipped_busy) == (2, 0)
    assert {AgentRun.objects.get(id=r).state for r in agent_runs} == {"timeout"}
