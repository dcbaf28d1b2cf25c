"""Definition validation (SPEC section 11 "Definition"): a pure function, no SQL.

A definition is ``{"steps": [step, ...]}``; each step::

    {"key": "fetch", "kind": "function", "depends_on": ["a"], "when": {...}, "input": {...},
     "retry": {"max_attempts": 3, "base_seconds": 2, "cap_seconds": 60},
     "on_error": "fail_run" | "continue" | "skip_dependents", "timeout_seconds": 30,
     ...kind fields}

Kind fields: ``function`` -> ``function`` (registered name); ``send_message`` -> ``targets``
(64-hex keys), ``content`` (text), ``await`` (``delivered``; ``agent_run`` needs
``buzz_delivery.agents`` installed), ``tolerate_failures`` (int >= 0), ``wait_timeout_seconds``;
``sub_workflow`` -> ``workflow`` (UUID of a workflow of the same community, checked by
``publish_definition``), ``wait_timeout_seconds``; ``approval`` -> ``deadline_seconds``, ``prompt``;
``sleep`` -> ``seconds`` or ``until`` (a value or a reference); ``wait_event`` -> ``event`` (name),
``event_key`` (text, a reference, or a list of both joined by ``:``), ``wait_timeout_seconds``,
``on_timeout`` (``fail``/``continue``/``skip_dependents``); ``map`` -> ``over`` (a reference to
a list), ``do`` (a ``function``, ``sub_workflow`` or ``send_message`` run once per item, whose
references may start with ``item``), ``tolerate_failures``.

References (in ``input`` values and ``when``) are ``{"$ref": "input.a.b"}`` /
``{"$ref": "steps.<key>.output.a"}`` (or the same as a list of path parts, needed when a key
holds a dot); a step may reference the run input and the outputs of its ancestors (the steps
it depends on, directly or not). ``when``: ``{"ref": <reference>, "equals" | "contains" |
"exists": value, "not": bool}``, evaluated in SQL when the step's dependencies are all terminal.

Every problem raises ``ValidationError`` keyed ``steps[<i>].<field>`` (and naming the step's key).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import uuid
from typing import Any

from django.apps import apps
from django.core.exceptions import ValidationError

from buzz_delivery import jsonbounds
from buzz_delivery.services import validation as v
from buzz_delivery.workflows.states import OnError, OnTimeout, StepKind

MAX_STEPS = 500
MAX_DEFINITION_BYTES = 1_000_000
MAX_TARGETS = 10_000
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600
FUNCTION_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,199}$")
HEX64 = re.compile(r"^[0-9a-f]{64}$")
# Waits of sleep and wait_event steps may be longer than the other kinds' wait timeouts.
MAX_WAIT_SECONDS = 366 * 86400
# A step's "retry": attempts, and backoff base and cap (seconds); BUZZ_WORKFLOWS' defaults too.
MAX_RETRY_ATTEMPTS = 100
MAX_BACKOFF_SECONDS = 86400
EVENT_NAME = re.compile(r"^[A-Za-z0-9_.:/@-]{1,200}$")
MAX_EVENT_KEY_CHARS = 500
MAX_KEY_PARTS = 16
# Element steps of a map are keyed "<map key>[<index>]": the map's key leaves room for the index
# (MAX_MAP_ITEMS, at most 10,000: "[9999]").
MAP_ITEMS_LIMIT = 10_000
MAX_MAP_KEY_CHARS = 64 - len(f"[{MAP_ITEMS_LIMIT - 1}]")
COMMON = {"key", "kind", "depends_on", "when", "input", "retry", "on_error", "timeout_seconds"}
KIND_FIELDS = {
    "function": {"function"},
    "send_message": {"targets", "content", "await", "tolerate_failures", "wait_timeout_seconds"},
    "sub_workflow": {"workflow", "wait_timeout_seconds"},
    "approval": {"deadline_seconds", "prompt"},
    "sleep": {"seconds", "until"},
    "wait_event": {"event", "event_key", "wait_timeout_seconds", "on_timeout"},
    "map": {"over", "do", "tolerate_failures"},
}
# What a map's "do" may run per item, and the fields it may carry.
MAP_KINDS = {
    "function": {"function", "input", "retry", "timeout_seconds"},
    "sub_workflow": {"workflow", "input", "retry", "wait_timeout_seconds"},
    "send_message": {"targets", "content", "await", "tolerate_failures", "wait_timeout_seconds", "retry"},
}


class _Step:
    def __init__(self, index: int, raw: dict[str, Any]) -> None:
        self.index = index
        self.key = raw.get("key")
        self.raw = raw

    def invalid(self, field: str, message: str) -> ValidationError:
        name = f"steps[{self.index}].{field}"
        who = f"step {self.key!r}" if isinstance(self.key, str) else f"step #{self.index}"
        return v.invalid(name, f"{who}: {message}")


def parse_ref(value: Any, step: _Step, field: str, *, item: bool = False) -> list[str]:
    """A reference as its list of path parts: ``["input", ...]``, ``["steps", key, "output", ...]``
    or, inside a map's ``do`` (``item``), ``["item", ...]`` (the element the step runs for)."""
    if isinstance(value, str):
        parts = value.split(".")
    elif isinstance(value, list) and all(isinstance(p, str) for p in value):
        parts = list(value)
    else:
        raise step.invalid(field, "a reference is a dotted string or a list of strings")
    if not parts or any(p == "" for p in parts):
        raise step.invalid(field, f"reference {value!r} has an empty part")
    if parts[0] == "input" or (item and parts[0] == "item"):
        return parts
    if parts[0] == "steps" and len(parts) >= 3 and parts[2] == "output":
        return parts
    roots = "'input', 'item'" if item else "'input'"
    raise step.invalid(field, f"reference {value!r} must start with {roots} or 'steps.<key>.output'")


def _refs_in(value: Any, step: _Step, field: str, *, item: bool = False) -> Any:
    """``value`` with every ``{"$ref": ...}`` normalised to a list reference (validated)."""
    if isinstance(value, dict):
        if "$ref" in value:
            if len(value) != 1:
                raise step.invalid(field, "a {'$ref': ...} object holds nothing else")
            return {"$ref": parse_ref(value["$ref"], step, field, item=item)}
        return {k: _refs_in(v_, step, f"{field}.{k}", item=item) for k, v_ in value.items()}
    if isinstance(value, list):
        return [_refs_in(v_, step, f"{field}[{i}]", item=item) for i, v_ in enumerate(value)]
    return value


def is_ref(value: Any) -> bool:
    """True for a ``{"$ref": ...}`` object."""
    return isinstance(value, dict) and set(value) == {"$ref"}


def collect_refs(value: Any) -> list[list[str]]:
    """Every normalised reference inside an ``input`` value."""
    if isinstance(value, dict):
        if set(value) == {"$ref"}:
            return [value["$ref"]]
        return [r for item in value.values() for r in collect_refs(item)]
    if isinstance(value, list):
        return [r for item in value for r in collect_refs(item)]
    return []


def _int(step: _Step, field: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise step.invalid(field, f"must be an int within {low}..{high}, got {value!r}")
    return value


def _number(step: _Step, field: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise step.invalid(field, f"must be a number within {low:g}..{high:g}, got {value!r}")
    return float(value)


def _unstorable(value: Any, path: str) -> tuple[str, str] | None:
    """The first text in ``value`` (keys included) PostgreSQL cannot store, as (field path,
    why), or None: a NUL (jsonb and text refuse it) or a lone surrogate (not UTF-8)."""
    if isinstance(value, str):
        if "\x00" in value:
            return path, "holds a NUL character, which PostgreSQL cannot store"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path, "holds a lone surrogate code point, which is not UTF-8"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _unstorable(key, f"{path}.<key>" if path else "<key>") or _unstorable(
                item, f"{path}.{key}" if path else str(key)
            )
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if found := _unstorable(item, f"{path}[{i}]"):
                return found
    return None


def _step(step: _Step) -> dict[str, Any]:
    raw = step.raw
    found = _unstorable(raw, "")
    if found is not None:
        path, why = found
        raise step.invalid(path, why)  # the path names keys already found storable
    key = raw.get("key")
    try:
        v.step_id(key)
    except ValidationError as exc:
        raise step.invalid("key", exc.messages[0].removeprefix("step_id: ")) from None
    kind = raw.get("kind")
    if kind not in StepKind.values:
        raise step.invalid("kind", f"must be one of {', '.join(StepKind.values)}, got {kind!r}")
    unknown = set(raw) - COMMON - KIND_FIELDS[kind]
    if unknown:
        raise step.invalid(sorted(unknown)[0], f"is not a field of a {kind} step")
    out: dict[str, Any] = {"key": key, "kind": kind}
    deps = raw.get("depends_on", [])
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        raise step.invalid("depends_on", "must be a list of step keys")
    if len(set(deps)) != len(deps):
        raise step.invalid("depends_on", "names a step twice")
    out["depends_on"] = list(deps)
    on_error = raw.get("on_error", OnError.FAIL_RUN.value)
    if on_error not in OnError.values:
        raise step.invalid("on_error", f"must be one of {', '.join(OnError.values)}, got {on_error!r}")
    out["on_error"] = on_error
    out["retry"] = _retry(step, raw.get("retry", {}), "retry")
    if "timeout_seconds" in raw:
        out["timeout_seconds"] = _int(step, "timeout_seconds", raw["timeout_seconds"], 1, MAX_TIMEOUT_SECONDS)
    if "input" in raw:
        if not isinstance(raw["input"], dict):
            raise step.invalid("input", "must be an object")
        out["input"] = _refs_in(raw["input"], step, "input")
    if "when" in raw:
        cond = raw["when"]
        ops = {"equals", "contains", "exists"} & set(cond) if isinstance(cond, dict) else set()
        if not isinstance(cond, dict) or "ref" not in cond or len(ops) != 1 or set(cond) - ops - {"ref", "not"}:
            raise step.invalid("when", "must be {ref, one of equals|contains|exists, optional not}")
        norm: dict[str, Any] = {"ref": parse_ref(cond["ref"], step, "when.ref")}
        op = ops.pop()
        if op == "exists" and not isinstance(cond[op], bool):
            raise step.invalid("when.exists", "must be true or false")
        norm[op] = cond[op]
        if "not" in cond:
            if not isinstance(cond["not"], bool):
                raise step.invalid("when.not", "must be true or false")
            norm["not"] = cond["not"]
        out["when"] = norm
    out.update(_kind_fields(step, kind, raw))
    return out


def _retry(step: _Step, retry: Any, field: str) -> dict[str, Any]:
    if not isinstance(retry, dict) or set(retry) - {"max_attempts", "base_seconds", "cap_seconds"}:
        raise step.invalid(field, "must be {max_attempts, base_seconds, cap_seconds}")
    out: dict[str, Any] = {}
    if "max_attempts" in retry:
        out["max_attempts"] = _int(step, f"{field}.max_attempts", retry["max_attempts"], 1, MAX_RETRY_ATTEMPTS)
    if "base_seconds" in retry:
        out["base_seconds"] = _number(step, f"{field}.base_seconds", retry["base_seconds"], 0, MAX_BACKOFF_SECONDS)
    if "cap_seconds" in retry:
        out["cap_seconds"] = _number(step, f"{field}.cap_seconds", retry["cap_seconds"], 0, MAX_BACKOFF_SECONDS)
        if out["cap_seconds"] < out.get("base_seconds", 0):
            raise step.invalid(f"{field}.cap_seconds", "must be at least base_seconds")
    return out


def _kind_fields(step: _Step, kind: str, raw: dict[str, Any]) -> dict[str, Any]:
    if kind == "sleep":
        return _sleep_fields(step, raw)
    if kind == "wait_event":
        return _wait_event_fields(step, raw)
    if kind == "map":
        return _map_fields(step, raw)
    out: dict[str, Any] = {}
    if kind == "function":
        name = raw.get("function")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise step.invalid("function", f"must be a registered function name, got {name!r}")
        out["function"] = name
    elif kind == "send_message":
        targets = raw.get("targets")
        if not isinstance(targets, list) or not 1 <= len(targets) <= MAX_TARGETS:
            raise step.invalid("targets", f"must be a list of 1..{MAX_TARGETS} target keys")
        for i, t in enumerate(targets):
            if not isinstance(t, str) or not HEX64.match(t):
                raise step.invalid(f"targets[{i}]", "must be 64 lowercase hex characters")
        if len(set(targets)) != len(targets):
            raise step.invalid("targets", "names a target twice")
        out["targets"] = list(targets)
        content = raw.get("content", "")
        if not isinstance(content, str):
            raise step.invalid("content", "must be a string")
        out["content"] = v.storable_text(content, f"steps[{step.index}].content")
        await_ = raw.get("await", "delivered")
        if await_ == "agent_run" and not apps.is_installed("buzz_delivery.agents"):
            raise step.invalid("await", "'agent_run' is not available until buzz_delivery.agents is installed")
        if await_ not in ("delivered", "agent_run"):
            raise step.invalid("await", f"must be 'delivered' or 'agent_run', got {await_!r}")
        out["await"] = await_
        out["tolerate_failures"] = _int(step, "tolerate_failures", raw.get("tolerate_failures", 0), 0, len(targets))
    elif kind == "sub_workflow":
        try:
            out["workflow"] = str(uuid.UUID(str(raw.get("workflow"))))
        except ValueError:
            raise step.invalid("workflow", f"must be a workflow UUID, got {raw.get('workflow')!r}") from None
    elif kind == "approval":
        out["deadline_seconds"] = _int(step, "deadline_seconds", raw.get("deadline_seconds"), 1, 30 * 86400)
        prompt = raw.get("prompt", "")
        if not isinstance(prompt, str) or len(prompt) > 10_000:
            raise step.invalid("prompt", "must be a string of at most 10,000 characters")
        out["prompt"] = prompt
    if kind in ("send_message", "sub_workflow") and "wait_timeout_seconds" in raw:
        out["wait_timeout_seconds"] = _int(
            step, "wait_timeout_seconds", raw["wait_timeout_seconds"], 1, MAX_TIMEOUT_SECONDS
        )
    return out


def _sleep_fields(step: _Step, raw: dict[str, Any]) -> dict[str, Any]:
    given = [f for f in ("seconds", "until") if f in raw]
    if len(given) != 1:
        raise step.invalid("seconds", "a sleep step has exactly one of 'seconds' (a duration) or 'until' (a time)")
    field = given[0]
    value = raw[field]
    if is_ref(value):
        return {field: _refs_in(value, step, field)}
    if field == "seconds":
        return {"seconds": _number(step, "seconds", value, 0, MAX_WAIT_SECONDS)}
    return {"until": aware_time(value, step, "until").isoformat()}


def aware_time(value: Any, step: _Step | None, field: str) -> dt.datetime:
    """An ISO 8601 date-time with its UTC offset (``Z`` allowed) as an aware datetime."""
    problem = None
    if not isinstance(value, str) or len(value) > 64:
        problem = f"must be an ISO 8601 date-time with a UTC offset, got {value!r}"
    else:
        try:
            parsed = dt.datetime.fromisoformat(value)
        except ValueError:
            problem = f"must be an ISO 8601 date-time with a UTC offset, got {value!r}"
        else:
            if parsed.tzinfo is None or parsed.utcoffset() is None:
                problem = f"needs a UTC offset (e.g. 'Z' or '+02:00'), got {value!r}"
            else:
                return parsed
    if step is None:
        raise v.invalid(field, problem)
    raise step.invalid(field, problem)


def _wait_event_fields(step: _Step, raw: dict[str, Any]) -> dict[str, Any]:
    name = raw.get("event")
    if not isinstance(name, str) or not EVENT_NAME.match(name):
        raise step.invalid("event", f"must be an event name (1..200 of A-Z a-z 0-9 _ . : / @ -), got {name!r}")
    out: dict[str, Any] = {"event": name}
    key = raw.get("event_key")
    if isinstance(key, list):
        if not 1 <= len(key) <= MAX_KEY_PARTS:
            raise step.invalid("event_key", f"as a list, holds 1..{MAX_KEY_PARTS} parts (joined by ':')")
        out["event_key"] = [_key_part(step, f"event_key[{i}]", part) for i, part in enumerate(key)]
    else:
        out["event_key"] = _key_part(step, "event_key", key)
    if "wait_timeout_seconds" in raw:
        out["wait_timeout_seconds"] = _int(
            step, "wait_timeout_seconds", raw["wait_timeout_seconds"], 1, MAX_WAIT_SECONDS
        )
    on_timeout = raw.get("on_timeout", OnTimeout.FAIL.value)
    if on_timeout not in OnTimeout.values:
        raise step.invalid("on_timeout", f"must be one of {', '.join(OnTimeout.values)}, got {on_timeout!r}")
    out["on_timeout"] = on_timeout
    return out


def _key_part(step: _Step, field: str, value: Any) -> Any:
    if is_ref(value):
        return _refs_in(value, step, field)
    if isinstance(value, bool) or not isinstance(value, str | int) or (isinstance(value, str) and not value):
        raise step.invalid(field, "must be text, an integer or a {'$ref': ...} (the key is computed from the run)")
    text = v.storable_text(str(value), f"steps[{step.index}].{field}")
    if len(text) > MAX_EVENT_KEY_CHARS:
        raise step.invalid(field, f"must be at most {MAX_EVENT_KEY_CHARS} characters")
    return text


def _map_fields(step: _Step, raw: dict[str, Any]) -> dict[str, Any]:
    if isinstance(step.key, str) and len(step.key) > MAX_MAP_KEY_CHARS:
        raise step.invalid("key", f"a map step's key is at most {MAX_MAP_KEY_CHARS} characters (room for '[<index>]')")
    over = raw.get("over")
    if not is_ref(over):
        raise step.invalid("over", "must be a {'$ref': ...} to a list (the run input or an ancestor's output)")
    out: dict[str, Any] = {"over": _refs_in(over, step, "over")}
    do = raw.get("do")
    if not isinstance(do, dict) or do.get("kind") not in MAP_KINDS:
        raise step.invalid("do", f"must be an object whose kind is one of {', '.join(MAP_KINDS)}")
    unknown = set(do) - {"kind"} - MAP_KINDS[do["kind"]]
    if unknown:
        raise step.invalid(f"do.{sorted(unknown)[0]}", f"is not a field of a map's {do['kind']}")
    out["do"] = _map_do(step, do)
    out["tolerate_failures"] = _int(step, "tolerate_failures", raw.get("tolerate_failures", 0), 0, MAP_ITEMS_LIMIT)
    return out


def _map_do(step: _Step, do: dict[str, Any]) -> dict[str, Any]:
    kind = do["kind"]
    out: dict[str, Any] = {"kind": kind}
    if "input" in do:
        if not isinstance(do["input"], dict):
            raise step.invalid("do.input", "must be an object")
        out["input"] = _refs_in(do["input"], step, "do.input", item=True)
    if "retry" in do:
        out["retry"] = _retry(step, do["retry"], "do.retry")
    if "timeout_seconds" in do:
        out["timeout_seconds"] = _int(step, "do.timeout_seconds", do["timeout_seconds"], 1, MAX_TIMEOUT_SECONDS)
    if "wait_timeout_seconds" in do:
        out["wait_timeout_seconds"] = _int(
            step, "do.wait_timeout_seconds", do["wait_timeout_seconds"], 1, MAX_TIMEOUT_SECONDS
        )
    if kind == "function":
        name = do.get("function")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise step.invalid("do.function", f"must be a registered function name, got {name!r}")
        out["function"] = name
    elif kind == "sub_workflow":
        try:
            out["workflow"] = str(uuid.UUID(str(do.get("workflow"))))
        except ValueError:
            raise step.invalid("do.workflow", f"must be a workflow UUID, got {do.get('workflow')!r}") from None
    else:
        targets = do.get("targets")
        if is_ref(targets):
            out["targets"] = _refs_in(targets, step, "do.targets", item=True)
        elif isinstance(targets, list) and 1 <= len(targets) <= MAX_TARGETS:
            for i, t in enumerate(targets):
                if not is_ref(t) and not (isinstance(t, str) and HEX64.match(t)):
                    raise step.invalid(f"do.targets[{i}]", "must be 64 lowercase hex characters or a {'$ref': ...}")
            out["targets"] = _refs_in(targets, step, "do.targets", item=True)
        else:
            raise step.invalid("do.targets", f"must be a {{'$ref': ...}} or a list of 1..{MAX_TARGETS} targets")
        content = do.get("content", "")
        if is_ref(content):
            out["content"] = _refs_in(content, step, "do.content", item=True)
        elif isinstance(content, str):
            out["content"] = v.storable_text(content, f"steps[{step.index}].do.content")
        else:
            raise step.invalid("do.content", "must be a string or a {'$ref': ...}")
        await_ = do.get("await", "delivered")
        if await_ == "agent_run" and not apps.is_installed("buzz_delivery.agents"):
            raise step.invalid("do.await", "'agent_run' is not available until buzz_delivery.agents is installed")
        if await_ not in ("delivered", "agent_run"):
            raise step.invalid("do.await", f"must be 'delivered' or 'agent_run', got {await_!r}")
        out["await"] = await_
        out["tolerate_failures"] = _int(step, "do.tolerate_failures", do.get("tolerate_failures", 0), 0, MAX_TARGETS)
    return out


def step_refs(s: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(field, reference) of every reference a normalised step holds, ``item`` ones excepted."""
    refs = [("input", r) for r in collect_refs(s.get("input", {}))]
    if "when" in s:
        refs.append(("when.ref", s["when"]["ref"]))
    for field in ("seconds", "until", "event_key", "over", "do"):
        if field in s:
            refs += [(field, r) for r in collect_refs(s[field]) if r[0] != "item"]
    return refs


def _ancestors(steps: list[dict[str, Any]]) -> dict[str, set[str]]:
    deps = {s["key"]: set(s["depends_on"]) for s in steps}
    memo: dict[str, set[str]] = {}

    def visit(key: str) -> set[str]:
        if key not in memo:
            memo[key] = set()
            for d in deps[key]:
                memo[key] |= {d} | visit(d)
        return memo[key]

    return {k: visit(k) for k in deps}


def _refused_field(exc: jsonbounds.JSONRefused) -> str:
    """The field a bounds refusal names: for text PostgreSQL cannot store, the step and field
    that hold it (``steps[0].input.q``, ``steps[0].input.<key>`` for a bad key); for anything
    else (nesting too deep, a value that is not JSON), the definition."""
    if not exc.path.startswith("$.steps[") or not ("PostgreSQL cannot store" in str(exc) or "surrogate" in str(exc)):
        return "definition"
    field = exc.path[2:]
    return f"{field}.<key>" if str(exc).startswith("has a key") else field


def validate_definition(definition: Any) -> dict[str, Any]:
    """Validate a definition and return its normalised form (references as path lists).

    Checks: ``{"steps": [...]}`` with 1..500 steps; keys 1..64 characters, not blank, unique;
    kinds and their fields known; dependencies exist; acyclic; every ``input`` reference and
    ``when`` condition names the run input or an ancestor's output. No SQL runs.

    Raises ``ValidationError`` keyed ``definition`` or ``steps[<i>].<field>``, naming the step.
    SPEC section 11.
    """
    if not isinstance(definition, dict) or set(definition) != {"steps"}:
        raise v.invalid("definition", "must be an object {'steps': [...]}")
    try:
        jsonbounds.check(definition)  # nesting every reader can load back, text PostgreSQL stores
    except jsonbounds.JSONRefused as exc:
        raise v.invalid(_refused_field(exc), str(exc)) from None
    try:
        size = len(json.dumps(definition, allow_nan=False).encode())
    except (TypeError, ValueError, RecursionError) as exc:
        raise v.invalid("definition", f"must be JSON: {exc}") from None
    if size > MAX_DEFINITION_BYTES:
        raise v.invalid("definition", f"must serialise to at most {MAX_DEFINITION_BYTES} bytes")
    raw_steps = definition["steps"]
    if not isinstance(raw_steps, list) or not 1 <= len(raw_steps) <= MAX_STEPS:
        raise v.invalid("definition", f"steps must be a list of 1..{MAX_STEPS} steps")
    steps: list[dict[str, Any]] = []
    wrappers = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_steps):
        wrapper = _Step(i, raw if isinstance(raw, dict) else {})
        if not isinstance(raw, dict):
            raise wrapper.invalid("key", "a step must be an object")
        norm = _step(wrapper)
        if norm["key"] in seen:
            raise wrapper.invalid("key", "is used by an earlier step")
        seen.add(norm["key"])
        steps.append(norm)
        wrappers.append(wrapper)
    for wrapper, s in zip(wrappers, steps, strict=True):
        for d in s["depends_on"]:
            if d not in seen:
                raise wrapper.invalid("depends_on", f"names {d!r}, which is not a step of this definition")
            if d == s["key"]:
                raise wrapper.invalid("depends_on", "a step cannot depend on itself")
    _check_acyclic(steps, wrappers)
    ancestors = _ancestors(steps)
    maps = [s["key"] for s in steps if s["kind"] == "map"]
    for wrapper, s in zip(wrappers, steps, strict=True):
        for m in maps:
            if re.fullmatch(re.escape(m) + r"\[[0-9]+\]", s["key"]):
                raise wrapper.invalid("key", f"is the key of an element of map step {m!r}")
        for field, ref in step_refs(s):
            if ref[0] == "steps" and ref[1] not in ancestors[s["key"]]:
                raise wrapper.invalid(field, f"references step {ref[1]!r}, which this step does not depend on")
    return {"steps": steps}


def _check_acyclic(steps: list[dict[str, Any]], wrappers: list[_Step]) -> None:
    index = {s["key"]: i for i, s in enumerate(steps)}
    state: dict[str, int] = {}

    def visit(key: str, path: list[str]) -> None:
        state[key] = 1
        for d in steps[index[key]]["depends_on"]:
            if state.get(d) == 1:
                cycle = [*path[path.index(d) :], d] if d in path else [key, d]
                raise wrappers[index[key]].invalid("depends_on", f"forms a cycle: {' -> '.join(cycle)}")
            if d not in state:
                visit(d, [*path, d])
        state[key] = 2

    for s in steps:
        if s["key"] not in state:
            visit(s["key"], [s["key"]])


def canonical(definition: dict[str, Any]) -> bytes:
    """The canonical JSON text of a normalised definition (sorted keys, no spaces)."""
    return json.dumps(definition, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def content_hash(definition: dict[str, Any]) -> bytes:
    """SHA-256 of :func:`canonical`: 32 bytes."""
    return hashlib.sha256(canonical(definition)).digest()


def definition_event_id(workflow_id: uuid.UUID, digest: bytes) -> bytes:
    """The 32-byte ``definition_event_id`` a version's deliveries bind to: SHA-256 over the
    workflow id and the content hash (stable for identical content of the same workflow)."""
    return hashlib.sha256(b"buzz-workflows/definition/" + workflow_id.bytes + digest).digest()
