"""How the admin shows binary values and JSON snapshots (SPEC section 8).

32-byte values (event ids, public keys) are lowercase hex: short in lists, full on detail
pages. Nothing here runs a query.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from django.db.models import Model, OuterRef, Subquery, TextField
from django.db.models.functions import Cast
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from buzz_delivery import jsonbounds

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
    """Indented JSON in a ``<pre>`` block (a value already loaded; see :func:`json_block` for
    stored JSON read as text)."""
    if value is None:
        return EMPTY
    try:
        text = json.dumps(value, indent=2)
    except (RecursionError, ValueError, TypeError):
        return _raw_json(repr(value)[:RAW_JSON_CHARS])
    return format_html('<pre style="white-space: pre-wrap; margin: 0">{}</pre>', text)


# A stored JSON value the admin cannot show as a tree is shown as this much raw text.
RAW_JSON_CHARS = 20_000


def _raw_json(text: str, why: str = "not a tree the admin can show") -> str:
    return format_html(
        '<p class="bd-quiet">{} ({} characters); its first {}:</p>'
        '<pre style="white-space: pre-wrap; margin: 0">{}</pre>',
        why,
        len(text),
        min(len(text), RAW_JSON_CHARS),
        text[:RAW_JSON_CHARS],
    )


def json_block(text: str | None) -> str:
    """A stored JSON value, read as text (``jsonb::text``), indented in a ``<pre>`` block; a value
    Python cannot load or print (nested deeper than :data:`~buzz_delivery.jsonbounds.MAX_DEPTH`
    levels: stored before the bounds, or by hand) is shown as raw text instead of a 500."""
    if text is None:
        return EMPTY
    try:
        value = jsonbounds.loads(text)
    except jsonbounds.JSONRefused as exc:
        why = "too deeply nested to show as a tree" if "nested" in str(exc) else "not a value the admin can show"
        return _raw_json(text, why)
    return format_html('<pre style="white-space: pre-wrap; margin: 0">{}</pre>', json.dumps(value, indent=2))


def json_text_name(field: str) -> str:
    """The annotation that carries JSON column ``field`` as text (:func:`with_json_as_text`)."""
    return f"{field}_as_text"


def with_json_as_text(queryset: Any, fields: tuple[str, ...]) -> Any:
    """``queryset`` with the JSON columns ``fields`` deferred and read as text instead: loading a
    row then never parses them (Python's parser fails on a value nested deeply enough)."""
    if not fields:
        return queryset
    return queryset.defer(*fields).annotate(**{json_text_name(f): Cast(f, TextField()) for f in fields})


def json_field(obj: Model, field: str) -> str:
    """JSON column ``field`` of ``obj`` as :func:`json_block`, from its text annotation (one more
    query when the row was loaded without it)."""
    name = json_text_name(field)
    if hasattr(obj, name):
        return json_block(getattr(obj, name))
    rows = type(obj)._base_manager.filter(pk=obj.pk).annotate(**{name: Cast(field, TextField())})
    return json_block(rows.values_list(name, flat=True).first())


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
