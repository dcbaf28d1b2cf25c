"""The fan-in that ends a send_message step in its counting UPDATE (workflows migration 0025)
under races, with real threads on their own connections (a review of issue 31's change): the
last two deliveries settled at once, the last delivery settled while the run is cancelled, and
the Advance (its release and its NOTIFY) once per ended step."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from buzz_delivery import services
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.services import AlreadyTerminal, Settled
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.services import Canceled, cancel_run, get_run
from buzz_delivery.workflows.testing import function_step, run_until_idle, send_step
from tests.test_wf_batch_complete import _Heard
from tests.wf_support import run_state, start, states

pytestmark = pytest.mark.django_db(transaction=True)


def _claims(run):
    rows = WorkflowAgentDelivery.objects.filter(run_id=run.pk).order_by("target_pubkey")
    claims = [
        services.claim_delivery(d.community_id, bytes(d.target_pubkey), delivery_id=d.id, lease_seconds=30)
        for d in rows
    ]
    assert None not in claims
    return claims


def _send_then_after():
    return {"steps": [send_step("send", [random32(), random32()]), function_step("after", depends_on=["send"])]}


def _together(*calls):
    """Run each (function, *args) on its own thread (its own connection), released at once;
    their results."""
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def run(i, call):
        try:
            barrier.wait()
            results[i] = call[0](*call[1:])
        except BaseException as exc:  # reported by the assertion below
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not [r for r in results if isinstance(r, BaseException)], results
    return results


@pytest.mark.parametrize("outcomes", [("finished", "finished"), ("finished", "failed")])
def test_the_last_two_deliveries_settled_at_once_end_the_step_once(community, outcomes):
    workflow = WorkflowFactory(community=community)
    for _ in range(3):
        run = start(workflow, _send_then_after())
        run_until_idle(community.id)
        a, b = _claims(run)
        settle = services.finish_delivery
        assert _together((settle, a.lease, outcomes[0]), (settle, b.lease, outcomes[1])) == [
            Settled(outcomes[0]),
            Settled(outcomes[1]),
        ]
        step = get_run(community.id, run.pk).step("send")
        failed = outcomes.count("failed")
        assert (step.delivered_terminal, step.delivered_failed) == (2, failed)
        assert step.output == {"delivered": 2 - failed, "failed": failed}
        assert step.state == ("failed" if failed else "succeeded")
        assert states(run)["after"] == ("canceled" if failed else "ready")  # released once, or not at all


def test_the_last_delivery_settled_while_the_run_is_cancelled_ends_the_step_one_way_only(community):
    workflow = WorkflowFactory(community=community)
    for _ in range(4):
        run = start(workflow, _send_then_after())
        run_until_idle(community.id)
        first, last = _claims(run)
        assert services.finish_delivery(first.lease, "finished") == Settled("finished")
        settled, canceled = _together(
            (services.finish_delivery, last.lease, "finished"), (cancel_run, community.id, run.pk)
        )
        assert run_state(run) == "canceled"
        step = get_run(community.id, run.pk).step("send")
        if step.state == "succeeded":  # the settle first: counted and ended, then the run cancelled
            assert settled == Settled("finished") and canceled == Canceled(runs=1, deliveries=0)
            assert (step.delivered_terminal, step.output) == (2, {"delivered": 2, "failed": 0})
            assert states(run)["after"] == "canceled"
        else:  # the cancel first: the claimed delivery settles on its own lease, counted by nobody
            assert step.state == "canceled" and step.output is None and step.finished_at is not None
            assert step.delivered_terminal == 1
            assert settled == Settled("finished") and canceled == Canceled(runs=1, deliveries=0)
        assert cancel_run(community.id, run.pk) == AlreadyTerminal("canceled")


def test_the_step_the_fan_in_ends_releases_its_successor_and_notifies_once(community):
    """The Advance (AFTER UPDATE OF state) sees the end the BEFORE trigger wrote in the counting
    UPDATE: one release of the successor and one NOTIFY of the engine's channel, at commit
    (heard as the orchestrator hears it: on Citus it is sent on the run's shard's node)."""
    workflow = WorkflowFactory(community=community)
    run = start(workflow, _send_then_after())
    run_until_idle(community.id)
    first, last = _claims(run)
    listener = _Heard()
    try:
        assert services.finish_delivery(first.lease, "finished") == Settled("finished")
        assert states(run)["after"] == "pending"
        assert listener.take(0) == []  # a count alone: no Advance
        assert services.finish_delivery(last.lease, "finished") == Settled("finished")
        assert listener.take(1) == [str(community.id)]
    finally:
        listener.close()
    assert states(run) == {"send": "succeeded", "after": "ready"}
