"""Publishing definition versions (SPEC section 11 "Definition")."""

from __future__ import annotations

import uuid
from typing import Any

from django.db import transaction

from buzz_delivery.models import Workflow
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, translated_errors
from buzz_delivery.services.tenancy import tenant_scoped
from buzz_delivery.workflows import definition as d
from buzz_delivery.workflows.builder import Definition
from buzz_delivery.workflows.models import DefinitionVersion

LOCK_WORKFLOW = """SELECT 1 FROM buzz_delivery_workflow
WHERE community_id = %(community_id)s AND id = %(workflow_id)s FOR NO KEY UPDATE"""


@tenant_scoped
def publish_definition(
    community_id: uuid.UUID | str, workflow_id: uuid.UUID | str, definition: dict[str, Any] | Definition
) -> DefinitionVersion:
    """Validate ``definition`` (JSON, or a code-first :class:`~buzz_delivery.workflows.builder.Definition`,
    whose JSON it stores) and store it as the workflow's next immutable version.

    Identical content (same canonical JSON after normalisation) returns the existing version
    and writes nothing. Versions number 1, 2, ... per workflow; concurrent publishers of one
    workflow are serialised on its row. Returns the :class:`DefinitionVersion` (its
    ``definition_event_id`` is what its runs' deliveries bind to).

    Raises ``ValidationError`` keyed ``community_id``, ``workflow_id``, ``definition`` or
    ``steps[<i>].<field>`` (naming the step) before anything is written, including when the
    workflow or a ``sub_workflow``'s workflow is not one of this community;
    :class:`~buzz_delivery.exceptions.CommunityNotWritable` when the community is not active.
    SPEC section 11.
    """
    community = v.uuid_value(community_id, "community_id")
    workflow = v.uuid_value(workflow_id, "workflow_id")
    norm = d.validate_definition(definition.to_json() if isinstance(definition, Definition) else definition)
    if not Workflow.objects.filter(community_id=community, id=workflow).exists():
        raise v.invalid("workflow_id", "no such workflow in this community")
    for i, step in enumerate(norm["steps"]):
        named = step if step["kind"] == "sub_workflow" else step.get("do", {})
        field = "workflow" if step["kind"] == "sub_workflow" else "do.workflow"
        if "workflow" in named and not Workflow.objects.filter(community_id=community, id=named["workflow"]).exists():
            raise v.invalid(f"steps[{i}].{field}", f"step {step['key']!r}: no such workflow in this community")
    digest = d.content_hash(norm)
    with transaction.atomic(), translated_errors():
        fetch_all(LOCK_WORKFLOW, {"community_id": community, "workflow_id": workflow})
        existing = DefinitionVersion.objects.filter(
            community_id=community, workflow_id=workflow, content_hash=digest
        ).first()
        if existing is not None:
            return existing
        last = (
            DefinitionVersion.objects.filter(community_id=community, workflow_id=workflow)
            .order_by("-version")
            .values_list("version", flat=True)
            .first()
        )
        return DefinitionVersion.objects.create(
            community_id=community,
            workflow_id=workflow,
            version=(last or 0) + 1,
            content=norm,
            content_hash=digest,
            definition_event_id=d.definition_event_id(workflow, digest),
        )
