"""The workflow engine (SPEC section 11): durable DAG runs whose ``send_message`` steps produce
deliveries through the core's public services. Install it as ``buzz_delivery.workflows`` after
``buzz_delivery`` in ``INSTALLED_APPS``. Public API: :mod:`buzz_delivery.workflows.services`,
and here the names a project's own ``workflows.py`` uses::

    from buzz_delivery.workflows import workflow_function, StepContext, PermanentStepFailure

Functions decorated in a ``workflows.py`` module of an installed app are registered when
Django starts, in every process (see :mod:`buzz_delivery.workflows.registry`)."""

from buzz_delivery.workflows.registry import PermanentStepFailure, StepContext, workflow_function

__all__ = ["PermanentStepFailure", "StepContext", "workflow_function"]
