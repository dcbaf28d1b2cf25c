"""A handler that returns while a call it started on another thread is still in flight (tools
run in parallel; the handler took what it needed and returned).

``complete_run`` requires the run ``running``: with that call alone in flight (``waiting_tool``)
the completion was refused as a lost lease and the run, its call's result recorded after all,
was left to its lease and run again (an attempt spent); with another call recorded meanwhile
(the run ``running`` again) it completed with the call still ``pending``, whose result could then
never be recorded (a terminal run keeps no pending call: cancels and the maintenance close them).
The runtimes now wait for the handler's calls in flight before they complete the run. Found in
review: each test failed before the fix (``lost``; ``completed`` with call 1 pending)."""

from __future__ import annotations

import threading

import pytest
from django.db import connections

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import claim_agent_runs
from tests.agents_support import AGENT, new_run

pytestmark = pytest.mark.django_db(transaction=True)


def _handler(seen, *, second_call):
    def slow(args, key):
        threading.Event().wait(0.5)  # in flight when the handler returns
        return {"n": args["n"]}

    def handler(ctx):
        def tool():
            try:
                seen.append(ctx.call("slow", slow, {"n": 1}))
            except BaseException as exc:
                seen.append(repr(exc))
            finally:
                connections.close_all()

        threading.Thread(target=tool, daemon=True).start()
        threading.Event().wait(0.1)  # the slow call is journaled by now
        if second_call:
            ctx.call("fast", lambda a, k: {"n": a["n"]}, {"n": 2})  # sets the run 'running' again
        return {"done": True}

    return handler


@pytest.mark.parametrize("second_call", [False, True])
def test_a_run_completes_only_once_its_calls_in_flight_are_recorded(community, second_call):
    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    seen: list = []

    assert run_claim(claimed, _handler(seen, second_call=second_call)) == "completed"
    threading.Event().wait(1.0)  # the slow call has ended either way
    assert seen == [{"n": 1}]
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.output, run.attempts) == ("completed", {"done": True}, claimed.run.attempts)
    entries = [(e.seq, e.tool_name, e.status) for e in JournalEntry.objects.filter(run_id=run_id).order_by("seq")]
    expected = [(1, "slow", "succeeded")] + ([(2, "fast", "succeeded")] if second_call else [])
    assert entries == expected


def test_a_completion_refused_for_calls_in_flight_is_retried_once_they_are_recorded(community, monkeypatch):
    """Should the thread runtime's completion still meet ``CallsInFlight`` (a call journaled
    after its wait for the handler's calls: the first wait is skipped here to reach that race
    deterministically), it waits for the calls and completes again, never dropping the run as
    ``lost``. Fails without the retry (the run ends ``failed``/``calls_in_flight``) and before
    the service refused such a completion (the run completed with call 1 pending)."""
    from buzz_delivery.agents.runtime import Context

    real, skipped = Context._await_calls, []

    def first_wait_skipped(self):
        if not skipped:
            skipped.append(True)
            return None
        return real(self)

    monkeypatch.setattr(Context, "_await_calls", first_wait_skipped)
    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    seen: list = []

    assert run_claim(claimed, _handler(seen, second_call=True)) == "completed"
    assert seen == [{"n": 1}]
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.output) == ("completed", {"done": True})
    entries = [(e.seq, e.status) for e in JournalEntry.objects.filter(run_id=run_id).order_by("seq")]
    assert entries == [(1, "succeeded"), (2, "succeeded")]
