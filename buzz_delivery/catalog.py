"""The deletion catalog (SPEC section 5): every community-scoped table, child before parent.

``purge_community`` deletes a fenced community's rows in this order. The drift test in
``tests/test_lifecycle.py`` fails when a model with a community foreign key is missing here,
or when an entry names a table that no longer exists.
"""

from __future__ import annotations

from django.apps import apps
from django.db import models

# App labels of the models, children first: deliveries point at runs, events and workflows;
# runs point at workflows.
DELETION_CATALOG: tuple[str, ...] = (
    "buzz_delivery.WorkflowAgentDelivery",
    "buzz_delivery.WorkflowRun",
    "buzz_delivery.Event",
    "buzz_delivery.Workflow",
)


def catalog_models() -> list[type[models.Model]]:
    """The catalog's models, in deletion order."""
    return [apps.get_model(label) for label in DELETION_CATALOG]
