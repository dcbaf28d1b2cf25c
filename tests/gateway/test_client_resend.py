"""A request whose connection went away before its answer (the keep-alive race: gunicorn closes a
connection idle for its ``--keep-alive`` just as the client reuses it) is sent again once, the
same signed bytes: done once whether or not the first reached the gateway. A remote run whose
runtime request cannot be answered is left to its lease, never failed and compensated."""

from __future__ import annotations

import threading
import time

import httpx
import psycopg
import pytest
from django.db import connection

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.gateway.remote_runs import RemoteRunContext, RunBatcher, run_remote_claim
from buzz_delivery.testing import CommunityFactory
from project.database_url import database_url
from tests.agents_support import new_run
from tests.citus_support import CITUS_MODE
from tests.gateway.support import enroll, new_agent

pytestmark = pytest.mark.django_db(transaction=True)


class Drops(httpx.BaseTransport):
    """The real transport, except that the next ``drops`` requests to a path ending ``suffix``
    lose their connection: before the gateway sees them (``after=False``) or after it answered
    (``after=True``). ``sent`` counts what reached the gateway."""

    def __init__(self, suffix: str, drops: int, *, after: bool) -> None:
        self.inner, self.suffix, self.drops, self.after, self.sent = httpx.HTTPTransport(), suffix, drops, after, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        drop = self.drops > 0 and request.url.path.endswith(self.suffix)
        if drop:
            self.drops -= 1
            if not self.after:
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        response = self.inner.handle_request(request)
        if request.url.path.endswith(self.suffix):
            self.sent += 1
        if drop:
            response.read()
            response.close()
            raise httpx.ReadError("[Errno 104] Connection reset by peer", request=request)
        return response


def claimed_run(gateway_server, transport: httpx.BaseTransport):
    """An agent whose requests go through ``transport``, enrolled in a new community, and its one
    run there claimed: (agent, run id, claim)."""
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    agent._http = httpx.Client(timeout=agent.timeout, transport=transport)
    enroll(agent, community)
    run_id = new_run(community.id, agent.pubkey)
    (claim,) = agent.claim_runs(1, worker_id="w")
    return agent, run_id, claim


def test_a_request_dropped_before_the_gateway_saw_it_is_sent_again_and_done_once(gateway_server):
    transport = Drops("/calls", 1, after=False)
    agent, run_id, claim = claimed_run(gateway_server, transport)

    outcome = agent.journal_call(claim.lease, "search", {"q": 1})

    assert (outcome.outcome, outcome.data["seq"]) == ("journaled", 1)
    assert (transport.drops, transport.sent) == (0, 1)
    assert list(JournalEntry.objects.filter(run_id=run_id).values_list("seq", "tool_name")) == [(1, "search")]


def test_a_request_whose_answer_was_lost_is_not_done_twice_and_raises_the_first_error(gateway_server):
    transport = Drops("/calls", 1, after=True)
    agent, run_id, claim = claimed_run(gateway_server, transport)

    with pytest.raises(httpx.ReadError):
        agent.journal_call(claim.lease, "search", {"q": 1})

    assert transport.sent == 2  # the resend reached the gateway, which refused the used event id
    assert list(JournalEntry.objects.filter(run_id=run_id).values_list("seq", "tool_name")) == [(1, "search")]


def test_a_remote_run_whose_journal_write_cannot_be_answered_is_left_to_its_lease_not_compensated(
    gateway_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("GATEWAY_RUN_LEDGER", str(tmp_path / "ledger.txt"))
    from tests.gateway import handlers

    transport = Drops("/calls", 0, after=True)
    agent, run_id, claim = claimed_run(gateway_server, transport)

    ctx = RemoteRunContext(agent, claim)

    def two_calls(ctx):
        ctx.call("effect", handlers.effect, {"n": 1}, compensate=handlers.undo)
        transport.drops = 2  # the second call: both tries lose the connection after the gateway answered
        return ctx.call("effect", handlers.effect, {"n": 2}, compensate=handlers.undo)

    result = run_remote_claim(agent, claim, two_calls, ctx)

    assert result == "lost"
    assert ctx.lost.is_set() and not ctx.cancelled
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code, run.unwinding) == ("waiting_tool", None, False)  # left to its lease
    entries = JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    assert [(e.seq, e.status, e.compensation_status) for e in entries] == [
        (1, "succeeded", None),
        (2, "pending", None),  # journaled once; resumed, it is reconciled or recorded uncertain
    ]
    assert "undo" not in (tmp_path / "ledger.txt").read_text()


def test_a_tool_whose_emit_cannot_be_answered_leaves_its_call_pending_not_failed(gateway_server):
    """A tool function that streams through ``ctx.emit`` (an LLM's tokens, say) when that emit's
    request cannot be answered: the run is lost, and its call is not recorded failed (a resumed
    run would replay the failure, fail and compensate): it stays pending, reconciled or uncertain
    on resume as after a crash mid-call."""
    transport = Drops("/emit", 1, after=True)  # answered, the answer lost; the resend is refused replayed
    agent, run_id, claim = claimed_run(gateway_server, transport)
    ctx = RemoteRunContext(agent, claim)

    def streams(ctx):
        def llm(args, key):
            ctx.emit("a token")
            return {"text": "a token"}

        return ctx.call("llm", llm, {"q": 1})

    assert run_remote_claim(agent, claim, streams, ctx) == "lost"
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code, run.unwinding) == ("waiting_tool", None, False)
    entries = JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    assert [(e.seq, e.status) for e in entries] == [(1, "pending")]


class DbDownOnResend(httpx.BaseTransport):
    """The real transport; the first request to a path ending ``suffix`` reaches the gateway and
    is done, but its answer is lost (a reset); its resend finds the gateway's database gone for
    that moment (the backend serving it is terminated while it waits to record the event id): the
    gateway answers it 503 ``unavailable``, which says nothing of the first."""

    def __init__(self, suffix: str) -> None:
        self.inner, self.suffix, self.sent = httpx.HTTPTransport(), suffix, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith(self.suffix):
            return self.inner.handle_request(request)
        self.sent += 1
        if self.sent == 1:
            response = self.inner.handle_request(request)
            response.read()
            response.close()
            raise httpx.ReadError("[Errno 104] Connection reset by peer", request=request)
        if self.sent > 2:
            return self.inner.handle_request(request)
        with psycopg.connect(database_url(connection.settings_dict)) as holder:
            holder.execute("LOCK TABLE buzz_gateway_seen_event IN ACCESS EXCLUSIVE MODE")
            killed = threading.Thread(target=self._terminate_the_waiting_backend, daemon=True)
            killed.start()
            response = self.inner.handle_request(request)
            killed.join(10)
            holder.rollback()
        return response

    @staticmethod
    def _terminate_the_waiting_backend() -> None:
        deadline = time.monotonic() + 10
        with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as admin:
            while time.monotonic() < deadline:
                row = admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = 'buzz-gateway-test'"
                    " AND wait_event_type = 'Lock' AND query LIKE '%%buzz_gateway_seen_event%%'"
                ).fetchone()
                if row:
                    admin.execute("SELECT pg_terminate_backend(%s)", row)
                    return
                time.sleep(0.01)


@pytest.mark.skipif(CITUS_MODE, reason="the gateway's backend found through pg_stat_activity")
def test_a_resend_the_database_could_not_admit_is_not_taken_as_the_answer(gateway_server):
    """The resend's 503 ``unavailable`` tells nothing of the first copy, which was done: a step
    batch sent again signed anew on that 503 would journal the call twice."""
    transport = DbDownOnResend("/runs/calls")
    agent, run_id, claim = claimed_run(gateway_server, transport)
    batcher = RunBatcher(agent)
    try:
        with pytest.raises(httpx.ReadError):
            batcher.send("calls", claim.lease, {"tool_name": "effect", "args": {"n": 1}, "cost": 0,
                                                "compensation": None, "destructive": False})  # fmt: skip
    finally:
        batcher.close()
    assert transport.sent == 2  # the first, done; its resend, answered 503; nothing signed anew
    entries = JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    assert [(e.seq, e.status) for e in entries] == [(1, "pending")]


def test_a_tool_failing_on_its_own_after_its_run_was_abandoned_records_its_true_failure(gateway_server):
    """The shutdown grace marks a context lost (``abandoned``) while a tool is in flight; its lease
    still holds. A tool that then fails for its own reason records that failure, as a succeeding
    one records its output: left pending, the resumed run would find it uncertain, fail and
    compensate a call known to have failed. Only a tool the runtime aborted (its own ``ctx.emit``
    or ``ctx.call`` refused, ``RunAborted`` under its error) leaves its call pending."""
    agent, run_id, claim = claimed_run(gateway_server, Drops("/never", 0, after=False))
    ctx = RemoteRunContext(agent, claim)

    def handler(ctx):
        def tool(args, key):
            ctx.mark_lost("abandoned")  # the worker's grace is over while the tool runs
            raise ValueError("the upstream answered 502")

        return ctx.call("slow", tool, {"q": 1})

    assert run_remote_claim(agent, claim, handler, ctx) == "lost"
    entries = JournalEntry.objects.filter(run_id=run_id).order_by("seq")
    assert [(e.seq, e.status, e.error) for e in entries] == [(1, "failed", "ValueError: the upstream answered 502")]
