"""Server-side drawing of a run's DAG (SVG, no JS, no CDN) and the "why not running" line of
each step, for the admin run page (SPEC section 11)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from django.utils.html import escape, format_html
from django.utils.safestring import SafeString, mark_safe

from buzz_delivery.workflows.models import Step

COLOURS = {
    "pending": "#e5e7eb",
    "ready": "#bfdbfe",
    "running": "#60a5fa",
    "waiting": "#fde68a",
    "succeeded": "#86efac",
    "failed": "#fca5a5",
    "skipped": "#d1d5db",
    "canceled": "#9ca3af",
}
NODE_W, NODE_H, GAP_X, GAP_Y = 160, 44, 60, 24


def why_not_running(step: Step, now: dt.datetime) -> str:
    """One line saying what the step is doing or waiting for."""
    if step.state == "pending":
        if step.kind == "map" and step.expected is not None:
            return f"map: {step.deps_done} of {step.expected} items done"
        return f"waiting for dependencies: {step.deps_done} of {step.deps_total} done"
    if step.state == "ready":
        if step.next_attempt_at and step.next_attempt_at > now:
            return f"backoff until {step.next_attempt_at:%H:%M:%S} (after attempt {step.attempts}: {step.failure_code})"
        return "ready: waiting for an orchestrator to claim it"
    if step.state == "running":
        return f"running attempt {step.attempts} of {step.max_attempts}, lease until {step.lease_until:%H:%M:%S}"
    if step.state == "waiting":
        if step.kind == "send_message" and step.expected is not None:
            left = step.expected - step.delivered_terminal
            return f"waiting for {left} of {step.expected} deliveries, {step.delivered_failed} failed"
        if step.kind == "approval":
            return f"waiting for approval since {step.waiting_since:%Y-%m-%d %H:%M:%S}"
        if step.kind == "sleep":
            return f"sleeping until {step.wait_deadline:%Y-%m-%d %H:%M:%S} (no lease held)"
        if step.kind == "wait_event":
            until = (
                f"until {step.wait_deadline:%Y-%m-%d %H:%M:%S}, then {step.on_timeout}" if step.wait_deadline else ""
            )
            return f"waiting for event {step.event_name!r} key {step.event_key!r} {until}".strip()
        return f"waiting for child run {step.child_run_id}"
    if step.state == "skipped":
        if step.skip_reason == "wait_timeout":
            return "skipped: no event before its wait timeout (on_timeout: skip_dependents)"
        return "condition false" if step.skip_reason == "condition_false" else "skipped: a dependency did not succeed"
    if step.state == "failed":
        if step.failure_code == "function_not_registered":
            return f"failed: {step.failure_message or 'its function is not registered in the worker that ran it'}"
        return f"failed: {step.failure_code}"
    if step.state == "canceled":
        return f"canceled ({step.skip_reason or 'run ended'})"
    return ""


def layers(steps: Sequence[Step]) -> dict[str, int]:
    """Each step's column: the length of the longest dependency path to it."""
    by_key = {s.key: s for s in steps}
    memo: dict[str, int] = {}

    def depth(key: str) -> int:
        if key not in memo:
            memo[key] = 0
            memo[key] = 1 + max((depth(d) for d in by_key[key].depends_on if d in by_key), default=-1)
        return memo[key]

    return {s.key: depth(s.key) for s in steps}


def dag_svg(steps: Sequence[Step], now: dt.datetime) -> SafeString:
    """An inline SVG: one box per step (colour = state, attempts), one line per dependency."""
    columns = layers(steps)
    rows: dict[int, int] = {}
    pos: dict[str, tuple[int, int]] = {}
    for s in steps:
        col = columns[s.key]
        row = rows.get(col, 0)
        rows[col] = row + 1
        pos[s.key] = (20 + col * (NODE_W + GAP_X), 20 + row * (NODE_H + GAP_Y))
    width = 40 + (max(columns.values(), default=0) + 1) * (NODE_W + GAP_X)
    height = 40 + max(rows.values(), default=1) * (NODE_H + GAP_Y)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="workflow run DAG" style="font: 12px sans-serif">'
    ]
    for s in steps:
        x2, y2 = pos[s.key]
        for d in s.depends_on:
            if d in pos:
                x1, y1 = pos[d]
                parts.append(
                    f'<line x1="{x1 + NODE_W}" y1="{y1 + NODE_H // 2}" x2="{x2}" y2="{y2 + NODE_H // 2}" '
                    'stroke="#6b7280" stroke-width="1.5"/>'
                )
    for s in steps:
        x, y = pos[s.key]
        title = escape(f"{s.key}: {s.state}. {why_not_running(s, now)}")
        parts.append(
            f'<g><title>{title}</title><rect x="{x}" y="{y}" width="{NODE_W}" height="{NODE_H}" rx="6" '
            f'fill="{COLOURS.get(s.state, "#fff")}" stroke="#374151"/>'
            f'<text x="{x + 8}" y="{y + 18}">{escape(s.key[:22])}</text>'
            f'<text x="{x + 8}" y="{y + 35}" fill="#374151">'
            f"{escape(s.state)} · {s.attempts}/{s.max_attempts}</text></g>"
        )
    parts.append("</svg>")
    return mark_safe("".join(parts))


def steps_table(steps: Sequence[Step], now: dt.datetime) -> SafeString:
    """An HTML table of the steps: key, kind, state, attempts, timings (the admin's one time
    format), why not running."""
    from buzz_delivery.admin.display import timestamp

    head = format_html(
        "<tr>{}</tr>",
        mark_safe(
            "".join(f"<th>{h}</th>" for h in ("step", "kind", "state", "attempts", "started", "finished", "why"))
        ),
    )
    body = [
        format_html(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}/{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            s.key,
            s.kind,
            s.state,
            s.attempts,
            s.max_attempts,
            timestamp(s.started_at) if s.started_at else "",
            timestamp(s.finished_at) if s.finished_at else "",
            why_not_running(s, now),
        )
        for s in steps
    ]
    return format_html('<table class="buzz-steps">{}{}</table>', head, mark_safe("".join(body)))
