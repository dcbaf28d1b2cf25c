"""Pydantic AI per-token streaming (``DurableAgent(stream_text="tokens")``, issue 35), on
``FunctionModel``'s stream function: each text delta is a chunk of the run's output stream,
written while the request runs; the journal records the whole response, so a resumed run
replays it without asking again and writes no chunk twice; a request interrupted mid-stream and
made again leaves its partial chunks, then a marker, then the new attempt's."""

from __future__ import annotations

import pytest

from buzz_delivery.agents.integrations.journal import RESTARTED
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import claim_agent_runs
from buzz_delivery.agents.services.output import read_output
from tests import pydantic_ai_handlers as ph
from tests.agents_support import AGENT, new_run

ANSWER = ["Looking ", "it up. ", "Found ", "it: ", "1."]


def chunks(community, run_id):
    return [c.chunk for c in read_output(community.id, run_id).chunks]


def lines(ledger, prefix):
    return [x for x in (ledger.read_text().splitlines() if ledger.exists() else []) if x.startswith(prefix)]


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    path = tmp_path / "ledger.txt"
    monkeypatch.setenv("AGENT_LEDGER", str(path))
    monkeypatch.delenv("AGENT_KILL", raising=False)
    return path


@pytest.mark.django_db
def test_each_text_delta_is_a_chunk_and_the_journal_records_the_whole_response(community, ledger):
    run_id = new_run(community.id)
    (claim,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=30)
    assert run_claim(claim, ph.streaming) == "completed"
    run = AgentRun.objects.get(id=run_id)
    assert run.output == "Found it: 1."
    assert chunks(community, run_id) == ANSWER  # one chunk per delta, the tool call's none
    answer = JournalEntry.objects.get(run_id=run_id, seq=3)
    assert answer.tool_name == "model:streaming"
    assert answer.output["streamed_chunks"] == 3
    assert answer.output["response"]["parts"] == [
        {**answer.output["response"]["parts"][0], "part_kind": "text", "content": "Found it: 1."}
    ]


@pytest.mark.django_db
def test_stream_text_takes_only_false_true_or_tokens():
    from buzz_delivery.agents.integrations.pydantic_ai import DurableAgent

    with pytest.raises(ValueError, match="stream_text must be False, True or 'tokens'"):
        DurableAgent(ph.streaming_agent, stream_text="words")  # type: ignore[arg-type]


@pytest.mark.django_db(transaction=True)
def test_a_request_killed_mid_stream_is_made_again_after_its_partial_chunks_and_a_marker(community, ledger):
    """SIGKILL inside the second request after two of its deltas were written: the next worker
    replays the first request (its two chunks counted, not written again) and the tool call, makes
    the second request again, and writes the marker and then the new attempt's deltas."""
    from tests.test_agents_processes import reclaim, worker

    run_id = new_run(community.id)
    code, _, err = worker(community, "streaming", ledger, kill="stream:2", handler_module="tests.pydantic_ai_handlers")
    assert code == -9, err
    assert chunks(community, run_id) == ["Looking ", "it up. ", "Found ", "it: "]
    reclaim(run_id)
    code, summary, err = worker(community, "streaming", ledger, handler_module="tests.pydantic_ai_handlers")
    assert code == 0, err
    assert summary["completed"] == 1, AgentRun.objects.get(id=run_id).failure_message
    assert AgentRun.objects.get(id=run_id).output == "Found it: 1."
    assert chunks(community, run_id) == ["Looking ", "it up. ", "Found ", "it: ", RESTARTED, "Found ", "it: ", "1."]
    # The first request and the tool call were made once; the interrupted request twice.
    assert lines(ledger, "model") == [f"model {run_id}:1", f"model {run_id}:3", f"model {run_id}:3"]
    assert lines(ledger, "call") == [f"call {run_id}:2"]
    # The positions the request holds in the stream: the first attempt's 2, the marker, the new 3.
    assert JournalEntry.objects.get(run_id=run_id, seq=3).output["streamed_chunks"] == 6


@pytest.mark.django_db(transaction=True)
def test_under_the_event_loop_worker_the_deltas_stream_the_same_way(community, ledger):
    from buzz_delivery.agents import loop_worker

    run_ids = [new_run(community.id) for _ in range(2)]
    config = loop_worker.AsyncWorkerConfig(
        handler=ph.streaming.run,
        agents=[AGENT],
        communities=[community.id],
        exit_when_idle=True,
        poll_seconds=0.1,
        lease_seconds=15,
        worker_id="aio-streaming",
    )
    assert loop_worker.AsyncAgentWorker(config).run()["completed"] == 2
    for run_id in run_ids:
        assert chunks(community, run_id) == ANSWER
