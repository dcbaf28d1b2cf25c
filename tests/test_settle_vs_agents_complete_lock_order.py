"""A worker's batch settle of deliveries of two workflow runs and an agents' batch completion of
agent runs started from those same two runs, at once (each run has a ``send_message`` step and an
``await: agent_run`` step in flight, in parallel).

The settle (``buzz_delivery_finish_leases``: the core's run rows first, in run id order, when the
batch holds more than one run) then writes the delivery records in delivery id order, and the
engine's fan-in trigger (``buzz_workflows_count_delivery``) locks each delivery's engine run row
(``buzz_workflows_run``) in that order. The completion (``COMPLETE_MANY_IF_CURRENT``) locks its
agent runs in agent run id order, and the way back (``buzz_agents_run_ended`` ->
``buzz_agents_count_unit``) locks each one's engine run row in that order. Nothing made the two
orders agree: met the other way round, each held an engine run row the other waited for ("deadlock
detected", a second of ``deadlock_timeout`` for both, the batcher's replay of every item).

A reproduction, deterministic: the first run's deliveries and agent runs have the lower ids on the
settle's side and the higher on the agents' side, and a transaction holding the first run's engine
row (the engine at work on that run) lines them up: the settle waits there first, the completion
takes the second run's row and queues behind it. Once the first row is free the settle takes it,
then waits for the second."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection, transaction

from buzz_delivery import services as core
from buzz_delivery.agents.services import batch as b
from buzz_delivery.agents.services import claim_agent_runs
from buzz_delivery.services import Settled
from buzz_delivery.workflows.models import Step
from tests.conftest import BARRIER_TIMEOUT, collecting, lock_waits_reach
from tests.lock_order_support import LOCK_WORKFLOW_RUN, hold_row, two_runs_in_flight

# The agents' batches that end runs: their item, the batch, the outcome of each run.
FORMS = {
    "complete_runs": (lambda lease: b.prepare_completion(lease, {"ok": True}), b.complete_runs, "completed"),
    "fail_runs": (lambda lease: b.prepare_failure(lease, "handler_error", "x"), b.fail_runs, "failed"),
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("form", list(FORMS))
def test_a_multi_run_settle_and_an_agents_batch_end_of_the_same_runs_never_deadlock(community, form):
    item, send, ended = FORMS[form]
    runs = two_runs_in_flight(community)
    first, second, leases = runs.first, runs.second, runs.leases
    claims = claim_agent_runs(community.id, [runs.agent], worker_id="w", limit=10, lease_seconds=60)
    assert sorted(c.lease.run_id for c in claims) == sorted(runs.agent_runs)
    items = [item(c.lease) for c in claims]
    connection.close()

    errors: list[BaseException] = []
    found: dict[str, object] = {}
    holding, release = threading.Event(), threading.Event()
    guarded = collecting(errors)

    @guarded
    def engine() -> None:  # the engine at work on the first run: holds its row for a moment
        hold_row(LOCK_WORKFLOW_RUN, [community.id, first.pk], holding, release)

    # Each side in a transaction of its own: a deadlock's victim raises instead of running again
    # (the settle and fail_runs retry their deadlocks, which would hide it).
    @guarded
    def settle() -> None:  # a worker's flush of both runs' deliveries (FINISH_MANY)
        with transaction.atomic():
            found["settle"] = core.finish_deliveries(leases)

    @guarded
    def complete() -> None:  # the agents' batcher ending both runs' agent runs
        with transaction.atomic():
            found["complete"] = send(community.id, items)

    with ThreadPoolExecutor(max_workers=3) as pool:
        held = pool.submit(engine)
        assert holding.wait(BARRIER_TIMEOUT)
        settled = pool.submit(settle)
        lock_waits_reach(1, 5.0)  # the settle holds both core runs and waits for the first engine run
        completed = pool.submit(complete)
        lock_waits_reach(2, 5.0)  # the completion waits too (before the fix: holding the second)
        release.set()  # the settle takes the first engine run, then needs the second
        held.result(BARRIER_TIMEOUT)
        settled.result(BARRIER_TIMEOUT)
        completed.result(BARRIER_TIMEOUT)

    assert not errors, [str(e).splitlines()[0] for e in errors]
    assert found["settle"] == [Settled(status="finished")] * 2
    assert found["complete"] == [b.Finished(ended)] * 2
    for run in (first, second):  # the agent step of both runs counted and ended
        assert Step.objects.get(run_id=run.pk, key="ask").state == ("succeeded" if ended == "completed" else "failed")
