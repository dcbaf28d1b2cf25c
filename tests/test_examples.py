"""The code-first engine example (``examples/order_fulfilment.py``, shown in docs/workflows.md)
runs as written, as a script, against a fresh test database (issue 33): a newcomer copies it."""

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
EXAMPLE = ROOT / "examples" / "order_fulfilment.py"
DOCS = ROOT / "docs" / "workflows.md"


@pytest.mark.django_db(transaction=True)
def test_the_code_first_example_runs_as_a_script_against_a_fresh_database():
    assert not Community.objects.exists()  # fresh
    env = {**os.environ, "DATABASE_URL": database_url(connection.settings_dict), "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run([sys.executable, str(EXAMPLE)], cwd="/", env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    out = done.stdout
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
    env = {**os.environ, "DATABASE_URL": database_url(connection.settings_dict), "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    example = ROOT / "examples" / "agent_inbox.py"
    done = subprocess.run([sys.executable, str(example)], cwd="/", env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "run succeeded" in done.stdout and "agent worker: accepted 2, completed 2" in done.stdout
    assert done.stdout.count('"words": 5') == 2
