"""The demo's workflow function steps, registered with the engine's registry by name
(``@workflow_function``); imported by the demo app's ``ready()``, so every worker has them."""

from __future__ import annotations

import time
from typing import Any

from buzz_delivery.workflows.registry import StepContext, workflow_function


@workflow_function("demo.classify")
def classify(input: dict[str, Any], context: StepContext) -> dict[str, Any]:
    """Reads the request: urgent when its text says so (the triage's condition reads this)."""
    text = str(input.get("text", ""))
    return {"urgent": "urgent" in text.lower(), "words": len(text.split())}


@workflow_function("demo.enrich")
def enrich(input: dict[str, Any], context: StepContext) -> dict[str, Any]:
    time.sleep(0.05)
    return {"customer": input.get("customer", "anonymous"), "tier": "gold" if input.get("words", 0) > 3 else "basic"}


@workflow_function("demo.file_ticket")
def file_ticket(input: dict[str, Any], context: StepContext) -> dict[str, Any]:
    return {"ticket": f"T-{str(context.run_id)[-6:]}"}


@workflow_function("demo.summarize")
def summarize(input: dict[str, Any], context: StepContext) -> dict[str, Any]:
    return {"done": True, "step": context.step_key}


@workflow_function("demo.crunch")
def crunch(input: dict[str, Any], context: StepContext) -> dict[str, Any]:
    """A long computation: on its first attempt it never ends (the demo kills the workflow
    worker holding it with SIGKILL; the maintenance reclaims the lapsed lease), then it runs."""
    if context.attempt == 1:
        while True:
            time.sleep(3600)
    return {"crunched": context.attempt}


@workflow_function("demo.tally")
def tally(input: dict[str, Any], context: StepContext) -> dict[str, Any]:
    """A slow step (2 s): the demo fences its community while a worker holds it."""
    time.sleep(2.0)
    return {"tallied": True}
