"""Streamed output of agent runs (issue 29, SPEC 16 "Streamed output"): ``ctx.emit`` from a real
worker's handler, read live from another thread; the fence (a stale or cancelled holder's chunk
is refused and nothing is written); the bounds (per chunk, per run, NUL), each refused naming its
field with nothing written; the sequence held by PostgreSQL; the rows going with their run; the
signed gateway route; and ``await ctx.emit`` on the event-loop worker."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
from django.core.exceptions import ValidationError
from django.db import DatabaseError, connection, connections, transaction

from buzz_delivery import services as core
from buzz_delivery.agents import services as agents
from buzz_delivery.agents.exceptions import OutputLimitExceeded
from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig
from buzz_delivery.agents.models import AgentRun, RunOutput
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig
from buzz_delivery.gateway.client import GatewayHTTPError
from buzz_delivery.testing import CommunityFactory, advance_to
from tests.agents_support import AGENT, backdate_run_lease, claim, make_claimable, new_run
from tests.gateway.support import enroll, gateway_server, new_agent  # noqa: F401  (gateway_server: a fixture)

pytestmark = pytest.mark.django_db(transaction=True)


def chunks(run_id) -> list[tuple[int, str]]:
    return list(RunOutput.objects.filter(run_id=run_id).order_by("seq").values_list("seq", "chunk"))


def counters(run_id) -> tuple[int, int]:
    run = AgentRun.objects.get(id=run_id)
    return run.output_chunks, run.output_bytes


# --- a real worker's handler, read live from another thread -------------------------------------


def test_a_worker_handlers_chunks_are_read_live_by_a_reader_in_another_thread(community):
    run_id = new_run(community.id)
    seen_first = threading.Event()
    read: list[tuple[int, str]] = []
    reader_error: list[BaseException] = []

    def handler(ctx):
        assert ctx.emit("Looking ") == 1
        # The reader must see chunk 1 while the run is still running: the stream is live.
        assert seen_first.wait(20), "the reader never saw the first chunk while the run was running"
        assert ctx.emit("") is None  # an empty chunk writes nothing
        assert ctx.emit("it up…") == 2
        return {"ok": True}

    def reader():
        try:
            for chunk in agents.stream_output(community.id, run_id, poll=0.05, timeout=30):
                read.append((chunk.seq, chunk.chunk))
                if chunk.seq == 1:
                    assert AgentRun.objects.get(id=run_id).state == "running"
                    seen_first.set()
        except BaseException as exc:
            reader_error.append(exc)
        finally:
            connections.close_all()

    reading = threading.Thread(target=reader, daemon=True)
    reading.start()
    worker = AgentWorker(
        WorkerConfig(
            handler=handler, agents=[AGENT], communities=[community.id], poll_seconds=0.1, worker_id="w",
            listen=False, exit_when_idle=True,
        )
    )  # fmt: skip
    worker.run()
    reading.join(20)
    assert not reading.is_alive(), "the reader did not end once the run was terminal and read"
    assert reader_error == []
    assert AgentRun.objects.get(id=run_id).state == "completed"
    assert read == [(1, "Looking "), (2, "it up…")] == chunks(run_id)
    assert counters(run_id) == (2, len("Looking it up…".encode()))
    # Read again from a seq, not following: what is there, then the end.
    assert [c.seq for c in agents.stream_output(community.id, run_id, after=1, follow=False)] == [2]


def test_a_resumed_handler_does_not_write_its_chunks_twice(community):
    run_id = new_run(community.id)
    first = claim(community.id, run_id)
    assert agents.emit_output(first, "one") == agents.Emitted(1)
    backdate_run_lease(run_id)
    agents.reap_agent_runs()
    make_claimable(run_id)
    (claimed,) = agents.claim_agent_runs(community.id, [AGENT], worker_id="w2", lease_seconds=30)

    def handler(ctx):
        return {"seqs": [ctx.emit("one"), ctx.emit("two")]}

    assert run_claim(claimed, handler) == "completed"
    assert AgentRun.objects.get(id=run_id).output == {"seqs": [1, 2]}
    assert chunks(run_id) == [(1, "one"), (2, "two")]


# --- the fence ------------------------------------------------------------------------------------


def test_a_stale_holders_chunk_is_refused_and_nothing_is_written(community):
    run_id = new_run(community.id)
    stale = claim(community.id, run_id, worker="w1")
    assert agents.emit_output(stale, "mine") == agents.Emitted(1)
    backdate_run_lease(run_id)
    agents.reap_agent_runs()
    make_claimable(run_id)
    current = claim(community.id, run_id, worker="w2")
    assert current.lease_generation > stale.lease_generation

    assert isinstance(agents.emit_output(stale, "late"), agents.LeaseLost)
    assert chunks(run_id) == [(1, "mine")] and counters(run_id) == (1, 4)
    assert agents.emit_output(current, "next") == agents.Emitted(2)
    # The same holder name with the old generation is just as stale.
    impostor = agents.AgentLease(community.id, run_id, stale.lease_generation, stale.lease_until, "w2")
    assert isinstance(agents.emit_output(impostor, "forged"), agents.LeaseLost)
    assert chunks(run_id) == [(1, "mine"), (2, "next")]


def test_a_cancelled_holders_chunk_is_refused_and_a_finished_runs_is_already_terminal(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    agents.cancel_agent_run(community.id, run_id, reason="stop")
    assert agents.emit_output(lease, "after the cancel") == agents.LeaseLost("cancelled")
    assert chunks(run_id) == [] and counters(run_id) == (0, 0)

    done_id = new_run(community.id)
    done = claim(community.id, done_id)
    assert isinstance(agents.complete_run(done, {"ok": 1}), agents.Finished)
    assert agents.emit_output(done, "too late") == agents.AlreadyTerminal("completed")
    assert chunks(done_id) == []


def test_a_lapsed_lease_cannot_emit(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    backdate_run_lease(run_id)
    assert isinstance(agents.emit_output(lease, "lapsed"), agents.LeaseLost)
    assert chunks(run_id) == []


# --- bounds and bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        ("x" * 17, "at most 16 bytes"),
        ("é" * 9, "got 18"),  # 9 characters, 18 bytes of UTF-8
        ("a\x00b", "NUL"),
        ("\ud800", "surrogate"),
        ("", "empty"),
        (b"bytes", "must be a str"),
        (None, "must be a str"),
    ],
)
def test_a_bad_chunk_is_refused_naming_the_field_and_nothing_is_written(community, settings, chunk, message):
    settings.BUZZ_AGENTS = {"MAX_CHUNK_BYTES": 16, "MAX_STREAM_BYTES": 40}
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    with pytest.raises(ValidationError) as caught:
        agents.emit_output(lease, chunk)
    assert list(caught.value.message_dict) == ["chunk"] and message in str(caught.value)
    assert chunks(run_id) == [] and counters(run_id) == (0, 0)


def test_a_chunk_past_the_runs_bound_is_too_large_and_nothing_is_written(community, settings):
    settings.BUZZ_AGENTS = {"MAX_CHUNK_BYTES": 16, "MAX_STREAM_BYTES": 40}
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    assert agents.emit_output(lease, "a" * 16) == agents.Emitted(1)
    assert agents.emit_output(lease, "b" * 16) == agents.Emitted(2)
    assert agents.emit_output(lease, "c" * 9) == agents.TooLarge("output", 32, 9, 40)
    assert chunks(run_id) == [(1, "a" * 16), (2, "b" * 16)] and counters(run_id) == (2, 32)
    assert agents.emit_output(lease, "d" * 8) == agents.Emitted(3)  # exactly at the bound

    # Through the runtime: ctx.emit raises OutputLimitExceeded, the handler may go on.
    ctx_run = new_run(community.id)
    (claimed,) = agents.claim_agent_runs(community.id, [AGENT], worker_id="w9", lease_seconds=30)
    assert claimed.lease.run_id == ctx_run

    def greedy(ctx):
        ctx.emit("x" * 16)
        ctx.emit("y" * 16)
        try:
            ctx.emit("z" * 16)
        except OutputLimitExceeded as exc:
            return {"refused": str(exc)}
        return {"refused": None}

    assert run_claim(claimed, greedy) == "completed"
    assert "32 + 16 bytes is over 40" in AgentRun.objects.get(id=ctx_run).output["refused"]
    assert [seq for seq, _ in chunks(ctx_run)] == [1, 2]


def test_bad_reader_arguments_are_refused_naming_the_field(community):
    run_id = new_run(community.id)
    for kwargs, field in [({"after": -1}, "after"), ({"poll": 0}, "poll"), ({"after": "1"}, "after")]:
        with pytest.raises(ValidationError) as caught:
            next(agents.stream_output(community.id, run_id, **kwargs))
        assert list(caught.value.message_dict) == [field]
    with pytest.raises(ValidationError) as caught:
        agents.read_output(community.id, run_id, limit=1001)
    assert list(caught.value.message_dict) == ["limit"]
    # Another community's run, or none: nothing, and the stream ends at once.
    other = CommunityFactory()
    assert list(agents.stream_output(other.id, run_id, poll=0.05)) == []
    assert agents.read_output(other.id, run_id).found is False


# --- invariants held by PostgreSQL ----------------------------------------------------------------


def test_the_database_keeps_the_sequence_gapless_and_chunks_immutable(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    agents.emit_output(lease, "one")
    raw = (
        "INSERT INTO buzz_agents_output (id, community_id, run_id, seq, chunk, generation)"
        " VALUES (%s, %s, %s, %s, 'x', 1)"
    )
    for seq in (1, 3):  # a repeat, a gap
        with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(raw, [uuid.uuid4(), community.id, run_id, seq])
    with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("UPDATE buzz_agents_output SET chunk = 'rewritten' WHERE run_id = %s", [run_id])
    with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("UPDATE buzz_agents_run SET output_chunks = output_chunks + 2 WHERE id = %s", [run_id])
    assert chunks(run_id) == [(1, "one")] and counters(run_id) == (1, 3)


def test_concurrent_emits_of_one_run_get_a_gapless_sequence(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    seqs: list[int] = []
    barrier = threading.Barrier(4)

    def emitter(n: int) -> None:
        try:
            barrier.wait(10)
            for i in range(10):
                outcome = agents.emit_output(lease, f"{n}.{i} ")
                assert isinstance(outcome, agents.Emitted), outcome
                seqs.append(outcome.seq)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=emitter, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(seqs) == list(range(1, 41))
    assert [seq for seq, _ in chunks(run_id)] == list(range(1, 41)) and counters(run_id)[0] == 40


# --- the rows go with their run -------------------------------------------------------------------


def test_output_goes_with_its_run_deleted_or_purged(community):
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    agents.emit_output(lease, "kept until the run goes")
    kept_id = new_run(community.id)
    agents.emit_output(claim(community.id, kept_id), "other run")
    with connection.cursor() as cursor:  # what a prune of runs (or of their workflow run) does
        cursor.execute("DELETE FROM buzz_agents_run WHERE community_id = %s AND id = %s", [community.id, run_id])
    assert chunks(run_id) == [] and chunks(kept_id) == [(1, "other run")]

    advance_to(community, "fenced")
    core.purge_community(community.id)  # catalog order, then the tombstone (its guard checks the table)
    assert RunOutput.objects.filter(community_id=community.id).count() == 0
    community.refresh_from_db()
    assert community.deletion_state == "tombstone"


# --- the gateway ----------------------------------------------------------------------------------


def test_the_gateway_returns_a_signed_agents_chunks_and_refuses_others(gateway_server):  # noqa: F811
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    run_id = new_run(community.id, agent=agent.pubkey)
    lease = claim(community.id, run_id, agent=agent.pubkey)
    agents.emit_output(lease, "first ")
    agents.emit_output(lease, "second")

    page = agent.read_output(str(community.id), str(run_id))
    assert page == {
        "chunks": [{"seq": 1, "chunk": "first "}, {"seq": 2, "chunk": "second"}],
        "after": 2,
        "terminal": False,
        "done": False,
    }
    # Long-poll: nothing after 2 yet; a chunk emitted meanwhile ends the wait.
    timer = threading.Timer(0.5, lambda: (agents.emit_output(lease, "third"), connections.close_all()))
    timer.start()
    later = agent.read_output(str(community.id), str(run_id), after=2, wait_seconds=10)
    timer.join()
    assert later["chunks"] == [{"seq": 3, "chunk": "third"}]
    agents.complete_run(lease, {"ok": True})
    assert agent.read_output(str(community.id), str(run_id), after=3, wait_seconds=10)["done"] is True

    # Another enrolled key: its request is signed, but the run is not its own (404, as missing).
    stranger = new_agent(gateway_server)
    enroll(stranger, community)
    with pytest.raises(GatewayHTTPError) as caught:
        stranger.read_output(str(community.id), str(run_id))
    assert caught.value.status == 404
    # A key not enrolled there: 403.
    outsider = new_agent(gateway_server)
    with pytest.raises(GatewayHTTPError) as caught:
        outsider.read_output(str(community.id), str(run_id))
    assert caught.value.status == 403
    # Unsigned: 401.
    import httpx

    url = f"{gateway_server.base}/communities/{community.id}/runs/{run_id}/output"
    response = httpx.post(url, json={"after": 0})
    assert response.status_code == 401


def test_a_remote_handler_emits_through_the_gateway_under_its_lease(gateway_server, settings):  # noqa: F811
    from buzz_delivery.gateway.remote_runs import OutputLimitExceeded as RemoteLimit
    from buzz_delivery.gateway.remote_runs import run_remote_claim

    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    run_id = new_run(community.id, agent=agent.pubkey)
    (remote,) = agent.claim_runs(worker_id="remote-1", lease_seconds=30)

    def handler(ctx):
        seqs = [ctx.emit("remote "), ctx.emit(""), ctx.emit("chunk")]
        try:
            ctx.emit("a\x00b")  # PostgreSQL text cannot hold a NUL: the server's 400 names the field
        except GatewayHTTPError as exc:
            refused = (exc.status, exc.field)
        return {"seqs": seqs, "refused": list(refused)}

    assert run_remote_claim(agent, remote, handler) == "completed"
    assert AgentRun.objects.get(id=run_id).output == {"seqs": [1, None, 2], "refused": [400, "chunk"]}
    assert chunks(run_id) == [(1, "remote "), (2, "chunk")]
    # The finished holder's emit is already_terminal; a stale generation's is lease_lost: nothing written.
    assert agent.emit(remote.lease, "late").outcome == "already_terminal"
    other_id = new_run(community.id, agent=agent.pubkey)
    (held,) = agent.claim_runs(worker_id="remote-1", lease_seconds=30)
    assert held.lease.run_id == str(other_id)
    agents.cancel_agent_run(community.id, other_id, reason="stop")
    lost = agent.emit(held.lease, "after the cancel")
    assert (lost.outcome, lost.data["reason"]) == ("lease_lost", "cancelled")
    assert chunks(other_id) == []
    assert RemoteLimit.failure_code == "stream_too_large"


# --- the event-loop worker ------------------------------------------------------------------------


def test_async_ctx_emit_streams_under_the_lease(community):
    run_id = new_run(community.id)

    async def handler(ctx):
        first = await ctx.emit("async ")
        await asyncio.sleep(0)
        second = await ctx.emit("chunk")
        return {"seqs": [first, second]}

    worker = AsyncAgentWorker(
        AsyncWorkerConfig(
            handler=handler, agents=[AGENT], communities=[community.id], exit_when_idle=True, poll_seconds=0.1,
            lease_seconds=15, worker_id="aio",
        )
    )  # fmt: skip
    worker.run()
    assert AgentRun.objects.get(id=run_id).output == {"seqs": [1, 2]}
    assert chunks(run_id) == [(1, "async "), (2, "chunk")]

    async def read_all():
        return [(c.seq, c.chunk) async for c in agents.astream_output(community.id, run_id, poll=0.05)]

    assert asyncio.run(read_all()) == chunks(run_id)


# --- the admin ------------------------------------------------------------------------------------


def test_the_run_page_shows_the_streamed_output_escaped_and_bounded(community, monkeypatch):
    from django.contrib.auth.models import Permission, User
    from django.test import Client
    from django.urls import reverse

    from buzz_delivery.agents import admin as agents_admin

    monkeypatch.setattr(agents_admin, "OUTPUT_TAIL_CHUNKS", 3)
    monkeypatch.setattr(agents_admin, "OUTPUT_CHUNK_CHARS", 10)
    user = User.objects.create_user("viewer", is_staff=True)
    user.user_permissions.add(Permission.objects.get(content_type__app_label="buzz_agents", codename="view_agentrun"))
    client = Client()
    client.force_login(user)
    run_id = new_run(community.id)
    lease = claim(community.id, run_id)
    page = reverse("admin:buzz_agents_agentrun_change", args=[new_run(community.id)])
    assert "nothing emitted" in client.get(page).content.decode()

    for text in ("gone ", "<b>bold</b> ", "tail ", "x" * 15):
        agents.emit_output(lease, text)
    html = client.get(reverse("admin:buzz_agents_agentrun_change", args=[run_id])).content.decode()
    assert "chunks 2..4" in html and f"({len(''.join(('gone ', '<b>bold</b> ', 'tail ', 'x' * 15)))} bytes" in html
    assert "&lt;b&gt;bold&lt;/b[…]tail xxxxxxxxxx[…]</pre>" in html  # escaped, each chunk cut to 10
    assert "<b>bold" not in html and "gone " not in html  # the oldest chunk is past the tail


def test_a_tool_whose_emit_meets_a_failed_runtime_connection_leaves_its_call_pending_not_failed(community):
    """A tool that streams through ctx.emit while the runtime's connection fails under it: the run
    is lost (left to its lease) and the call stays pending, so a resumed run reconciles it or
    records it uncertain instead of replaying a failure and compensating."""
    from buzz_delivery.agents.models import JournalEntry

    run_id = new_run(community.id)
    (claimed,) = agents.claim_agent_runs(community.id, [AGENT], worker_id="w1", lease_seconds=30)

    def handler(ctx):
        def tool(args, key):
            pid = ctx.lane._runtime_db.connection.info.backend_pid
            with connections["default"].cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
            ctx.emit("token")
            return {"ok": True}

        return ctx.call("stream", tool, {"q": 1})

    assert run_claim(claimed, handler) == "lost"
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code, run.unwinding) == ("waiting_tool", None, False)
    entries = JournalEntry.objects.filter(run_id=run_id).values_list("seq", "status")
    assert list(entries) == [(1, "pending")]
    assert chunks(run_id) == []


def test_a_tool_failing_on_its_own_after_its_handler_timed_out_records_its_true_failure(community):
    """The handler deadline (or the shutdown grace) marks a context lost while a tool is in flight;
    its lease still holds. A tool that then fails for its own reason records that failure, as a
    succeeding one records its output (docs/agents.md: "a call already in flight may still record
    its true result while the lease holds"): left pending, the resumed run would find it
    uncertain (no reconcile hook), fail and compensate a call known to have failed. A tool that
    fails because the runtime aborted inside it (its nested ctx.call) stays pending."""
    from buzz_delivery.agents.models import JournalEntry

    def entries(run_id):
        return list(JournalEntry.objects.filter(run_id=run_id).order_by("seq").values_list("seq", "status", "error"))

    for reason in ("timed_out", "abandoned"):
        run_id = new_run(community.id)
        (claimed,) = agents.claim_agent_runs(community.id, [AGENT], worker_id="w1", lease_seconds=30)

        def own_failure(ctx, reason=reason):
            def tool(args, key):
                ctx.mark_lost(reason)  # the heartbeat, while the tool runs
                raise ValueError("the upstream answered 502")

            return ctx.call("slow", tool, {"q": 1})

        assert run_claim(claimed, own_failure) == "lost"
        assert entries(run_id) == [(1, "failed", "ValueError: the upstream answered 502")], reason

    run_id = new_run(community.id)
    (claimed,) = agents.claim_agent_runs(community.id, [AGENT], worker_id="w1", lease_seconds=30)

    def interrupted(ctx):
        def tool(args, key):
            ctx.mark_lost("timed_out")
            try:
                return ctx.call("inner", lambda a, k: 1, {})
            except Exception as exc:
                raise RuntimeError("the inner call did not answer") from exc

        return ctx.call("outer", tool, {"q": 1})

    assert run_claim(claimed, interrupted) == "lost"
    assert entries(run_id) == [(1, "pending", None)]
