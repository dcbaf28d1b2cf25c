"""Function steps are found without a trap (issue 33): a ``workflows.py`` module of an installed
app, and the modules named in ``BUZZ_WORKFLOWS['MODULES']``, are imported when Django starts, so
``run_workflow_worker`` runs their functions with no import of its own; a step that names a
function the worker does not have says so in the worker's log, its summary, the step's failure
message and the admin's "why" line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection
from django.test import override_settings

from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows import dag, registry
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.registry import autodiscover, get_function, registered_names
from project.database_url import database_url
from tests.wf_support import start

ROOT = Path(__file__).resolve().parent.parent


def worker(community_id, settings: str = "project.settings") -> tuple[dict, str]:
    """``manage.py run_workflow_worker`` as a real process until it has been idle a second."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": settings,
    }
    done = subprocess.run(
        [sys.executable, "manage.py", "run_workflow_worker", "--community", str(community_id), "--idle-exit", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_the_decorator_is_importable_from_the_package():
    from buzz_delivery.workflows import PermanentStepFailure, StepContext, workflow_function

    assert callable(workflow_function) and StepContext and issubclass(PermanentStepFailure, Exception)


@pytest.mark.django_db(transaction=True)
def test_run_workflow_worker_runs_functions_of_an_apps_workflows_module_without_import_glue(community):
    # This process does not install tests.wf_app: only the worker's settings do.
    assert get_function("wf_app.shout") is None and get_function("wf_app.count") is None
    workflow = WorkflowFactory(community=community)
    run = start(
        workflow,
        {
            "steps": [
                {"key": "shout", "kind": "function", "function": "wf_app.shout", "input": {"text": "hi"}},
                {"key": "count", "kind": "function", "function": "wf_app.count", "input": {"items": [1, 2, 3]}},
            ]
        },
    )

    summary, _ = worker(community.id, settings="tests.settings_wf_app")

    assert (summary["claimed"], summary["succeeded"], summary["failed"], summary["not_registered"]) == (2, 2, 0, {})
    outputs = dict(Step.objects.filter(run_id=run.pk).values_list("key", "output"))
    assert outputs == {"shout": {"said": "HI", "step": "shout"}, "count": {"n": 3}}
    assert Run.objects.get(pk=run.pk).state == "succeeded"


@pytest.mark.django_db(transaction=True)
def test_a_step_whose_function_is_missing_says_so_in_the_log_the_summary_and_the_admin(community):
    workflow = WorkflowFactory(community=community)
    run = start(workflow, {"steps": [{"key": "lost", "kind": "function", "function": "shop.missing"}]})

    summary, log = worker(community.id)

    assert summary["not_registered"] == {"shop.missing": 1}
    assert (summary["claimed"], summary["failed"]) == (1, 1)
    assert "function_not_registered" in log and "@workflow_function('shop.missing')" in log
    assert "workflows.py" in log and "functions_registered" in log
    step = Step.objects.get(run_id=run.pk, key="lost")
    assert (step.state, step.failure_code) == ("failed", "function_not_registered")
    assert "no function 'shop.missing' is registered" in step.failure_message
    assert "noop" in step.failure_message  # what the worker had instead
    why = dag.why_not_running(step, step.finished_at)
    assert "no function 'shop.missing' is registered" in why and "@workflow_function" in why


def test_autodiscover_imports_the_modules_the_settings_name(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # undone after the test
    sys.modules.pop("tests.wf_app.extra_steps", None)
    assert get_function("wf_app.count") is None
    with override_settings(BUZZ_WORKFLOWS={"MODULES": ["tests.wf_app.extra_steps"]}):
        imported = autodiscover()
        assert "tests.wf_app.extra_steps" in imported
        assert get_function("wf_app.count") is not None
        assert "wf_app.count" in registered_names()


@pytest.mark.parametrize(
    "settings_value",
    [
        {"MODULES": "tests.wf_app.extra_steps"},  # a str: its characters would be imported one by one
        {"MODULES": ["tests.wf_app.extra_steps"], "AUTHOR_PUBKEY": "not hex"},  # another key's own check
    ],
)
def test_a_bad_workflows_setting_does_not_stop_discovery_and_its_check_names_it(monkeypatch, settings_value):
    from buzz_delivery.workflows import checks as wf_checks

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    with override_settings(BUZZ_WORKFLOWS=settings_value):
        imported = autodiscover()  # what the app's ready() runs as Django starts
        errors = wf_checks.check_workflow_settings()
    assert "tests.wf_app.extra_steps" in imported or isinstance(settings_value["MODULES"], str)
    assert [e.id for e in errors] == ["buzz_workflows.E002"]
    key = "MODULES" if isinstance(settings_value["MODULES"], str) else "AUTHOR_PUBKEY"
    assert key in errors[0].msg
