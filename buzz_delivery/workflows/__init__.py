"""The workflow engine (SPEC section 11): durable DAG runs whose ``send_message`` steps produce
deliveries through the core's public services. Install it as ``buzz_delivery.workflows`` after
``buzz_delivery`` in ``INSTALLED_APPS``. Public API: :mod:`buzz_delivery.workflows.services`,
and here the names a project's own ``workflows.py`` uses::

    from buzz_delivery.workflows import workflow_function, StepContext, PermanentStepFailure
    from buzz_delivery.workflows import Definition, Each, ref   # code-first definitions

Functions decorated in a ``workflows.py`` module of an installed app are registered when
Django starts, in every process (see :mod:`buzz_delivery.workflows.registry`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from buzz_delivery.workflows.registry import PermanentStepFailure, StepContext, workflow_function

if TYPE_CHECKING:
    from buzz_delivery.workflows.builder import Definition, Each, ref

# The builder validates with the core's services, which load models: imported on first use, so
# this package stays importable while Django loads its apps.
_LAZY = {"Definition", "Each", "ref"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from buzz_delivery.workflows import builder

        return getattr(builder, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Definition", "Each", "PermanentStepFailure", "StepContext", "ref", "workflow_function"]
