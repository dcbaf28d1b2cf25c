"""How the admin shows binary values, times, holders and JSON (SPEC section 8, issue 36).

One helper per kind of value, used by every app's admin:

- 32-byte values (event ids, public keys) are lowercase hex: short in lists, full on detail pages;
- times are :func:`timestamp` (``YYYY-MM-DD HH:MM:SS`` in the current time zone, which each page
  states once: :func:`time_zone_name`);
- a holder (``host:pid:worker``, ``gateway:<64 hex>``) is :func:`holder`, a 64-hex key inside it
  shortened to its first 8 and last 4 characters with the full value as tooltip;
- JSON is :func:`pretty_json` (a loaded value) or :func:`json_text` (the text the database
  rendered): indented, escaped, bounded in depth and size, never a Python repr and never a 500,
  however deep or large the stored value.

Nothing here runs a query.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any

from django.db.models import OuterRef, Subquery
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


TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def timestamp(value: dt.datetime | None) -> str:
    """``YYYY-MM-DD HH:MM:SS`` in the current time zone (the project's ``TIME_ZONE`` unless a
    middleware activated another): the one time format of every admin list and page."""
    if value is None:
        return EMPTY
    if timezone.is_naive(value):
        return value.strftime(TIME_FORMAT)
    return timezone.localtime(value).strftime(TIME_FORMAT)


def time_zone_name() -> str:
    """The zone :func:`timestamp` writes in, as each page states it once."""
    return timezone.get_current_timezone_name()


# A 64-hex key (an agent's public key) inside a holder name.
_KEY_IN_TEXT = re.compile(r"[0-9a-f]{64}")
KEY_HEAD, KEY_TAIL = 8, 4


def short_key_text(text: str) -> str:
    """``text`` with every 64-hex key shortened to ``first 8…last 4``."""
    return _KEY_IN_TEXT.sub(lambda m: f"{m.group()[:KEY_HEAD]}…{m.group()[-KEY_TAIL:]}", text)


def holder(value: str | None) -> str:
    """A lease holder for a list column: a gateway holder's 64-hex key shortened (first 8 and
    last 4 characters) with the full holder as tooltip; a ``host:pid:worker`` name as it is."""
    if not value:
        return EMPTY
    short = short_key_text(value)
    if short == value:
        return value
    return format_html('<code title="{}">{}</code>', value, short)


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


# What a page shows of one JSON value: at most this many characters, nested this deep.
JSON_MAX_CHARS = 20_000
JSON_MAX_DEPTH = 40
# Stored text nested deeper than this is shown as it is, not parsed (below Python's parser limits).
PARSE_MAX_DEPTH = 500
DEEPER = "…"  # stands for a value nested deeper than JSON_MAX_DEPTH


def _clip(value: Any, depth: int = 0) -> tuple[Any, bool]:
    """``value`` with every array or object nested deeper than :data:`JSON_MAX_DEPTH` replaced
    by :data:`DEEPER`, and whether anything was. Recurses at most that deep."""
    if not isinstance(value, dict | list | tuple):
        return value, False
    if depth >= JSON_MAX_DEPTH:
        return DEEPER, True
    clipped = False
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, inner in value.items():
            out[str(key)], cut = _clip(inner, depth + 1)
            clipped |= cut
        return out, clipped
    items = []
    for inner in value:
        item, cut = _clip(inner, depth + 1)
        items.append(item)
        clipped |= cut
    return items, clipped


def _json_block(text: str, notes: list[str]) -> str:
    body = format_html('<pre class="bd-json">{}</pre>', text)
    if not notes:
        return body
    return format_html('{}<p class="help bd-json-note">{}</p>', body, " ".join(notes))


def _bounded_dumps(value: Any) -> tuple[str, list[str]]:
    clipped, deep = _clip(value)
    text = json.dumps(clipped, indent=2, ensure_ascii=False, default=str)
    notes = [f"Nested deeper than {JSON_MAX_DEPTH} levels: shown as {DEEPER}."] if deep else []
    if len(text) > JSON_MAX_CHARS:
        notes.append(f"Truncated: the first {JSON_MAX_CHARS:,} of {len(text):,} characters.")
        text = text[:JSON_MAX_CHARS] + "…"
    return text, notes


def pretty_json(value: Any) -> str:
    """A loaded JSON value, indented in a ``<pre>`` block (escaped), at most
    :data:`JSON_MAX_DEPTH` levels and :data:`JSON_MAX_CHARS` characters, each cut said in a note."""
    if value is None:
        return EMPTY
    text, notes = _bounded_dumps(value)
    return _json_block(text, notes)


def json_text(text: str | None, total_chars: int | None = None) -> str:
    """A JSON value from the text PostgreSQL rendered of it (``jsonb::text``, cut by the query at
    :data:`JSON_MAX_CHARS` + 1 characters; ``total_chars`` the whole text's length): parsed and
    indented when it is whole and Python can parse it, else the text as it is, cut, with a note.
    Python's parser would raise ``RecursionError`` on a value nested about a thousand deep (and
    so would loading such a row through the ORM): the text is never parsed past its bound."""
    if text is None:
        return EMPTY
    total = total_chars if total_chars is not None else len(text)
    if total <= JSON_MAX_CHARS:
        try:
            # Bounded explicitly: how deep Python's own parser goes differs between versions
            # (3.12 and later parse a thousand levels that 3.11 refuses).
            value = jsonbounds.loads(text, max_depth=PARSE_MAX_DEPTH)
        except (RecursionError, ValueError):  # JSONRefused is a ValueError
            return _json_block(text, [f"Nested too deep to indent ({total:,} characters)."])
        shown, notes = _bounded_dumps(value)
        return _json_block(shown, notes)
    return _json_block(
        text[:JSON_MAX_CHARS] + "…",
        [f"Truncated: the first {JSON_MAX_CHARS:,} of {total:,} characters, as stored (not indented)."],
    )


def json_line(text: str | None, chars: int = 120) -> str:
    """A JSON value's stored text on one line, cut at ``chars`` (a journal entry's output)."""
    if text is None:
        return "null"
    return text if len(text) <= chars else text[:chars] + "…"


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
    if key == "actor":
        return holder(str(value))
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
