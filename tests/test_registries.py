"""Callables are found only in registries the server declares (issue 27, SPEC 16 "Trust"): a
name written into stored data, even the ``module:callable`` of an importable function, is looked
up, never imported; an unknown one fails that one item with a code."""

from __future__ import annotations

import pytest

from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows.registry import get_function
from buzz_delivery.workflows.services import get_run
from buzz_delivery.workflows.testing import function_step, run_until_idle
from tests.wf_support import start

pytestmark = pytest.mark.django_db

CALLED: list[object] = []


def importable(input, context):  # never registered: a definition naming it must not run it
    CALLED.append(input)
    return {}


@pytest.mark.parametrize(
    "name", ["tests.test_registries:importable", "tests.test_registries.importable", "os:getcwd", "builtins:eval"]
)
def test_a_function_step_naming_an_importable_but_unregistered_callable_fails_without_running_it(community, name):
    workflow = WorkflowFactory(community=community)
    run = start(workflow, {"steps": [function_step("a", name)]})
    run_until_idle(community.id)
    step = get_run(community.id, run.pk).step("a")
    assert (step.state, step.failure_code) == ("failed", "function_not_registered")
    assert get_function(name) is None and CALLED == []
