"""Code-first definitions (issue 33): a small builder that writes the JSON of SPEC section 11
for you, validated by the same :func:`~buzz_delivery.workflows.definition.validate_definition`
and content-hashed the same way (a definition built here and the same one written by hand
publish as one version)::

    from buzz_delivery.workflows import Definition, Each, ref

    flow = Definition()
    order = flow.function("order", load_order, input={"id": ref.input("order_id")})
    paid = flow.wait_event("paid", event="payment", event_key=ref.input("order_id"), wait_timeout_seconds=3600)
    flow.map("pack", over=order.output("lines"), do=Each.function(pack_line, input={"line": ref.item()}), after=[paid])
    publish_definition(community_id, workflow_id, flow)   # or flow.build(): the validated JSON

Every step method takes the step's key first and returns a :class:`StepHandle`, whose
:meth:`~StepHandle.output` is a reference to its output. Dependencies are the steps named in
``after``, plus every step an ``input``, ``when`` or kind field refers to (unless it already is
an ancestor through the others). A function is named by its registered name or given as the
function ``@workflow_function`` decorated. Nothing here touches the database.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from buzz_delivery.workflows import definition as d
from buzz_delivery.workflows.registry import function_name_of


@dataclass(frozen=True)
class Ref:
    """A reference into the run's data (``{"$ref": [...]}`` in JSON); conditions for ``when``."""

    parts: tuple[str, ...]

    def __getitem__(self, part: str | int) -> Ref:
        return Ref((*self.parts, str(part)))

    def to_json(self) -> dict[str, Any]:
        return {"$ref": list(self.parts)}

    def equals(self, value: Any) -> Condition:
        return Condition(self, "equals", value)

    def contains(self, value: Any) -> Condition:
        return Condition(self, "contains", value)

    def exists(self) -> Condition:
        return Condition(self, "exists", True)

    def missing(self) -> Condition:
        return Condition(self, "exists", False)

    @property
    def step_key(self) -> str | None:
        return self.parts[1] if self.parts[0] == "steps" else None


@dataclass(frozen=True)
class Condition:
    """A ``when`` condition; ``~condition`` negates it."""

    ref: Ref
    op: str
    value: Any
    negated: bool = False

    def __invert__(self) -> Condition:
        return Condition(self.ref, self.op, self.value, not self.negated)

    def to_json(self) -> dict[str, Any]:
        out = {"ref": list(self.ref.parts), self.op: self.value}
        if self.negated:
            out["not"] = True
        return out


class _Refs:
    """``ref.input("order", "id")``, ``ref.item("sku")`` (inside a map's ``do``), or
    ``ref.step("fetch", "items")`` (a step by key; a :class:`StepHandle`'s ``output`` is the same)."""

    def input(self, *path: str | int) -> Ref:
        return Ref(("input", *map(str, path)))

    def item(self, *path: str | int) -> Ref:
        return Ref(("item", *map(str, path)))

    def step(self, key: str, *path: str | int) -> Ref:
        return Ref(("steps", key, "output", *map(str, path)))


ref = _Refs()


@dataclass(frozen=True)
class StepHandle:
    """A step added to a :class:`Definition`: its ``key``, and references to its output."""

    key: str

    def output(self, *path: str | int) -> Ref:
        return ref.step(self.key, *path)


def _json(value: Any) -> Any:
    """``value`` with every :class:`Ref` (and condition) as its JSON, datetimes as ISO text."""
    if isinstance(value, Ref | Condition):
        return value.to_json()
    if isinstance(value, dict):
        return {k: _json(item) for k, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json(item) for item in value]
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def _refs(value: Any) -> list[Ref]:
    if isinstance(value, Ref):
        return [value]
    if isinstance(value, Condition):
        return [value.ref]
    if isinstance(value, dict):
        return [r for item in value.values() for r in _refs(item)]
    if isinstance(value, list | tuple):
        return [r for item in value for r in _refs(item)]
    return []


def _function_name(function: str | Callable[..., Any]) -> str:
    if isinstance(function, str):
        return function
    name = function_name_of(function)
    if name is None:
        raise TypeError(f"{function!r} is not registered: decorate it with @workflow_function(name), or pass the name")
    return name


class Each:
    """What a :meth:`Definition.map` step runs per item (``ref.item()`` is the item)."""

    @staticmethod
    def function(
        function: str | Callable[..., Any], *, input: dict[str, Any] | None = None, **fields: Any
    ) -> dict[str, Any]:
        return {"kind": "function", "function": _function_name(function), **_opt(input=input), **fields}

    @staticmethod
    def sub_workflow(
        workflow: uuid.UUID | str, *, input: dict[str, Any] | None = None, **fields: Any
    ) -> dict[str, Any]:
        return {"kind": "sub_workflow", "workflow": str(workflow), **_opt(input=input), **fields}

    @staticmethod
    def send_message(targets: Ref | Sequence[str | Ref], content: str | Ref = "", **fields: Any) -> dict[str, Any]:
        return {"kind": "send_message", "targets": targets, "content": content, **fields}


def _opt(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


class Definition:
    """A definition built in code. ``to_json()`` is its JSON (as written by hand); ``build()``
    the validated, normalised form :func:`publish_definition` stores (``ValidationError``
    keyed ``steps[<i>].<field>`` and naming the step, as for JSON)."""

    def __init__(self) -> None:
        self._steps: list[dict[str, Any]] = []
        self._keys: set[str] = set()

    # --- kinds ----------------------------------------------------------------------------

    def function(self, key: str, function: str | Callable[..., Any], **common: Any) -> StepHandle:
        """A ``function`` step running the registered ``function`` (its name, or the function)."""
        return self._add(key, "function", {"function": _function_name(function)}, common)

    def send_message(self, key: str, targets: Sequence[str | bytes], content: str = "", **common: Any) -> StepHandle:
        """A ``send_message`` step: one delivery per target (64-hex keys or 32 bytes)."""
        hexes = [t.hex() if isinstance(t, bytes) else t for t in targets]
        return self._add(key, "send_message", {"targets": hexes, "content": content}, common)

    def sub_workflow(self, key: str, workflow: uuid.UUID | str, **common: Any) -> StepHandle:
        """A ``sub_workflow`` step: a child run of ``workflow`` (its ``input`` is the child's)."""
        return self._add(key, "sub_workflow", {"workflow": str(workflow)}, common)

    def approval(self, key: str, deadline_seconds: int, prompt: str = "", **common: Any) -> StepHandle:
        """An ``approval`` step: waits for a human decision until ``deadline_seconds``."""
        return self._add(key, "approval", {"deadline_seconds": deadline_seconds, "prompt": prompt}, common)

    def sleep(
        self,
        key: str,
        *,
        seconds: float | Ref | None = None,
        until: dt.datetime | str | Ref | None = None,
        **common: Any,
    ) -> StepHandle:
        """A ``sleep`` step: ``seconds`` (a duration) or ``until`` (a time), each a value or a
        reference; no lease is held while it sleeps."""
        return self._add(key, "sleep", _opt(seconds=seconds, until=until), common)

    def wait_event(
        self,
        key: str,
        *,
        event: str,
        event_key: str | int | Ref | Sequence[str | int | Ref],
        wait_timeout_seconds: int | None = None,
        on_timeout: str = "fail",
        **common: Any,
    ) -> StepHandle:
        """A ``wait_event`` step: waits for :func:`send_event` of ``event`` with ``event_key``
        (computed from the run: a reference, or a list of parts joined by ``:``); its output is
        the event's payload. ``on_timeout``: ``fail``, ``continue`` or ``skip_dependents``."""
        key_json = list(event_key) if isinstance(event_key, list | tuple) else event_key
        fields = {"event": event, "event_key": key_json, "on_timeout": on_timeout}
        fields.update(_opt(wait_timeout_seconds=wait_timeout_seconds))
        return self._add(key, "wait_event", fields, common)

    def map(self, key: str, *, over: Ref, do: dict[str, Any], tolerate_failures: int = 0, **common: Any) -> StepHandle:
        """A ``map`` step: ``do`` (an :class:`Each`) once per item of the list ``over``; its
        output is the items' outputs, in order."""
        return self._add(key, "map", {"over": over, "do": do, "tolerate_failures": tolerate_failures}, common)

    # --- the definition -------------------------------------------------------------------

    def _add(self, key: str, kind: str, fields: dict[str, Any], common: dict[str, Any]) -> StepHandle:
        after: Iterable[StepHandle | str] = common.pop("after", ())
        deps = [a.key if isinstance(a, StepHandle) else a for a in after]
        step: dict[str, Any] = {"key": key, "kind": kind, **fields, **common}
        for r in _refs([fields, common]):
            named = r.step_key
            if named is not None and named not in deps and named not in self._ancestors(deps):
                deps.append(named)
        if deps:
            step["depends_on"] = deps
        self._steps.append(step)
        self._keys.add(key)
        return StepHandle(key)

    def _ancestors(self, keys: list[str]) -> set[str]:
        by_key = {s["key"]: s for s in self._steps}
        seen: set[str] = set()
        todo = list(keys)
        while todo:
            for dep in by_key.get(todo.pop(), {}).get("depends_on", []):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    def to_json(self) -> dict[str, Any]:
        """The definition as JSON (what a hand-written one would be)."""
        return {"steps": _json(self._steps)}

    def build(self) -> dict[str, Any]:
        """The validated, normalised definition (raises ``ValidationError`` naming the step)."""
        return d.validate_definition(self.to_json())
