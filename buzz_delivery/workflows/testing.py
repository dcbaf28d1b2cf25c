"""Test helpers for projects that install ``buzz_delivery.workflows``: factories and helpers
that go through the public services (definitions are published, runs started, steps claimed
and completed by the real statements), plus :func:`run_until_idle`, a single-process
orchestrator loop for tests. Needs ``factory-boy`` (the ``testing`` extra)."""

from __future__ import annotations

import os
from typing import Any

try:
    import factory
except ImportError as exc:  # a plain install: say which extra brings it
    raise ImportError(
        "buzz_delivery.workflows.testing needs factory-boy: pip install 'buzz-delivery[testing]'", name=exc.name
    ) from exc

from buzz_delivery.services import Cause
from buzz_delivery.testing import CommunityFactory, WorkflowFactory
from buzz_delivery.workflows import executor
from buzz_delivery.workflows.models import DefinitionVersion, Run
from buzz_delivery.workflows.services import claim_steps, publish_definition, start_run


def function_step(key: str, function: str = "noop", **fields: Any) -> dict[str, Any]:
    """A ``function`` step definition."""
    return {"key": key, "kind": "function", "function": function, **fields}


def send_step(key: str, targets: list[bytes], content: str = "hello", **fields: Any) -> dict[str, Any]:
    """A ``send_message`` step definition to ``targets`` (32-byte keys)."""
    return {"key": key, "kind": "send_message", "targets": [t.hex() for t in targets], "content": content, **fields}


def diamond(function: str = "noop") -> dict[str, Any]:
    """DBOS's shape: step1; step2 and step3 after it; step4 after both."""
    return {
        "steps": [
            function_step("step1", function),
            function_step("step2", function, depends_on=["step1"]),
            function_step("step3", function, depends_on=["step1"]),
            function_step("step4", function, depends_on=["step2", "step3"]),
        ]
    }


class DefinitionVersionFactory(factory.Factory):
    """Publishes ``definition`` (default: :func:`diamond`) for a new workflow through
    :func:`publish_definition`; pass ``workflow=`` to publish for an existing one."""

    class Meta:
        model = DefinitionVersion

    workflow = factory.LazyFunction(lambda: WorkflowFactory(community=CommunityFactory()))
    definition = factory.LazyFunction(diamond)

    @classmethod
    def _create(cls, model_class: type, workflow: Any, definition: dict[str, Any]) -> DefinitionVersion:
        return publish_definition(workflow.community_id, workflow.id, definition)

    _build = _create


class RunFactory(factory.Factory):
    """Starts a run of ``version`` (default: a new :class:`DefinitionVersionFactory`) through
    :func:`start_run`, with a fresh event cause."""

    class Meta:
        model = Run

    version = factory.SubFactory(DefinitionVersionFactory)
    input = factory.LazyFunction(dict)
    cause = factory.LazyFunction(lambda: Cause.event(os.urandom(32)))

    @classmethod
    def _create(cls, model_class: type, version: DefinitionVersion, input: Any, cause: Cause) -> Run:
        return start_run(version.community_id, version.workflow_id, input, cause=cause, version=version.version)

    _build = _create


def run_until_idle(community_id: Any, *, max_steps: int = 10_000, lease_seconds: float = 60) -> int:
    """Claim and execute ready steps of one community until none is claimable now; returns
    how many were executed. A stand-in for ``run_workflow_worker`` inside a test transaction."""
    done = 0
    while done < max_steps:
        claims = claim_steps(community_id, limit=10, lease_seconds=lease_seconds)
        if not claims:
            return done
        for claim in claims:
            executor.execute(claim)
            done += 1
    return done
