"""``complete_run`` / ``complete_runs`` while a call the holder journaled under its lease
generation is still ``pending``.

A raw caller (a gateway client; the runtimes wait for their calls first) could complete a run
with one of its calls pending once another call's result had set the run ``running`` again: the
run ended ``completed`` and the call stayed ``pending`` for ever (a finished run keeps no pending
call). With the call alone in flight (the run ``waiting_tool``) the completion was answered
``LeaseLost`` although the lease held. Now the completion is refused with
:class:`CallsInFlight` naming the calls, nothing written (in a batch, that row only). Pending
calls of an earlier generation (a crashed holder's) do not refuse it. Each test failed before
the fix (``Finished`` with call 1 pending, or ``LeaseLost``).
"""

from __future__ import annotations

import pytest

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import (
    CallsInFlight,
    Finished,
    Journaled,
    Recorded,
    batch,
    complete_run,
    journal_call,
    reap_agent_runs,
    record_call_result,
)
from tests.agents_support import backdate_run_lease, claim, make_claimable, new_run

pytestmark = pytest.mark.django_db(transaction=True)


def _state(run_id):
    run = AgentRun.objects.get(id=run_id)
    entries = [(e.seq, e.status) for e in JournalEntry.objects.filter(run_id=run_id).order_by("seq")]
    return run.state, run.output, run.lease_until is not None, run.finished_at, entries


def _running_with_call_1_pending(community_id):
    run_id = new_run(community_id)
    lease = claim(community_id, run_id)
    assert isinstance(journal_call(lease, "a", {"n": 1}), Journaled)
    assert isinstance(journal_call(lease, "b", {"n": 2}), Journaled)
    assert isinstance(record_call_result(lease, 2, ok=True, output={}), Recorded)  # the run is 'running' again
    return run_id, lease


def test_complete_run_with_a_call_of_its_holder_pending_is_calls_in_flight_and_writes_nothing(community):
    run_id, lease = _running_with_call_1_pending(community.id)
    before = _state(run_id)

    assert complete_run(lease, {"done": True}) == CallsInFlight((1,))
    assert _state(run_id) == before == ("running", None, True, None, [(1, "pending"), (2, "succeeded")])

    assert isinstance(record_call_result(lease, 1, ok=True, output={}), Recorded)  # the lease still holds
    assert complete_run(lease, {"done": True}) == Finished("completed")
    assert _state(run_id)[0:2] == ("completed", {"done": True})


def test_complete_run_with_its_only_call_in_flight_is_calls_in_flight_not_lease_lost(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    assert isinstance(journal_call(lease, "a", {"n": 1}), Journaled)
    before = _state(run_id)

    assert complete_run(lease, {"done": True}) == CallsInFlight((1,))
    assert _state(run_id) == before


def test_a_pending_call_of_an_earlier_generation_does_not_refuse_the_completion(community):
    run_id = new_run(community.id)
    first = claim(community.id, run_id)
    assert isinstance(journal_call(first, "a", {"n": 1}), Journaled)
    backdate_run_lease(run_id)  # the first holder crashed mid-call
    assert reap_agent_runs().reclaimed == 1
    make_claimable(run_id)
    second = claim(community.id, run_id, worker="w2")
    assert second.lease_generation > first.lease_generation

    assert complete_run(second, {"done": True}) == Finished("completed")
    assert AgentRun.objects.get(id=run_id).state == "completed"


def test_complete_runs_refuses_only_the_row_with_a_call_in_flight(community):
    busy, busy_lease = _running_with_call_1_pending(community.id)
    idle = new_run(community.id)
    idle_lease = claim(community.id, idle)
    before = _state(busy)

    outcomes = batch.complete_runs(
        community.id,
        [batch.prepare_completion(busy_lease, {"n": 0}), batch.prepare_completion(idle_lease, {"n": 1})],
    )

    assert outcomes == [CallsInFlight((1,)), Finished("completed")]
    assert _state(busy) == before
    assert _state(idle)[0:2] == ("completed", {"n": 1})


@pytest.mark.parametrize("form", ["single", "batch"])
def test_a_call_journaled_while_the_completion_waits_for_the_run_row_refuses_it(community, form):
    """The completion takes no lock of its own first: a call journaled by a transaction that
    commits while the completion's statement waits for the run's row sets the run
    ``waiting_tool`` with its entry, and the waiting statement re-checks the new row version."""
    import threading

    from django.db import connections, transaction

    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    journaled, go, out = threading.Event(), threading.Event(), []

    def journal_and_hold():
        try:
            with transaction.atomic():
                out.append(journal_call(lease, "a", {"n": 1}))
                journaled.set()
                assert go.wait(30)
        finally:
            connections.close_all()

    holder = threading.Thread(target=journal_and_hold)
    holder.start()
    assert journaled.wait(30)
    result = []

    def complete():
        try:
            if form == "single":
                result.append(complete_run(lease, {"done": True}))
            else:
                (done,) = batch.complete_runs(community.id, [batch.prepare_completion(lease, {"done": True})])
                result.append(done)
        finally:
            connections.close_all()

    completer = threading.Thread(target=complete)
    completer.start()
    completer.join(1.0)
    assert completer.is_alive(), "the completion should wait for the journaling transaction's row lock"
    go.set()
    holder.join(30)
    completer.join(30)
    assert isinstance(out[0], Journaled)
    assert result == [CallsInFlight((1,))]
    assert _state(run_id)[0] == "waiting_tool"
