"""A completion racing a call journaled and another call's result recorded (a raw gateway client
doing all three at once) never ends the run with the journaled call ``pending``.

The completion takes no lock of its own: it judges the holder's calls in flight on its
statement's snapshot and relies on the run's row to say a call was journaled since (the journal
sets it ``waiting_tool``, re-checked once the completion holds the row). A call's result recorded
after that sets it ``running`` again, so with the three ordered as here (call 2 journaled and
holding the row; call 1's result waiting for it; the completion waiting behind that) the
completion found a ``running`` row while call 2's entry, committed after its snapshot, was not in
it: it ended the run ``completed`` with call 2 pending for ever. Now the completion also requires
its snapshot to hold the run's last journaled entry (``tool_calls_used``, re-read on the row's
latest version), so it is refused :class:`CallsInFlight` and writes nothing. Both tests failed
before that condition (``Finished("completed")``, call 2 ``pending``).
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import (
    CallsInFlight,
    Finished,
    Journaled,
    Recorded,
    Renewed,
    batch,
    complete_run,
    heartbeat,
    journal_call,
    reap_agent_runs,
    record_call_result,
)
from tests.agents_support import backdate_run_lease, claim, make_claimable, new_run
from tests.citus_support import waits_for_a_row_lock

pytestmark = pytest.mark.django_db(transaction=True)
TIMEOUT = 120
# The completion's blocked statement as citus_lock_waits shows it (on PostgreSQL the wait is read
# by pid): its text is cut at track_activity_query_size, so the batch is known by its beginning
# (its workflow runs' lock, agents sql.SOURCES).
COMPLETION_LIKE = {"single": "%'completed'%", "batch": "%WITH sources AS MATERIALIZED%"}


def _state(run_id):
    run = AgentRun.objects.get(id=run_id)
    entries = [(e.seq, e.status) for e in JournalEntry.objects.filter(run_id=run_id).order_by("seq")]
    return run.state, run.output, run.lease_until is not None, run.finished_at, len(run.history), entries


def _in_thread(work, pid: list[int], out: list[object]) -> threading.Thread:
    def body():
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                pid.append(cursor.fetchone()[0])
            out.append(work())
        except BaseException as exc:  # surfaced by the test's assertions
            out.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=body)
    thread.start()
    return thread


def _until_it_waits(pid: list[int], statement_like: str, thread: threading.Thread, out: list[object]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not (pid and waits_for_a_row_lock(pid[0], statement_like)):
        assert thread.is_alive(), f"it never waited for the run's row: {out}"
        assert time.monotonic() < deadline, "it never waited for the run's row"
        time.sleep(0.01)


def _running_with_no_call_of_its_generation_pending(community_id, scenario):
    """A leased run, ``running``. ``earlier``: with call 1 pending from a crashed holder's generation
    (it does not refuse a completion, and the holder may record it); ``fresh``: with no call yet."""
    run_id = new_run(community_id)
    lease = claim(community_id, run_id)
    if scenario == "earlier":
        assert isinstance(journal_call(lease, "a", {"n": 1}), Journaled)
        backdate_run_lease(run_id)  # the first holder crashed mid-call
        assert reap_agent_runs().reclaimed == 1
        make_claimable(run_id)
        lease = claim(community_id, run_id, worker="w2")
    return run_id, lease


@pytest.mark.parametrize("form", ["single", "batch"])
def test_a_call_journaled_and_another_recorded_while_the_completion_waits_refuse_it(community, form):
    scenario = "earlier"
    run_id, lease = _running_with_no_call_of_its_generation_pending(community.id, scenario)
    journaled, go = threading.Event(), threading.Event()
    journal_out: list[object] = []

    def journal_and_hold():  # the run's row stays locked until ``go``
        with transaction.atomic():
            outcome = journal_call(lease, "b", {"n": 2})
            journaled.set()
            assert go.wait(TIMEOUT)
        return outcome

    journaler = _in_thread(journal_and_hold, [], journal_out)
    try:
        assert journaled.wait(TIMEOUT)
        recorder_pid: list[int] = []
        recorded: list[object] = []
        recorder = _in_thread(lambda: record_call_result(lease, 1, ok=True, output={}), recorder_pid, recorded)
        _until_it_waits(recorder_pid, "%result_generation%", recorder, recorded)  # for the journaling transaction

        def complete():
            if form == "single":
                return complete_run(lease, {"done": True})
            return batch.complete_runs(community.id, [batch.prepare_completion(lease, {"done": True})])[0]

        completer_pid: list[int] = []
        completed: list[object] = []
        completer = _in_thread(complete, completer_pid, completed)
        # Its snapshot holds the run 'running' without call 2; it queues behind the recorder.
        _until_it_waits(completer_pid, COMPLETION_LIKE[form], completer, completed)
        history = _state(run_id)[4]
    finally:
        go.set()
    for thread in (journaler, recorder, completer):
        thread.join(TIMEOUT)
        assert not thread.is_alive()
    assert isinstance(journal_out[-1], Journaled) and journal_out[-1].seq == 2, journal_out
    assert recorded == [Recorded("succeeded")]
    assert completed == [CallsInFlight((2,))], _state(run_id)
    # Nothing written by the completion: the run as the recorder left it, call 2 still in flight.
    assert _state(run_id) == ("running", None, True, None, history, [(1, "succeeded"), (2, "pending")])

    assert isinstance(record_call_result(lease, 2, ok=True, output={}), Recorded)  # the lease holds
    assert complete_run(lease, {"done": True}) == Finished("completed")


@pytest.mark.parametrize("recorded_too", [False, True])
def test_calls_journaled_and_recorded_while_a_batch_completion_waits_for_another_run_refuse_it(community, recorded_too):
    """The batch locks its runs in id order after taking its snapshot: while it waits for the first
    run's row, the second run's call 1 and call 2 are journaled and call 1 recorded, each in a
    transaction of its own, none in its snapshot; the second run's row is ``running`` again when
    the batch locks it. ``recorded_too``: call 2 is recorded as well before the batch goes on: no
    call is in flight when the refusal is judged, and it is ``CallsInFlight(())``, complete again
    (it was ``LeaseLost`` though the lease held)."""
    first, second = sorted((new_run(community.id), new_run(community.id)))
    first_lease, lease = claim(community.id, first), claim(community.id, second)
    held, go = threading.Event(), threading.Event()

    def hold_the_first_run():
        with transaction.atomic():
            outcome = heartbeat(first_lease)
            held.set()
            assert go.wait(TIMEOUT)
        return outcome

    holder_out: list[object] = []
    holder = _in_thread(hold_the_first_run, [], holder_out)
    try:
        assert held.wait(TIMEOUT)
        completer_pid: list[int] = []
        completed: list[object] = []
        completer = _in_thread(
            lambda: batch.complete_runs(
                community.id,
                [batch.prepare_completion(first_lease, {"n": 1}), batch.prepare_completion(lease, {"n": 2})],
            ),
            completer_pid,
            completed,
        )
        _until_it_waits(completer_pid, COMPLETION_LIKE["batch"], completer, completed)
        assert isinstance(journal_call(lease, "a", {"n": 1}), Journaled)
        assert isinstance(journal_call(lease, "b", {"n": 2}), Journaled)
        assert record_call_result(lease, 1, ok=True, output={}) == Recorded("succeeded")
        if recorded_too:
            assert record_call_result(lease, 2, ok=True, output={}) == Recorded("succeeded")
        history = _state(second)[4]
    finally:
        go.set()
    for thread in (holder, completer):
        thread.join(TIMEOUT)
        assert not thread.is_alive()
    assert isinstance(holder_out[0], Renewed)
    in_flight = () if recorded_too else (2,)
    assert completed == [[Finished("completed"), CallsInFlight(in_flight)]], _state(second)
    entries = [(1, "succeeded"), (2, "succeeded" if recorded_too else "pending")]
    assert _state(second) == ("running", None, True, None, history, entries)
    if recorded_too:  # the lease holds: complete again
        assert complete_run(lease, {"n": 2}) == Finished("completed")
