"""System checks of the apps' settings dicts: ``BUZZ_WORKFLOWS`` (``buzz_workflows.E0xx``,
registered by buzz_delivery.workflows) and ``BUZZ_AGENTS`` (``buzz_agents.E0xx``, registered by
buzz_delivery.agents). Before them a misspelt key was ignored silently and a bad value surfaced
only when a worker started: a traceback (run_workflow_worker) or a dict (run_agent_worker)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core import checks as django_checks
from django.db import connection
from django.test import override_settings

from project.database_url import database_url

ROOT = Path(__file__).resolve().parent.parent
AGENT = "ab" * 32


def ids(messages) -> list[str]:
    return [m.id for m in messages]


def test_the_project_settings_pass_the_apps_checks():
    found = [m for m in django_checks.run_checks() if m.id.startswith(("buzz_workflows.", "buzz_agents."))]
    assert found == []


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ({"MAX_ATTEMPS": 3}, ["buzz_workflows.E001"]),
        ({"LEASE_SECONDS": "60"}, ["buzz_workflows.E002"]),
        ({"LEASE_SECONDS": 1}, ["buzz_workflows.E003"]),
        ({"LEASE_SECONDS": 301}, ["buzz_workflows.E003"]),
        ({"FUNCTIONS": ["myapp.steps:resize"]}, ["buzz_workflows.E002"]),
        ({"FUNCTIONS": {"resize": "myapp.steps.resize"}}, ["buzz_workflows.E002"]),
        ({"FUNCTIONS": {"re size": "myapp.steps:resize"}}, ["buzz_workflows.E002"]),
        ({"MODULES": "myproject.steps"}, ["buzz_workflows.E002"]),
        ({"MAX_OUTPUT_BYTES": 0}, ["buzz_workflows.E003"]),
        ({"MAX_ATTEMPTS": 0}, ["buzz_workflows.E003"]),
        ({"MAX_ATTEMPTS": 2**31}, ["buzz_workflows.E003"]),
        ({"MAX_ATTEMPTS": 2.0}, ["buzz_workflows.E002"]),
        ({"BACKOFF_BASE_SECONDS": -1}, ["buzz_workflows.E003"]),
        ({"AUTHOR_PUBKEY": "00" * 31}, ["buzz_workflows.E002"]),
        ({"MESSAGE_KIND": 2**31}, ["buzz_workflows.E003"]),
        ({"EVENT_RETENTION_SECONDS": None}, ["buzz_workflows.E002"]),
        ({"EVENT_RETENTION_SECONDS": 0}, ["buzz_workflows.E003"]),
        ({"EVENT_RETENTION_SECONDS": 59.5}, ["buzz_workflows.E003"]),
        ({"MAX_ATTEMPS": 3, "LEASE_SECONDS": 1}, ["buzz_workflows.E001", "buzz_workflows.E003"]),
    ],
)
def test_a_bad_workflows_setting_is_reported_under_its_check_id(setting, expected):
    with override_settings(BUZZ_WORKFLOWS=setting):
        assert ids(m for m in django_checks.run_checks() if m.id.startswith("buzz_workflows.")) == expected


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ({"MAX_ATTEMPS": 3}, ["buzz_agents.E001"]),
        ({"LEASE_SECONDS": "60"}, ["buzz_agents.E002"]),
        ({"LEASE_SECONDS": 1}, ["buzz_agents.E003"]),
        ({"MAX_ATTEMPTS": 0}, ["buzz_agents.E003"]),
        ({"MAX_ATTEMPTS": True}, ["buzz_agents.E002"]),
        ({"RETRY_DELAY_SECONDS": -5}, ["buzz_agents.E003"]),
        ({"MAX_COST": -1}, ["buzz_agents.E003"]),
        ({"MAX_TIMEOUT_SECONDS": 0}, ["buzz_agents.E003"]),
        ({"MAX_TIMEOUT_SECONDS": 10**13}, ["buzz_agents.E003"]),
        ({"MAX_LEASE_SECONDS": 14}, ["buzz_agents.E003"]),
        ({"MAX_ATTEMPTS": 2**31}, ["buzz_agents.E003"]),
        ({"SHADOW": "yes"}, ["buzz_agents.E002"]),
        ({"MAX_OUTPUT_BYTES": "256000"}, ["buzz_agents.E002"]),
        ({"MAX_CHUNK_BYTES": 0}, ["buzz_agents.E003"]),
        ({"MAX_ATTEMPS": 3, "LEASE_SECONDS": 1}, ["buzz_agents.E001", "buzz_agents.E003"]),
    ],
)
def test_a_bad_agents_setting_is_reported_under_its_check_id(setting, expected):
    with override_settings(BUZZ_AGENTS=setting):
        assert ids(m for m in django_checks.run_checks() if m.id.startswith("buzz_agents.")) == expected


@pytest.mark.parametrize(
    ("name", "setting"),
    [
        ("BUZZ_WORKFLOWS", {"LEASE_SECONDS": 15, "MAX_ATTEMPTS": 100, "BACKOFF_BASE_SECONDS": 0}),
        ("BUZZ_WORKFLOWS", {"MAX_DEPTH": 0, "MAX_MAP_ITEMS": 10_000, "FUNCTIONS": {"resize": "myapp.steps:resize"}}),
        ("BUZZ_WORKFLOWS", {"MAX_ATTEMPTS": 2**31 - 1, "BACKOFF_CAP_SECONDS": 7 * 86400, "MAX_OUTPUT_BYTES": 2**40}),
        ("BUZZ_WORKFLOWS", {"MODULES": ("myproject.steps",), "AUTHOR_PUBKEY": "AB" * 32, "MESSAGE_KIND": 30023}),
        ("BUZZ_AGENTS", {"LEASE_SECONDS": 300.0, "MAX_TIMEOUT_SECONDS": 2**31, "MAX_COST": 2**62}),
        ("BUZZ_AGENTS", {"MAX_LEASE_SECONDS": 15, "MAX_CHUNK_BYTES": 16, "MAX_STREAM_BYTES": 40, "SHADOW": True}),
        ("BUZZ_AGENTS", {"RETRY_DELAY_SECONDS": 100, "RETRY_DELAY_MAX_SECONDS": 100, "MAX_TOOL_CALLS": 0}),
        ("BUZZ_AGENTS", {"MAX_ATTEMPTS": 101, "MAX_TOOL_CALLS": 100_001, "RETRY_DELAY_MAX_SECONDS": 7 * 86400}),
        (
            "BUZZ_AGENTS",
            {"MAX_LEASE_SECONDS": 600, "MAX_OUTPUT_BYTES": 2**40, "MAX_CHUNK_BYTES": 2**31, "MAX_STREAM_BYTES": 2**40},
        ),
    ],
)
def test_edge_values_the_apps_honour_pass(name, setting):
    with override_settings(**{name: setting}):
        assert [m for m in django_checks.run_checks() if m.id.startswith(("buzz_workflows.", "buzz_agents."))] == []


@pytest.mark.parametrize(
    ("name", "setting", "expected"),
    [
        ("BUZZ_WORKFLOWS", {"BACKOFF_BASE_SECONDS": 10, "BACKOFF_CAP_SECONDS": 5}, ["buzz_workflows.W004"]),
        ("BUZZ_WORKFLOWS", {"MAX_DEPTH": 9, "MAX_MAP_ITEMS": 10_001}, ["buzz_workflows.W005"] * 2),
        ("BUZZ_AGENTS", {"RETRY_DELAY_SECONDS": 600}, ["buzz_agents.W004"]),
        ("BUZZ_AGENTS", {"MAX_CHUNK_BYTES": 100, "MAX_STREAM_BYTES": 50}, ["buzz_agents.W004"]),
    ],
)
def test_a_value_the_apps_clamp_or_cap_is_a_warning_not_an_error(name, setting, expected):
    """Values the runtime took before these checks (it clamps MAX_DEPTH and MAX_MAP_ITEMS, caps
    a backoff at its cap, bounds a chunk by the stream): an upgrade must not stop check and the
    workers on them."""
    with override_settings(**{name: setting}):
        found = [m for m in django_checks.run_checks() if m.id.startswith(("buzz_workflows.", "buzz_agents."))]
    assert [m.id for m in found] == expected
    assert all(m.level == django_checks.WARNING for m in found)


def test_a_message_names_the_setting_and_its_key():
    with override_settings(BUZZ_WORKFLOWS={"LEASE_SECONDS": 1}, BUZZ_AGENTS={"MAX_ATTEMPTS": "3"}):
        messages = {m.id: m.msg for m in django_checks.run_checks() if m.id.startswith(("buzz_w", "buzz_a"))}
    assert messages["buzz_workflows.E003"].startswith("BUZZ_WORKFLOWS['LEASE_SECONDS'] must be within 15..300")
    assert messages["buzz_agents.E002"] == "BUZZ_AGENTS['MAX_ATTEMPTS'] must be an int, not str."


def manage(*args: str) -> subprocess.CompletedProcess[str]:
    """``manage.py`` as a real process, with the settings the trial wrote."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": "tests.settings_misspelt_apps",
    }
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_check_and_the_workers_report_the_misspelt_settings_without_a_traceback():
    checked = manage("check")
    assert checked.returncode == 1
    for id_ in ("buzz_workflows.E001", "buzz_workflows.E003", "buzz_agents.E001", "buzz_agents.E003"):
        assert id_ in checked.stderr
    assert "BUZZ_WORKFLOWS has an unknown key 'MAX_ATTEMPS'" in checked.stderr

    started = manage("run_workflow_worker", "--all", "--idle-exit", "1")
    assert started.returncode == 1 and "buzz_workflows.E003" in started.stderr
    assert "Traceback" not in started.stderr

    # Past the checks the setting still fails in one line, naming it.
    skipped = manage("run_workflow_worker", "--all", "--idle-exit", "1", "--skip-checks")
    assert skipped.returncode == 2, skipped.stderr
    assert "Traceback" not in skipped.stderr
    assert skipped.stderr.strip() == (
        "CommandError: BUZZ_WORKFLOWS['LEASE_SECONDS'] must be within 15..300 seconds, got 1"
    )
    agents = manage("run_agent_worker", "--handler", "x.y", "--agent", AGENT, "--exit-when-idle", "--skip-checks")
    assert agents.returncode == 2, agents.stderr
    assert agents.stderr.strip() == (
        "CommandError: BUZZ_AGENTS['LEASE_SECONDS'] must be within 15..300 seconds, got 1; run manage.py check"
    )
