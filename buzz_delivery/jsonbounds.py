"""Bounds on every JSON value that enters the system (issue 27): depth, text PostgreSQL can
store, and, for JSON text received from outside, no duplicate keys and no non-standard
constants. Without Django, so the gateway's NIP-98 parser and its client use it too.

Python's ``json`` module parses and serialises recursively: a value nested deeper than the
interpreter's recursion limit (about a thousand levels, less when the stack is already deep)
raises ``RecursionError``, which nothing catches as bad input; a lone surrogate (``"\\ud800"``)
becomes a ``str`` that ``jsonb`` refuses at write time. :func:`check` walks a value without
recursion and says what is wrong and where; :func:`loads` parses received text and then checks
it the same way.
"""

from __future__ import annotations

import json
from typing import Any

# Deepest nesting of arrays and objects accepted anywhere (an honest tool output is a few levels).
MAX_DEPTH = 100


class JSONRefused(ValueError):
    """A JSON value or text is out of bounds; the message says why and ``path`` where
    (``$`` the value itself, ``$.a[2]`` inside it)."""

    def __init__(self, message: str, path: str = "$") -> None:
        super().__init__(f"{message} (at {path})" if path != "$" else message)
        self.path = path


def bad_text(text: str) -> str | None:
    """Why PostgreSQL text or jsonb cannot hold ``text`` (a NUL, a surrogate code point), or None."""
    if "\x00" in text:
        return "holds a NUL character, which PostgreSQL cannot store"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"holds the surrogate code point U+{ord(text[exc.start]):04X}, which is not valid Unicode"
    return None


def check(value: Any, *, max_depth: int = MAX_DEPTH, strict: bool = True) -> None:
    """Raise :class:`JSONRefused` unless ``value`` is plain JSON (dict with str keys, list or
    tuple, str, int, finite float, bool, None) nested at most ``max_depth`` levels, whose
    strings and keys PostgreSQL can store. Iterative: any depth is judged without recursion.
    ``strict=False`` lets other leaves (a datetime, a UUID...) through, for a caller whose
    encoder turns them into JSON."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "$")]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth >= max_depth:
                raise JSONRefused(f"is nested more than {max_depth} levels deep", path)
            if isinstance(item, dict):
                for key, inner in item.items():
                    if not isinstance(key, str):
                        raise JSONRefused(f"has a key that is not a string ({type(key).__name__})", path)
                    why = bad_text(key)
                    if why:
                        raise JSONRefused(f"has a key that {why}", path)
                    stack.append((inner, depth + 1, f"{path}.{key[:40]}"))
            else:
                stack.extend((inner, depth + 1, f"{path}[{i}]") for i, inner in enumerate(item))
        elif isinstance(item, str):
            why = bad_text(item)
            if why:
                raise JSONRefused(why, path)
        elif isinstance(item, float):
            if item != item or item in (float("inf"), float("-inf")):
                raise JSONRefused("holds a number that is not finite", path)
        elif strict and item is not None and not isinstance(item, bool | int):
            raise JSONRefused(f"holds a {type(item).__name__}, which is not JSON", path)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JSONRefused(f"has the key {key[:40]!r} twice")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise JSONRefused(f"holds {name}, which is not JSON")


def loads(text: str | bytes, *, max_depth: int = MAX_DEPTH, checked: bool = True) -> Any:
    """Parse received JSON text (bytes must be UTF-8) and :func:`check` the value. Refused with
    :class:`JSONRefused`: text that is not JSON, a key twice in one object, ``NaN`` or
    ``Infinity``, nesting beyond ``max_depth``, a NUL or a lone surrogate in a string.
    ``checked=False`` leaves the :func:`check` to the caller (who checks each field, to name it);
    nesting beyond what the parser can take is refused all the same."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except JSONRefused:
        raise
    except RecursionError:
        raise JSONRefused(f"is nested more than {max_depth} levels deep") from None
    except (UnicodeDecodeError, ValueError):
        raise JSONRefused("is not valid JSON (UTF-8)") from None
    if checked:
        check(value, max_depth=max_depth)
    return value
