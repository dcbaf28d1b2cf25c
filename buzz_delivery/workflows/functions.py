"""Built-in function steps: ``noop`` (returns ``{}``) and ``echo`` (returns its input)."""

from __future__ import annotations

from typing import Any

from buzz_delivery.workflows.registry import StepContext, workflow_function


@workflow_function("noop")
def noop(input: dict[str, Any], context: StepContext) -> dict[str, Any]:
    return {}


@workflow_function("echo")
def echo(input: dict[str, Any], context: StepContext) -> dict[str, Any]:
    return input
