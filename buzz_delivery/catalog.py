"""The deletion catalog (SPEC section 5): every community-scoped table, child before parent.

``purge_community`` deletes a fenced community's rows in this order. The drift test in
``tests/test_lifecycle.py`` fails when a model with a community foreign key is missing here,
or when an entry names a table that no longer exists.

Sibling apps (``buzz_delivery.workflows``, later ``agents``...) register their own tables: an
installed app whose ``AppConfig`` has a ``buzz_deletion_catalog`` attribute (a tuple of model
labels, children first) has those entries deleted before the core's, and the later an app is
listed in ``INSTALLED_APPS``, the earlier its entries come (an app builds on the ones listed
before it, so its rows reference theirs). Such an app also guards the tombstone move for its
own tables (a trigger of its migration on ``buzz_delivery_community``, see
:mod:`buzz_delivery.triggers`).
"""

from __future__ import annotations

from django.apps import apps
from django.db import models

# App labels of the core's models, children first: a queue row points at its record, deliveries
# point at runs, events and workflows; runs point at workflows.
DELETION_CATALOG: tuple[str, ...] = (
    "buzz_delivery.SettleTally",  # counts of settles, no key to anything (core 0039)
    "buzz_delivery.RateLimit",
    "buzz_delivery.DeliveryQueue",  # a delivery's live state, before its record (issue 31, stage 2)
    "buzz_delivery.DeliveryRecord",
    "buzz_delivery.WorkflowRun",
    "buzz_delivery.Event",
    "buzz_delivery.Workflow",
)

# The AppConfig attribute a sibling app sets to register its tables.
CATALOG_ATTRIBUTE = "buzz_deletion_catalog"


def deletion_catalog() -> tuple[str, ...]:
    """The whole catalog: every installed sibling app's entries (the last-listed app first),
    then the core's :data:`DELETION_CATALOG`. Model labels, in deletion order."""
    entries: list[str] = []
    for config in reversed(list(apps.get_app_configs())):
        if config.name == "buzz_delivery":
            continue
        entries.extend(getattr(config, CATALOG_ATTRIBUTE, ()) or ())
    return (*entries, *DELETION_CATALOG)


def catalog_models() -> list[type[models.Model]]:
    """The catalog's models (:func:`deletion_catalog`), in deletion order."""
    return [apps.get_model(label) for label in deletion_catalog()]
