"""A small line chart drawn on the server as inline SVG (the dashboard's throughput, issue 17).

No script and no CDN: the page works offline and under a strict Content-Security-Policy. The
markup is built from numbers this module computes and from escaped text only.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

WIDTH, HEIGHT = 720, 200
LEFT, RIGHT, TOP, BOTTOM = 48, 12, 24, 28
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
    """An ``<svg>`` with one polyline per series over the same minutes (``first_minute`` on),
    a y axis from 0 to a round maximum, time labels every 15 minutes and a legend."""
    minutes = max((len(s.values) for s in series), default=0)
    top = _nice_max(max((max(s.values, default=0) for s in series), default=0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(i: int) -> float:
        return LEFT + (plot_w * i / max(minutes - 1, 1))

    def y(value: int) -> float:
        return TOP + plot_h - plot_h * value / top

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}"'
        f' role="img" aria-label="{escape(title)}" class="bd-chart" font-size="11" font-family="sans-serif">',
        f"<title>{escape(title)}</title>",
    ]
    for fraction in (0, 0.5, 1):  # grid lines and y labels
        value = round(top * fraction)
        parts.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(value):.1f}" y2="{y(value):.1f}"'
            ' stroke="currentColor" stroke-opacity="0.15"/>'
            f'<text x="{LEFT - 6}" y="{y(value) + 4:.1f}" text-anchor="end" fill="currentColor">{value}</text>'
        )
    for i in range(0, minutes, 15):  # time labels
        label = timezone.localtime(first_minute + dt.timedelta(minutes=i)).strftime("%H:%M")
        parts.append(f'<text x="{x(i):.1f}" y="{HEIGHT - 8}" text-anchor="middle" fill="currentColor">{label}</text>')
    for n, line in enumerate(series):
        color = COLORS[n % len(COLORS)]
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(line.values))
        parts.append(
            f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"'
            f' data-series="{escape(line.name)}" data-total="{sum(line.values)}"/>'
        )
        legend_x = LEFT + n * 180
        parts.append(
            f'<rect x="{legend_x}" y="6" width="10" height="10" fill="{color}"/>'
            f'<text x="{legend_x + 14}" y="15" fill="currentColor">{escape(line.name)} ({sum(line.values)})</text>'
        )
    parts.append("</svg>")
    return mark_safe("".join(parts))  # numbers and escaped text only
