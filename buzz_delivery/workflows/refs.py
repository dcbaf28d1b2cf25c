"""Resolving a step's references (``{"$ref": [...]}``) against the run's data when it runs: the
run input, the outputs of the run's steps and, for a map's element, its item. A missing path is
None. Only a definition's own (validated) references are resolved: a value that came from the
run's data is never read as a reference."""

from __future__ import annotations

from typing import Any

NO_ITEM = object()


def walk(value: Any, path: list[str]) -> Any:
    """``value #> path`` as jsonb does it (None for a missing element)."""
    for part in path:
        if isinstance(value, dict):
            value = value.get(part)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def resolve_ref(ref: list[str], run_input: Any, outputs: dict[str, Any], item: Any = NO_ITEM) -> Any:
    """What one normalised reference names."""
    if ref[0] == "input":
        return walk(run_input, ref[1:])
    if ref[0] == "item":
        return None if item is NO_ITEM else walk(item, ref[1:])
    return walk(outputs.get(ref[1]), ref[3:])


def resolve(value: Any, run_input: Any, outputs: dict[str, Any], item: Any = NO_ITEM) -> Any:
    """``value`` with every ``{"$ref": [...]}`` replaced by what it names."""
    if isinstance(value, dict):
        if set(value) == {"$ref"}:
            return resolve_ref(value["$ref"], run_input, outputs, item)
        return {k: resolve(v, run_input, outputs, item) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, run_input, outputs, item) for v in value]
    return value
