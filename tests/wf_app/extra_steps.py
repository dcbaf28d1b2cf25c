"""Named in ``BUZZ_WORKFLOWS['MODULES']`` by ``tests/settings_wf_app.py``."""

from typing import Any

from buzz_delivery.workflows import StepContext, workflow_function


@workflow_function("wf_app.count")
def count(input: dict[str, Any], context: StepContext) -> dict[str, Any]:
    return {"n": len(input.get("items", []))}
