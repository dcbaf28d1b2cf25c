"""Text the database cannot take never ends a run's task in the event-loop worker (review of issue
29): an exception text over 10,000 characters, or with a NUL, raised by a compensation, a tool or
the handler, is made storable and cut as the thread worker makes it (``failure_message_of``), so
the compensation fails (once), the call is recorded failed, the run fails, each as with short
text; a compensation raising ``SystemExit`` fails that compensation, never the worker. Before
the fix each of these raised ``ValidationError`` (or ``SystemExit``) out of ``run_claim``: the run
was left to lapse and be reclaimed, and its compensation made again at each reclaim."""

from __future__ import annotations

import uuid

import pytest

from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.agents.services import Created, intake_event
from tests import agent_async_handlers as ah
from tests import agent_handlers as h
from tests.agents_support import AGENT
from tests.test_agents_aio import in_process, ledger  # noqa: F401  (ledger: the fixture)

pytestmark = pytest.mark.django_db(transaction=True)
STORED_HUGE = ("RuntimeError: " + ah.HUGE)[:10_000]


def run_with(community_id, how: str) -> uuid.UUID:
    outcome = intake_event(community_id, "test", uuid.uuid4().hex, {"how": how}, AGENT)
    assert isinstance(outcome, Created)
    return outcome.run_id


def test_unstorable_compensation_errors_fail_the_compensation_once_never_the_task(community, ledger):  # noqa: F811
    runs = {how: run_with(community.id, how) for how in ("undo_huge", "undo_nul", "undo_exits")}
    _, counts = in_process(community, ah.unstorable_texts, in_flight=8, connections=1)

    assert counts["compensation_failed"] == 3 and not counts.get("lost"), counts
    entries = {e.run_id: e for e in JournalEntry.objects.filter(run_id__in=runs.values())}
    errors = {how: entries[run_id].compensation_error for how, run_id in runs.items()}
    assert errors == {
        "undo_huge": STORED_HUGE,
        "undo_nul": "RuntimeError: before\\x00after",
        "undo_exits": "SystemExit: a compensation must not stop the worker",
    }
    assert {entries[r].compensation_status for r in runs.values()} == {"compensation_failed"}
    assert set(AgentRun.objects.filter(id__in=runs.values()).values_list("state", flat=True)) == {"failed"}
    attempts = [line for line in h.ledger_lines() if line.startswith("undo-attempt ")]
    assert len(attempts) == 3 and len(set(attempts)) == 3  # each compensation made once


def test_unstorable_tool_and_handler_errors_are_recorded_cut_and_escaped(community, ledger):  # noqa: F811
    hows = ("tool_huge", "tool_nul", "raise_huge", "raise_nul", "code")
    runs = {how: run_with(community.id, how) for how in hows}
    _, counts = in_process(community, ah.unstorable_texts, in_flight=8, connections=1)

    assert counts["failed"] == len(hows) and not counts.get("lost"), counts
    rows = {r.id: r for r in AgentRun.objects.filter(id__in=runs.values())}
    assert {how: (rows[r].state, rows[r].failure_code) for how, r in runs.items()} == {
        "tool_huge": ("failed", "tool_call_failed"),
        "tool_nul": ("failed", "tool_call_failed"),
        "raise_huge": ("failed", "handler_error"),
        "raise_nul": ("failed", "handler_error"),
        "code": ("failed", "c\\x00" + "c" * 59),
    }
    assert rows[runs["raise_huge"]].failure_message == STORED_HUGE
    assert rows[runs["raise_nul"]].failure_message == "RuntimeError: a\\x00b"
    calls = {e.run_id: e for e in JournalEntry.objects.filter(run_id__in=[runs["tool_huge"], runs["tool_nul"]])}
    assert (calls[runs["tool_huge"]].status, calls[runs["tool_huge"]].uncertain) == ("failed", False)
    assert calls[runs["tool_huge"]].error == STORED_HUGE
    assert calls[runs["tool_nul"]].error == "RuntimeError: a\\x00b"
