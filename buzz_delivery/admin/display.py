"""How the admin shows binary values and JSON snapshots (SPEC section 8).

32-byte values (event ids, public keys) are lowercase hex: short in lists, full on detail
pages. Nothing here runs a query.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from django.db.models import OuterRef, Subquery
from django.utils import timezone
from django.utils.html import format_html, format_html_join

SHORT_HEX_CHARS = 12
EMPTY = "—"


def full_hex(value: bytes | memoryview | None) -> str:
    """All bytes as lowercase hex (64 characters for a 32-byte value), or an em dash."""
    return bytes(value).hex() if value is not None else EMPTY


def short_hex(value: bytes | memoryview | None, chars: int = SHORT_HEX_CHARS) -> str:
    """The first ``chars`` hex characters and an ellipsis, with the full value as tooltip."""
    if value is None:
        return EMPTY
    text = bytes(value).hex()
    if len(text) <= chars:
        return text
    return format_html('<code title="{}" style="white-space: nowrap">{}…</code>', text, text[:chars])


def short_uuid(value: Any, chars: int = 12) -> str:
    """The last ``chars`` hex characters of a UUID, with the full UUID as tooltip. (Our ids are
    UUIDv7, whose leading characters are a timestamp shared by every row made that second.)"""
    if value is None:
        return EMPTY
    return format_html('<code title="{}" style="white-space: nowrap">…{}</code>', value, str(value)[-chars:])


def timestamp(value: dt.datetime | None) -> str:
    """A compact local ``YYYY-MM-DD HH:MM:SS`` for list columns."""
    if value is None:
        return EMPTY
    return timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S")


def duration(value: dt.timedelta | None) -> str:
    """A compact duration with seconds: ``45 s``, ``3 min 05 s``, ``2 h 01 min 09 s``, ``4 d 02 h 01 min``."""
    if value is None:
        return EMPTY
    seconds = max(int(value.total_seconds()), 0)
    days, rest = divmod(seconds, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days} d {hours:02d} h {minutes:02d} min"
    if hours:
        return f"{hours} h {minutes:02d} min {seconds:02d} s"
    if minutes:
        return f"{minutes} min {seconds:02d} s"
    return f"{seconds} s"


def pretty_json(value: Any) -> str:
    """Indented JSON in a ``<pre>`` block."""
    if value is None:
        return EMPTY
    return format_html('<pre style="white-space: pre-wrap; margin: 0">{}</pre>', json.dumps(value, indent=2))


def workflow_name_of_row() -> Subquery:
    """The row's workflow name, looked up on ``(community_id, id)``: one primary-key probe per
    listed row, and on Citus a subquery inside one shard group, where a join on the workflow id
    alone would need repartitioning (SPEC section 15)."""
    from buzz_delivery.models import Workflow

    return Subquery(
        Workflow.objects.filter(community_id=OuterRef("community_id"), id=OuterRef("workflow_id")).values("name")[:1]
    )


HISTORY_COLUMNS = ("at", "event", "status", "generation", "actor", "renewals", "attempt")
ACTOR_MAX_CHARS = 200


def _history_cell(key: str, value: Any) -> str:
    if value is None:
        return EMPTY
    if key == "at":
        try:
            return timestamp(dt.datetime.fromisoformat(str(value)))
        except ValueError:
            return str(value)
    return str(value)


def history_table(entries: Any) -> str:
    """A row's ``history`` (a list of entries, oldest first) as an HTML table, newest first."""
    if not entries:
        return EMPTY
    head = format_html_join("", "<th>{}</th>", ((c,) for c in HISTORY_COLUMNS))
    rows = format_html_join(
        "",
        "<tr>{}</tr>",
        (
            (format_html_join("", "<td>{}</td>", ((_history_cell(c, entry.get(c)),) for c in HISTORY_COLUMNS)),)
            for entry in reversed(entries)
            if isinstance(entry, dict)
        ),
    )
    return format_html('<table class="buzz-history"><thead><tr>{}</tr></thead><tbody>{}</tbody></table>', head, rows)


def operator_actor(request: Any) -> str:
    """The history actor of an admin action: ``operator:<username>``, at most 200 characters."""
    return f"operator:{request.user.get_username()}"[:ACTOR_MAX_CHARS]
