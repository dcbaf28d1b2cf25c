"""The compensations a worker process may run, by name (issue 27, SPEC 12 "Runtime").

A journal entry's compensation descriptor (``{"function": name}``) is data: an in-process
handler wrote it, or anyone holding the agent's gateway key did. So a worker never imports the
name it reads back; it looks the name up here, in the registry its own code declared with
:func:`compensation` when the handler's module was imported. A name nobody registered fails
that one compensation (``compensation_failed``, error ``unregistered_compensation: ...``) and
stops nothing else.

    from buzz_delivery.agents.compensations import compensation

    @compensation                     # registered as "myapp.agents:refund"
    def refund(args, output, key): ...

    @compensation(name="undo_charge")  # or under a stable name of your choosing
    def undo_charge(args, output, key): ...

``ctx.call(..., compensate=refund)`` journals the registered name; passing a function that is
not registered raises ``ValueError`` before anything is written.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

Compensation = Callable[[Any, Any, str], Any]

UNREGISTERED = "unregistered_compensation"
NAME_MAX_CHARS = 200

_lock = threading.Lock()
_by_name: dict[str, Compensation] = {}


def dotted(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a module-level function (the default name it is registered under)."""
    name = f"{fn.__module__}:{fn.__qualname__}"
    if "<" in name:
        raise ValueError(f"compensate must be a module-level function, not {name}")
    return name


def compensation(fn: Compensation | None = None, *, name: str | None = None) -> Any:
    """Register ``fn`` as a compensation this process may run, under ``name`` (default
    ``module:qualname``): ``@compensation`` or ``@compensation(name="undo_charge")``. Put it in
    (or import it from) the handler's module, which the worker imports when it starts, so a run
    unwound after a restart finds it. Registering another function under a taken name raises
    ``ValueError``."""

    def register(target: Compensation) -> Compensation:
        if not callable(target):
            raise ValueError(f"compensation {target!r} is not callable")
        key = dotted(target) if name is None else name
        if not isinstance(key, str) or not key or len(key) > NAME_MAX_CHARS:
            raise ValueError(f"a compensation name is 1..{NAME_MAX_CHARS} characters, not {key!r}")
        with _lock:
            known = _by_name.get(key)
            if known is not None and known is not target:
                raise ValueError(f"another function is registered as compensation {key!r}")
            _by_name[key] = target
        return target

    return register if fn is None else register(fn)


def name_of(fn: Callable[..., Any]) -> str:
    """The name ``fn`` is registered under; ``ValueError`` (naming ``compensate``) when it is not."""
    with _lock:
        for key, known in _by_name.items():
            if known is fn:
                return key
    raise ValueError(
        f"compensate={getattr(fn, '__qualname__', fn)!r} is not a registered compensation: decorate it "
        "with @buzz_delivery.agents.compensations.compensation in the handler's module"
    )


def descriptor(fn: Callable[..., Any] | None) -> dict[str, str] | None:
    """The journal's descriptor for ``compensate=fn`` (``None`` for no compensation)."""
    return None if fn is None else {"function": name_of(fn)}


def resolve(stored: Any) -> Compensation | None:
    """The registered compensation a stored descriptor names, or ``None``: never an import."""
    name = stored.get("function") if isinstance(stored, dict) else None
    if not isinstance(name, str):
        return None
    with _lock:
        return _by_name.get(name)


def unregistered_error(stored: Any) -> str:
    """The error recorded for a descriptor that names no registered compensation."""
    return f"{UNREGISTERED}: {json.dumps(stored, ensure_ascii=True)[:300]} is not a compensation this worker registered"
