"""The function-step registry (SPEC section 11 "function", 16 "Trust"): callables registered by
name, through the ``@workflow_function("name")`` decorator or ``BUZZ_WORKFLOWS['FUNCTIONS']``
(``{"name": "package.module:callable"}``). A function receives the step's resolved input (a
dict) and a :class:`StepContext`, and returns a JSON value (its output).

Where the decorated functions are found (the way Django finds ``admin.py``): when the app is
ready, :func:`autodiscover` imports the ``workflows`` module of every installed app that has
one, then every module named in ``BUZZ_WORKFLOWS['MODULES']``. Every process that loads Django
(a worker, a web process, ``manage.py shell``) therefore knows the same functions, with no
import of its own. Only the server's own settings and installed apps name what is imported; a
stored step names a function, never a module.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from buzz_delivery.workflows.conf import get_settings

# The module an installed app keeps its functions in (``myapp/workflows.py``).
MODULE_NAME = "workflows"


@dataclass(frozen=True, slots=True)
class StepContext:
    """What a function step knows about itself: ids, its key and the attempt (1-based)."""

    community_id: Any
    run_id: Any
    step_key: str
    attempt: int


StepFunction = Callable[[dict[str, Any], StepContext], Any]
_REGISTRY: dict[str, StepFunction] = {}
_MISSING: Counter[str] = Counter()
_MISSING_LOCK = threading.Lock()


class PermanentStepFailure(Exception):
    """Raise from a function step to fail it without retry (``failure_code`` optional)."""

    def __init__(self, message: str = "", failure_code: str = "function_failed") -> None:
        super().__init__(message)
        self.failure_code = failure_code


def workflow_function(name: str) -> Callable[[StepFunction], StepFunction]:
    """Register the decorated callable as function step ``name`` (re-registering replaces).
    The callable keeps the name in ``workflow_function_name``, so a definition builder can be
    handed the function itself (:class:`~buzz_delivery.workflows.builder.Definition`)."""
    if not isinstance(name, str) or not name:
        raise TypeError("workflow_function needs the name the step is registered under")

    def register(fn: StepFunction) -> StepFunction:
        _REGISTRY[name] = fn
        with contextlib.suppress(AttributeError, TypeError):  # a builtin: the name still works
            fn.workflow_function_name = name  # type: ignore[attr-defined]
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


def registered_names() -> list[str]:
    """Every name a function step may use in this process (decorated and from settings), sorted."""
    return sorted(set(_REGISTRY) | set(get_settings().functions))


def autodiscover() -> list[str]:
    """Import the ``workflows`` module of every installed app that has one, then each module
    of ``BUZZ_WORKFLOWS['MODULES']`` (an error there is raised: a module the settings name must
    load). Called by the app's ``ready()``; safe to call again. Returns the modules imported."""
    from django.apps import apps
    from django.utils.module_loading import module_has_submodule

    imported = []
    for config in apps.get_app_configs():
        if config.module is not None and module_has_submodule(config.module, MODULE_NAME):
            name = f"{config.name}.{MODULE_NAME}"
            importlib.import_module(name)
            imported.append(name)
    for name in _settings_modules():
        importlib.import_module(name)
        imported.append(name)
    return imported


def _settings_modules() -> list[str]:
    """``BUZZ_WORKFLOWS['MODULES']`` when it is a list of names; anything else (a str, whose
    characters would be imported one by one) imports nothing here, so Django starts and the
    system check ``buzz_workflows.E002`` names the key. Read alone: another bad key is its own
    check's to report, not a failure of every process's start."""
    modules = (getattr(settings, "BUZZ_WORKFLOWS", None) or {}).get("MODULES", [])
    if not isinstance(modules, list | tuple) or not all(isinstance(m, str) for m in modules):
        return []
    return list(modules)


def function_name_of(value: Any) -> str | None:
    """The registered name of a decorated callable (None when it was never registered)."""
    name = getattr(value, "workflow_function_name", None)
    return name if isinstance(name, str) and _REGISTRY.get(name) is value else None


def note_missing(name: str) -> None:
    """Count a step that named ``name`` while nothing is registered under it (the worker's
    summary reports these)."""
    with _MISSING_LOCK:
        _MISSING[name] += 1


def missing_counts() -> Counter[str]:
    """How many steps failed ``function_not_registered``, per name, in this process so far."""
    with _MISSING_LOCK:
        return Counter(_MISSING)


def missing_message(name: str) -> str:
    """Why a step that names ``name`` failed, and how to register it."""
    known = registered_names()
    shown = ", ".join(known[:20]) + (f" and {len(known) - 20} more" if len(known) > 20 else "")
    return (
        f"no function {name!r} is registered in this worker: decorate it with @workflow_function({name!r}) "
        f"(from buzz_delivery.workflows) in a {MODULE_NAME}.py module of an installed app, or name its module "
        f"in BUZZ_WORKFLOWS['MODULES'] or the callable in BUZZ_WORKFLOWS['FUNCTIONS']. Registered here: "
        f"{shown or 'none'}"
    )
