"""Small line charts drawn on the server as inline SVG (the dashboard's throughput, issue 17).

No script and no CDN: the page works offline and under a strict Content-Security-Policy. The
markup is built from numbers this module computes and from escaped text only.

Small multiples (issue 36): one panel per series, over the same minutes, each with its own y
axis. On one shared axis the workflow and agent lines lay flat at the deliveries' scale (a few
runs a minute against thousands of deliveries) and could not be read.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

WIDTH, PANEL_HEIGHT = 720, 96
LEFT, RIGHT, TOP, BOTTOM = 56, 12, 20, 8
AXIS_HEIGHT = 20  # the time labels under the last panel
COLORS = ("#417690", "#e0a000", "#ba2121", "#2e8540")


@dataclass(frozen=True)
class Series:
    """One line: its ``name`` (legend) and one value per minute, oldest first."""

    name: str
    values: list[int]


def _nice_max(top: int) -> int:
    """The smallest of 1, 2, 5 x 10^k that is at least ``top`` (at least 1)."""
    bound = 1
    while True:
        for step in (1, 2, 5):
            if step * bound >= top:
                return step * bound
        bound *= 10


def line_chart(series: list[Series], *, first_minute: dt.datetime, title: str) -> SafeString:
    """An ``<svg>`` with one panel per series, stacked, over the same minutes (``first_minute``
    on): each panel its own y axis from 0 to a round maximum, its name and total; the time
    labels every 15 minutes under the last one."""
    minutes = max((len(s.values) for s in series), default=0)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, PANEL_HEIGHT - TOP - BOTTOM
    height = PANEL_HEIGHT * max(len(series), 1) + AXIS_HEIGHT

    def x(i: int) -> float:
        return LEFT + (plot_w * i / max(minutes - 1, 1))

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}"'
        f' role="img" aria-label="{escape(title)}" class="bd-chart" font-size="11" font-family="sans-serif">',
        f"<title>{escape(title)}</title>",
    ]
    for n, line in enumerate(series):
        color = COLORS[n % len(COLORS)]
        offset = n * PANEL_HEIGHT
        top = _nice_max(max(line.values, default=0))

        def y(value: int, offset: int = offset, top: int = top) -> float:
            return offset + TOP + plot_h - plot_h * value / top

        parts.append(f'<g class="bd-panel" data-panel="{escape(line.name)}" data-max="{top}">')
        parts.append(
            f'<rect x="{LEFT}" y="{offset + 6}" width="10" height="10" fill="{color}"/>'
            f'<text x="{LEFT + 14}" y="{offset + 15}" fill="currentColor">'
            f"{escape(line.name)} ({sum(line.values)} in the hour, axis 0 to {top} a minute)</text>"
        )
        for fraction in (0, 1):  # the panel's own axis: its floor and its top
            value = round(top * fraction)
            parts.append(
                f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(value):.1f}" y2="{y(value):.1f}"'
                ' stroke="currentColor" stroke-opacity="0.15"/>'
                f'<text x="{LEFT - 6}" y="{y(value) + 4:.1f}" text-anchor="end" fill="currentColor">{value}</text>'
            )
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(line.values))
        parts.append(
            f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"'
            f' data-series="{escape(line.name)}" data-total="{sum(line.values)}"/>'
        )
        parts.append("</g>")
    axis_y = PANEL_HEIGHT * max(len(series), 1) + AXIS_HEIGHT - 6
    for i in range(0, minutes, 15):  # time labels
        label = timezone.localtime(first_minute + dt.timedelta(minutes=i)).strftime("%H:%M")
        parts.append(f'<text x="{x(i):.1f}" y="{axis_y}" text-anchor="middle" fill="currentColor">{label}</text>')
    parts.append("</svg>")
    return mark_safe("".join(parts))  # numbers and escaped text only
