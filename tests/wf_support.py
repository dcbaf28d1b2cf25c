"""Helpers of the workflow engine tests."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
from django.db import connection

from buzz_delivery.services import Cause
from buzz_delivery.workflows.models import Approval, DefinitionVersion, Run, Step
from buzz_delivery.workflows.registry import workflow_function
from buzz_delivery.workflows.services import publish_definition, start_run

ENGINE_MODELS = (Approval, Step, Run, DefinitionVersion)


def counts() -> dict[str, int]:
    """Rows per engine table (and the core's runs and deliveries)."""
    from buzz_delivery.models import Event, WorkflowAgentDelivery, WorkflowRun

    return {
        m._meta.db_table: m._base_manager.count() for m in (*ENGINE_MODELS, WorkflowRun, WorkflowAgentDelivery, Event)
    }


def start(workflow: Any, definition: dict[str, Any], input: dict | None = None, **kwargs: Any) -> Run:
    version = publish_definition(workflow.community_id, workflow.id, definition)
    return start_run(
        workflow.community_id,
        workflow.id,
        input or {},
        cause=kwargs.pop("cause", Cause.event(os.urandom(32))),
        version=version.version,
        **kwargs,
    )


def states(run: Run) -> dict[str, str]:
    return dict(Step.objects.filter(community_id=run.community_id, run_id=run.pk).values_list("key", "state"))


def run_state(run: Run) -> str:
    return Run.objects.get(pk=run.pk).state


def backdate_step_lease(step_id: Any, seconds: float = 3600) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_workflows_step SET lease_until = now() - make_interval(secs => %s),"
            " claimed_at = buzz_delivery_plus_seconds(claimed_at, -%s) WHERE id = %s",
            [seconds, seconds, step_id],
        )


CALLS: list[tuple[str, dict]] = []


@workflow_function("test.record")
def record(input: dict, context: Any) -> dict:
    CALLS.append((context.step_key, input))
    return {"key": context.step_key, **input}


@workflow_function("test.boom")
def boom(input: dict, context: Any) -> dict:
    raise RuntimeError("boom")


@workflow_function("test.huge")
def huge(input: dict, context: Any) -> str:
    return "x" * 400_000


@workflow_function("test.not_json")
def not_json(input: dict, context: Any) -> object:
    return object()


@workflow_function("test.flag")
def flag(input: dict, context: Any) -> dict:
    return {"ok": input.get("ok", True)}


@workflow_function("test.async_wait")
async def async_wait(input: dict, context: Any) -> dict:
    """An ``async def`` function step: awaits an I/O wait, then answers."""
    await asyncio.sleep(float(input.get("sleep", 0.01)))
    return {"awaited": True, "step": context.step_key}


@workflow_function("test.async_boom")
async def async_boom(input: dict, context: Any) -> dict:
    await asyncio.sleep(0)
    raise RuntimeError("async boom")


@workflow_function("test.async_permanent")
async def async_permanent(input: dict, context: Any) -> dict:
    from buzz_delivery.workflows.registry import PermanentStepFailure

    raise PermanentStepFailure("nope", failure_code="async_refused")


def wait_until(condition, what: str, timeout: float = 30) -> None:
    """Poll ``condition`` every 50 ms; fail the test naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
