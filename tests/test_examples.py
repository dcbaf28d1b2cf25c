"""Every program under ``examples/`` runs as written, as a script, against a fresh test database
(issues 33 and 36): a newcomer copies them, and the README points at each. The code-first engine
example (``examples/order_fulfilment.py``) is also quoted by docs/workflows.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

from buzz_delivery.models import Community
from project.database_url import database_url

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
EXAMPLE = EXAMPLES / "order_fulfilment.py"
DOCS = ROOT / "docs" / "workflows.md"


def run_example(path: Path) -> str:
    """Run ``path`` as a newcomer would (``python examples/x.py`` with only ``DATABASE_URL`` set,
    from another folder), against the test database; its stdout."""
    assert not Community.objects.exists()  # fresh
    env = {**os.environ, "DATABASE_URL": database_url(connection.settings_dict)}
    for name in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH", "BUZZ_MIN_LEASE_SECONDS", "LOG_LEVEL"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(path)], cwd="/", env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return done.stdout


# The examples with a test of their own below; any other runs in the catch-all test.
TESTED = {
    "order_fulfilment.py",
    "inbox.py",
    "agent_run.py",
    "agent_inbox.py",
    "gateway_agent.py",
    "background_tasks.py",
    "traced_agent.py",
}


def test_the_examples_tested_by_name_exist():
    assert {p.name for p in EXAMPLES.glob("*.py")} >= TESTED


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", sorted({p.name for p in EXAMPLES.glob("*.py")} - TESTED))
def test_an_example_without_a_test_of_its_own_still_runs(name):
    run_example(EXAMPLES / name)


@pytest.mark.django_db(transaction=True)
def test_the_code_first_example_runs_as_a_script_against_a_fresh_database():
    out = run_example(EXAMPLE)
    assert "definition v1, 5 steps" in out
    assert "run succeeded: {'ship': {'paid': 1200, 'shipped': ['2 x tea', '1 x cup']}}" in out
    assert "pack[0]=succeeded, pack[1]=succeeded" in out and "cool_off=succeeded" in out


def test_the_docs_show_the_example_as_it_is():
    """docs/workflows.md quotes the example's definition: the quote is the file's own text."""
    source = EXAMPLE.read_text()
    start = source.index("def order_flow()")
    quoted = source[start : source.index("\n\n\n", start)]
    assert quoted in DOCS.read_text(), "docs/workflows.md does not quote examples/order_fulfilment.py's order_flow"


@pytest.mark.django_db(transaction=True)
def test_the_agent_inbox_example_completes_a_workflow_awaiting_agent_runs_with_only_the_bundled_commands():
    """examples/agent_inbox.py (docs/agents.md "Acceptance"): run_workflow_worker and
    run_agent_worker as real processes, nothing else; the run succeeds with both agents' answers."""
    out = run_example(EXAMPLES / "agent_inbox.py")
    assert "run succeeded" in out and "agent worker: accepted 2, completed 2" in out
    assert out.count('"words": 5') == 2


@pytest.mark.django_db(transaction=True)
def test_the_inbox_example_commits_once_reaps_a_dead_holder_and_works_every_delivery():
    out = run_example(EXAMPLES / "inbox.py")
    assert "committed 3 deliveries; the retried step committed 0" in out
    assert "reaper: reclaimed 1" in out
    assert "worker: claimed 3, finished 3" in out
    assert "statuses: ['finished', 'finished', 'finished']" in out


@pytest.mark.django_db(transaction=True)
def test_the_agent_run_example_goes_from_the_workflow_to_the_journal_and_back():
    out = run_example(EXAMPLES / "agent_run.py")
    assert "agent worker: completed 1" in out
    assert "journal: [(1, 'look_up_order', 'succeeded')]" in out
    assert "run succeeded: {'close': {'ticket': 7, 'closed_with': 'order o-42 is shipped'}}" in out


@pytest.mark.django_db(transaction=True)
def test_the_gateway_example_makes_a_key_and_settles_over_http():
    out = run_example(EXAMPLES / "gateway_agent.py")
    assert "key made: agent.key mode 0o600" in out
    assert "claimed over HTTP: 'tell'" in out
    assert "settled: settled finished" in out
    assert "workflow run succeeded" in out


@pytest.mark.django_db(transaction=True)
def test_the_tasks_example_runs_its_tasks_on_the_inbox():
    out = run_example(EXAMPLES / "background_tasks.py")
    assert "enqueued: READY, READY" in out
    assert "add(2, 3): SUCCESSFUL -> 5" in out
    assert "welcome: SUCCESSFUL -> 'sent a welcome to ada@example.com'" in out


@pytest.mark.django_db(transaction=True)
def test_the_tracing_example_prints_one_trace_from_the_producer_to_the_tool_calls():
    """examples/traced_agent.py (quoted in docs/tracing.md) sets the SDK's provider globally, as
    a project does, and prints the spans of its one trace (issue 34)."""
    out = run_example(EXAMPLES / "traced_agent.py")
    expected = """POST /orders
  buzz.workflow.run
    buzz.workflow.step
      buzz.commit
        buzz.agent.accept
          buzz.settle
          buzz.agent.run
            buzz.agent.call (lookup)
            buzz.agent.call (notify)"""
    assert out.strip() == expected
    docs = (ROOT / "docs" / "tracing.md").read_text()
    assert expected in docs  # the docs show what it prints
    source = (EXAMPLES / "traced_agent.py").read_text()
    quoted = source[source.index("def lookup(") : source.index("\n\n\ndef main(")]
    assert quoted in docs, "docs/tracing.md does not quote examples/traced_agent.py's tools and handler"
