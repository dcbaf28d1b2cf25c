"""Found by ``buzz_delivery.workflows.registry.autodiscover`` (as Django finds ``admin.py``)."""

from typing import Any

from buzz_delivery.workflows import StepContext, workflow_function


@workflow_function("wf_app.shout")
def shout(input: dict[str, Any], context: StepContext) -> dict[str, Any]:
    return {"said": str(input.get("text", "")).upper(), "step": context.step_key}
