"""The remote worker's runtime, as both in-process ones (tests/test_agents_park_swallowed.py,
docs/agents.md "A park the handler catches"): a handler that catches the park around
``ctx.request_approval`` cannot unpark its run.

Its ``_Parked`` was still an ``Exception``: ``except Exception`` around the approval (a tool
wrapper, a retry library) swallowed the park. A handler that went on and returned had its
completion refused (the park released the lease) and the run was counted ``lost``, "left to its
lease" though it held none; a later ``ctx.call`` was refused as a lost lease; tenacity's default
retry asked for the approval again and again. Now ``_Parked`` is a ``BaseException`` there too
and the turn ends ``parked`` by the context's own record of the park."""

from __future__ import annotations

import uuid

import pytest

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import Created, intake_event
from buzz_delivery.gateway.remote_runs import RemoteRunContext, run_remote_claim
from buzz_delivery.testing import CommunityFactory
from buzz_delivery.workflows.services import decide_approval
from tests.gateway.support import enroll, new_agent

pytestmark = pytest.mark.django_db(transaction=True)


def _run(gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    outcome = intake_event(community.id, "test", uuid.uuid4().hex, {}, agent.pubkey)
    assert isinstance(outcome, Created)
    return community, agent, outcome.run_id


def _turn(agent, handler) -> str:
    (claim,) = agent.claim_runs(worker_id=uuid.uuid4().hex)
    return run_remote_claim(agent, claim, handler, RemoteRunContext(agent, claim))


def _approve_and_resume(community, agent, run_id, handler) -> None:
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == ("waiting_approval", None), (run.state, run.failure_message)
    assert [(e.kind, e.status) for e in JournalEntry.objects.filter(run_id=run_id)] == [("approval", "pending")]
    decide_approval(community.id, run.approval_id, "approved", "alice")
    assert _turn(agent, handler) == "completed"
    run.refresh_from_db()
    assert (run.state, run.output) == ("completed", {"decision": "approved"})


@pytest.mark.parametrize("then", ["returns", "calls"])
def test_a_remote_handler_that_swallows_its_park_ends_the_turn_parked(gateway_server, then):
    community, agent, run_id = _run(gateway_server)
    seen: list[str] = []

    def handler(ctx):
        try:
            decision = ctx.request_approval("ship?", 600)
        except Exception as exc:  # a tool wrapper's: lets the park through now
            seen.append(f"caught {type(exc).__name__}")
            if then == "calls":
                ctx.call("after", lambda args, key: {}, {})
            return {"went_on": True}
        return {"decision": decision["decision"]}

    assert _turn(agent, handler) == "parked"
    assert seen == []
    _approve_and_resume(community, agent, run_id, handler)


def test_a_remote_handler_catching_everything_still_parks(gateway_server):
    community, agent, run_id = _run(gateway_server)
    seen: list[str] = []

    def handler(ctx):
        try:
            decision = ctx.request_approval("ship?", 600)
        except BaseException as exc:  # a bare except
            seen.append(type(exc).__name__)
            try:
                ctx.call("after", lambda args, key: {}, {})
            except BaseException as later:
                seen.append(type(later).__name__)
            return {"went_on": True}
        return {"decision": decision["decision"]}

    assert _turn(agent, handler) == "parked"
    assert seen == ["_Parked", "_Parked"]
    _approve_and_resume(community, agent, run_id, handler)


def test_a_retry_library_does_not_retry_a_remote_park(gateway_server):
    import tenacity

    community, agent, run_id = _run(gateway_server)
    attempts: list[int] = []

    def handler(ctx):
        @tenacity.retry(stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_none())
        def ask():
            attempts.append(1)
            return ctx.request_approval("ship?", 600)

        return {"decision": ask()["decision"]}

    assert _turn(agent, handler) == "parked"
    assert len(attempts) == 1, attempts
    _approve_and_resume(community, agent, run_id, handler)


def test_a_park_of_a_thread_the_remote_handler_left_ends_the_turn_parked(gateway_server, monkeypatch):
    """As tests/test_agents_park_after_return.py: a thread the handler left behind parks the run
    after the handler returned. Its completion (the real request, sent once the park is written)
    was refused and the parked run counted ``lost``."""
    import threading
    import time

    _community, agent, run_id = _run(gateway_server)
    step: dict = {"ending": threading.Event()}
    real = agent.complete_run

    def complete_run(lease, output):
        step["ending"].set()
        deadline = time.monotonic() + 20
        while step["ctx"].parked is None:
            assert time.monotonic() < deadline, "the leftover thread never parked"
            time.sleep(0.01)
        return real(lease, output)

    monkeypatch.setattr(agent, "complete_run", complete_run)

    def handler(ctx):
        def leftover():
            try:
                assert step["ending"].wait(20)
                ctx.request_approval("ship?", 600)
            except BaseException as exc:
                step["raised"] = type(exc).__name__

        step["thread"] = threading.Thread(target=leftover, daemon=True)
        step["thread"].start()
        return {"went_on": True}

    (claim,) = agent.claim_runs(worker_id="w")
    step["ctx"] = RemoteRunContext(agent, claim)
    assert run_remote_claim(agent, claim, handler, step["ctx"]) == "parked"
    step["thread"].join(20)
    assert step.get("raised") == "_Parked", step
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == ("waiting_approval", None)
