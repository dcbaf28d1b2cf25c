"""Running the engine's waiting kinds once claimed (SPEC 16 "Engine waits"): ``sleep``,
``wait_event`` and ``map``; :mod:`buzz_delivery.workflows.executor` dispatches to
:data:`RUNNERS`. Each resolves what its definition computes from the run's data (a duration, a
time, an event key, a list) and records the step's next state through the services
(:mod:`~buzz_delivery.workflows.services.waits`, :mod:`~buzz_delivery.workflows.services.maps`);
a value the run's data makes unusable fails the step once, without retry, with a failure code
that names it (``sleep_invalid``, ``event_key_invalid``, ``map_not_a_list``,
``map_too_large``, ``map_item_invalid``)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from django.core.exceptions import ValidationError

from buzz_delivery.models import new_uuid7
from buzz_delivery.services import validation as v
from buzz_delivery.workflows.conf import get_settings
from buzz_delivery.workflows.definition import (
    HEX64,
    MAX_EVENT_KEY_CHARS,
    MAX_TARGETS,
    MAX_WAIT_SECONDS,
    aware_time,
)
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.refs import resolve
from buzz_delivery.workflows.services import maps, steps, waits
from buzz_delivery.workflows.services.types import StepClaim, StepOutcome


def run_outputs(run: Run) -> dict[str, Any]:
    """The outputs of the run's succeeded steps, by key."""
    rows = Step.objects.filter(community_id=run.community_id, run_id=run.pk, state="succeeded")
    return dict(rows.values_list("key", "output"))


def _fail(claim: StepClaim, code: str, message: str) -> StepOutcome:
    return steps.fail_step(claim.lease, code, failure_message=message[:10_000], retryable=False)


def _resolved(claim: StepClaim, value: Any) -> Any:
    run = claim.step.run
    return resolve(value, run.input, run_outputs(run))


def run_sleep(claim: StepClaim) -> StepOutcome:
    """Park the step until its time, or for its duration (resolved now)."""
    spec = claim.spec
    if "until" in spec:
        value = _resolved(claim, spec["until"])
        if isinstance(value, dt.datetime):
            until = value
        else:
            try:  # an instant UTC holds (9999-12-31T23:59:59-14:00 is the year 10000 there)
                until = v.aware_datetime(aware_time(value, None, "until"), "until")
            except ValidationError as exc:
                return _fail(claim, "sleep_invalid", f"until resolved to {value!r}: {exc.messages[0]}")
        return waits.sleep_step(claim.lease, until=until)
    value = _resolved(claim, spec["seconds"])
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_WAIT_SECONDS:
        return _fail(claim, "sleep_invalid", f"seconds resolved to {value!r}: a number within 0..{MAX_WAIT_SECONDS}")
    return waits.sleep_step(claim.lease, seconds=value)


def event_key(claim: StepClaim) -> str | None:
    """The step's event key computed from the run (parts joined by ``:``), or None when a part
    is not text or an integer."""
    spec = claim.spec["event_key"]
    parts = _resolved(claim, spec if isinstance(spec, list) else [spec])
    if any(isinstance(p, bool) or not isinstance(p, str | int) or p == "" for p in parts):
        return None
    key = ":".join(str(p) for p in parts)
    return key if len(key) <= MAX_EVENT_KEY_CHARS and "\x00" not in key else None


def run_wait_event(claim: StepClaim) -> StepOutcome:
    """Take the kept event of the step's (name, key), or park the step waiting for it."""
    spec = claim.spec
    key = event_key(claim)
    if key is None:
        shown = _resolved(claim, spec["event_key"])
        return _fail(claim, "event_key_invalid", f"event_key resolved to {shown!r}: text or integers, 1..500 chars")
    return waits.wait_for_event(
        claim.lease,
        name=spec["event"],
        key=key,
        wait_seconds=spec.get("wait_timeout_seconds"),
        on_timeout=spec.get("on_timeout", "fail"),
    )


def _element_spec(do: dict[str, Any], resolved: dict[str, Any]) -> dict[str, Any] | str:
    """A map element's spec from the map's ``do`` resolved for one item, or why it is unusable."""
    spec = {k: val for k, val in do.items() if k not in ("input", "targets", "content")}
    if "input" in do:
        spec["input"] = resolved["input"] if isinstance(resolved["input"], dict) else {}
    if do["kind"] != "send_message":
        return spec
    targets = resolved["targets"]
    targets = [targets] if isinstance(targets, str) else targets
    if not isinstance(targets, list) or not 1 <= len(targets) <= MAX_TARGETS:
        return f"targets resolved to {targets!r}: a target or a list of 1..{MAX_TARGETS}"
    if not all(isinstance(t, str) and HEX64.match(t) for t in targets) or len(set(targets)) != len(targets):
        return "targets must be distinct 64-lowercase-hex keys"
    content = resolved["content"]
    if not isinstance(content, str) or "\x00" in content:
        return f"content resolved to {type(content).__name__}: text"
    return {
        **spec,
        "targets": targets,
        "content": content,
        "tolerate_failures": min(spec["tolerate_failures"], len(targets)),
    }


def run_map(claim: StepClaim) -> StepOutcome:
    """First claim: expand into one element step per item; claimed again: collect them."""
    key = claim.step.key
    if claim.step.expected is not None:
        return _collect(claim)
    items = _resolved(claim, claim.spec["over"])
    if not isinstance(items, list):
        return _fail(claim, "map_not_a_list", f"over resolved to {type(items).__name__}, not a list")
    limit = get_settings().max_map_items
    if len(items) > limit:
        return _fail(claim, "map_too_large", f"{len(items)} items, more than MAX_MAP_ITEMS ({limit})")
    if not items:
        return steps.complete_step(claim.lease, [])
    run = claim.step.run
    outputs = run_outputs(run)
    do = claim.spec["do"]
    fields = {f: do[f] for f in ("input", "targets", "content") if f in do}
    elements = []
    for i, item in enumerate(items):
        spec = _element_spec(do, resolve(fields, run.input, outputs, item))
        if isinstance(spec, str):
            return _fail(claim, "map_item_invalid", f"item {i}: {spec}")
        elements.append(maps.element_row(key, i, spec, str(new_uuid7())))
    return maps.expand_map(claim.lease, key, elements)


def _collect(claim: StepClaim) -> StepOutcome:
    elements = maps.map_elements(claim.lease, claim.step.key)
    failed = [i for i, state, _, _ in elements if state != "succeeded"]
    tolerated = claim.spec.get("tolerate_failures", 0)
    if len(failed) > tolerated:
        shown = ", ".join(map(str, failed[:20]))
        message = f"{len(failed)} of {len(elements)} items failed ({tolerated} tolerated): items {shown}"
        return _fail(claim, "map_items_failed", message)
    return steps.complete_step(
        claim.lease, [output if state == "succeeded" else None for _, state, output, _ in elements]
    )


RUNNERS: dict[str, Callable[[StepClaim], StepOutcome]] = {
    "sleep": run_sleep,
    "wait_event": run_wait_event,
    "map": run_map,
}
