"""A plain tool's call failed ``transaction_left_open`` across real crashes of the event-loop
worker (``run_agent_worker --async`` subprocesses, SIGKILL): its journal entry ends in one
state, once, and the tool is never made again on resume (its writes were rolled back)."""

from __future__ import annotations

import pytest
from django.db import connection

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import intake_event
from tests.agents_support import AGENT
from tests.test_agents_processes import h_lines, reclaim, worker

pytestmark = pytest.mark.django_db(transaction=True)

MODULE = "tests.agent_handlers_left_open"


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    path = tmp_path / "ledger.txt"
    monkeypatch.setenv("AGENT_LEDGER", str(path))
    return path


def _table_exists(name: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s)", [name])
        return cursor.fetchone()[0] is not None


def test_killed_as_the_left_open_transaction_is_rolled_back_the_call_is_uncertain_and_undone_once(community, ledger):
    run_id = intake_event(community.id, "test", "k1", {"table": "left_open_k1"}, AGENT).run_id
    code, _, err = worker(
        community, "left_open_then_effect", ledger, "--async", kill="left_open", handler_module=MODULE
    )
    assert code == -9, err
    assert not _table_exists("left_open_k1")  # the dead connection's transaction: rolled back
    assert [e.status for e in JournalEntry.objects.filter(run_id=run_id)] == ["pending"]
    reclaim(run_id)
    code, summary, err = worker(community, "left_open_then_effect", ledger, "--async", handler_module=MODULE)
    assert code == 0 and summary["compensated"] == 1, (summary, err)
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.failure_code) == ("failed", "uncertain_call")
    entries = [(e.status, e.uncertain, e.compensation_status) for e in JournalEntry.objects.filter(run_id=run_id)]
    assert entries == [("failed", True, "compensated")]
    assert h_lines(ledger) == [f"made {run_id}:1", f"undo {run_id}:1:compensate"]  # made once, never again


def test_a_call_failed_transaction_left_open_is_replayed_failed_after_a_kill_not_made_again(community, ledger):
    run_id = intake_event(community.id, "test", "k2", {"table": "left_open_k2"}, AGENT).run_id
    code, _, err = worker(community, "left_open_then_effect", ledger, "--async", kill="after:2", handler_module=MODULE)
    assert code == -9, err
    reclaim(run_id)
    code, summary, err = worker(community, "left_open_then_effect", ledger, "--async", handler_module=MODULE)
    assert code == 0 and summary["completed"] == 1, (summary, err)
    run = AgentRun.objects.get(id=run_id)
    assert "transaction_left_open" in run.output["first"], run.output
    entries = list(JournalEntry.objects.filter(run_id=run_id).order_by("seq"))
    assert [(e.tool_name, e.status) for e in entries] == [("leave", "failed"), ("effect", "succeeded")]
    assert "transaction_left_open" in entries[0].error
    assert [x for x in h_lines(ledger) if x.startswith("made")] == [f"made {run_id}:1"]
    assert not _table_exists("left_open_k2")
