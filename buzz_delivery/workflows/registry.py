"""The function-step registry (SPEC section 11 "function"): callables registered by name,
through the ``@workflow_function("name")`` decorator or ``BUZZ_WORKFLOWS['FUNCTIONS']``
(``{"name": "package.module:callable"}``). A function receives the step's resolved input (a
dict) and a :class:`StepContext`, and returns a JSON value (its output)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from buzz_delivery.workflows.conf import get_settings


@dataclass(frozen=True, slots=True)
class StepContext:
    """What a function step knows about itself: ids, its key and the attempt (1-based)."""

    community_id: Any
    run_id: Any
    step_key: str
    attempt: int


StepFunction = Callable[[dict[str, Any], StepContext], Any]
_REGISTRY: dict[str, StepFunction] = {}


class PermanentStepFailure(Exception):
    """Raise from a function step to fail it without retry (``failure_code`` optional)."""

    def __init__(self, message: str = "", failure_code: str = "function_failed") -> None:
        super().__init__(message)
        self.failure_code = failure_code


def workflow_function(name: str) -> Callable[[StepFunction], StepFunction]:
    """Register the decorated callable as function step ``name`` (re-registering replaces)."""

    def register(fn: StepFunction) -> StepFunction:
        _REGISTRY[name] = fn
        return fn

    return register


def get_function(name: str) -> StepFunction | None:
    """The callable registered as ``name`` (decorator first, then settings), or None."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    path = get_settings().functions.get(name)
    if not path:
        return None
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]
    except (ImportError, AttributeError):
        return None
