"""Argument validation shared by the services. Every check raises
:class:`django.core.exceptions.ValidationError` keyed by the argument's name,
before any SQL runs (SPEC section 2)."""

from __future__ import annotations

import datetime as dt
import numbers
import uuid
from typing import Any

from django.core.exceptions import ValidationError

from buzz_delivery.conf import get_settings

STEP_ID_MAX_CHARS = 64


def invalid(name: str, message: str) -> ValidationError:
    """A ValidationError whose ``message_dict`` is ``{name: [message]}``."""
    return ValidationError({name: [f"{name}: {message}"]}, code="invalid")


def _shown(value: Any) -> str:
    """A number for a message. An int beyond 64 bits is described, not printed: str() refuses
    ints of more than 4,300 digits, and a refusal must not fail on its own message."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"{'-' if value < 0 else ''}an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def storable_text(value: str, name: str) -> str:
    """``value`` if PostgreSQL ``text`` can store it: no NUL, and valid Unicode, i.e. no surrogate
    code point (U+D800..U+DFFF: lone, or a pair split into two code points), which UTF-8 cannot
    encode. A real astral character (one code point beyond U+FFFF) is fine."""
    if "\x00" in value:
        raise invalid(name, "must not contain NUL characters (PostgreSQL text cannot store them)")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise invalid(
                name,
                f"must be valid Unicode: U+{ord(value[exc.start]):04X} at position {exc.start} is a surrogate "
                "code point, which UTF-8 text (and so PostgreSQL) cannot store",
            ) from None
    return value


def bytes32(value: Any, name: str) -> bytes:
    """Exactly 32 bytes (bytes, bytearray or memoryview). Hex strings are refused."""
    if isinstance(value, bytearray | memoryview):
        value = bytes(value)
    if not isinstance(value, bytes):
        raise invalid(name, f"must be 32 bytes, not {type(value).__name__} (use bytes.fromhex for hex text)")
    if len(value) != 32:
        raise invalid(name, f"must be exactly 32 bytes, got {len(value)}")
    return value


def uuid_value(value: Any, name: str) -> uuid.UUID:
    """A UUID, or a string holding one."""
    if isinstance(value, uuid.UUID):
        return value
    if isinstance(value, str):
        try:
            return uuid.UUID(value)
        except ValueError:
            raise invalid(name, f"is not a valid UUID: {value[:80]!r}") from None
    raise invalid(name, f"must be a UUID, not {type(value).__name__}")


def step_id(value: Any) -> str:
    """1..64 characters, not blank after stripping whitespace."""
    if not isinstance(value, str):
        raise invalid("step_id", f"must be a str, not {type(value).__name__}")
    value = str.__str__(value)  # a plain str, whatever a subclass overrides
    if not value.strip():
        raise invalid("step_id", "must not be blank")
    if len(value) > STEP_ID_MAX_CHARS:
        raise invalid("step_id", f"must be at most {STEP_ID_MAX_CHARS} characters, got {len(value)}")
    return storable_text(value, "step_id")


def aware_datetime(value: Any, name: str) -> dt.datetime:
    """A timezone-aware datetime, returned as the same instant in UTC (``astimezone(dt.UTC)``).

    Refused: a naive datetime, a tzinfo whose offset is unusable, and an instant UTC cannot
    represent (``datetime.min`` east of UTC, ``datetime.max`` west of it): PostgreSQL would store
    it, but no Python code could read it back."""
    if not isinstance(value, dt.datetime):
        raise invalid(name, f"must be a datetime, not {type(value).__name__}")
    try:
        offset = value.utcoffset()
    except (ValueError, TypeError) as exc:  # a tzinfo returning an offset of a day or more, or no timedelta
        raise invalid(name, f"has a timezone with an unusable UTC offset: {exc}") from None
    if offset is None:
        raise invalid(name, "must be timezone-aware (naive datetimes are refused)")
    try:
        return value.astimezone(dt.UTC)
    except OverflowError:
        raise invalid(name, f"is out of range: {value.isoformat()} falls outside years 1..9999 in UTC") from None


def whole_second_instant(value: Any, name: str) -> dt.datetime:
    """An aware datetime whose instant is whole seconds in UTC, returned in UTC. A UTC offset with
    a seconds part is fine when the instant still is whole seconds; one with a sub-second part is not."""
    value = aware_datetime(value, name)
    if value.microsecond:
        raise invalid(
            name,
            f"must be whole seconds in UTC (no microsecond, no sub-second UTC offset), got {value.isoformat()}",
        )
    return value


def int_in_range(value: Any, name: str, low: int, high: int) -> int:
    """An int (not a bool) within ``low..high`` inclusive, returned as a plain int."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"must be an int, not {type(value).__name__}")
    value = int.__int__(value)  # a plain int, whatever a subclass overrides
    if not low <= value <= high:
        raise invalid(name, f"must be within {low}..{high}, got {_shown(value)}")
    return value


def _float_seconds(value: Any, name: str) -> float:
    """A real number (not a bool) as a float; refused when no float holds it (``float(10**400)``
    raises OverflowError). The float may be NaN or infinite: callers check their bounds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise invalid(name, f"must be a number of seconds, not {type(value).__name__}")
    try:
        return float(value)
    except (OverflowError, ValueError, TypeError):
        raise invalid(name, f"must be a number of seconds a float can hold, got {_shown(value)}") from None


def seconds_in_range(value: Any, name: str, low: float, high: float) -> float:
    """A finite number of seconds (int, float, Fraction...; not a bool) within ``low..high``
    inclusive, as a float."""
    seconds = _float_seconds(value, name)
    if not low <= seconds <= high:  # NaN and the infinities fail this too
        raise invalid(name, f"must be within {low:g}..{high:g} seconds, got {seconds:g}")
    return seconds


# The longest idle wait between polls a worker takes (a day), every worker's poll_interval /
# poll_seconds: a finite wait past what a thread can make (1e10 s: OverflowError) ended the worker.
MAX_POLL_SECONDS = 86400.0


def poll_seconds(value: Any, name: str) -> float:
    """A worker's wait between idle polls: a finite number of seconds > 0 and at most
    :data:`MAX_POLL_SECONDS`, as a float (``ValidationError`` keyed ``name``)."""
    seconds = _float_seconds(value, name)
    if not 0 < seconds <= MAX_POLL_SECONDS:  # NaN and the infinities fail this too
        raise invalid(name, f"must be > 0 and at most {MAX_POLL_SECONDS:g} seconds, got {seconds:g}")
    return seconds


def lease_seconds(value: Any) -> float:
    """A lease length in seconds within the configured bounds (default 15..300); None = default."""
    conf = get_settings()
    if value is None:
        value = conf.lease_seconds
    seconds = _float_seconds(value, "lease_seconds")
    if not seconds > 0:
        raise invalid("lease_seconds", f"must be > 0, got {seconds:g}")
    if not conf.min_lease_seconds <= seconds <= conf.max_lease_seconds:
        raise invalid(
            "lease_seconds",
            f"must be within {conf.min_lease_seconds:g}..{conf.max_lease_seconds:g} seconds, got {seconds:g}",
        )
    return seconds


def positive_timedelta_seconds(value: Any, name: str, high: dt.timedelta) -> float:
    """A :class:`datetime.timedelta` above zero and at most ``high``, as a number of seconds. The
    bound keeps ``now() - make_interval(secs => ...)`` within what PostgreSQL's interval (about
    292,000 years, beyond which it wraps silently) and timestamp (4713 BC) arithmetic can take."""
    if not isinstance(value, dt.timedelta):
        raise invalid(name, f"must be a timedelta, not {type(value).__name__}")
    if not dt.timedelta(0) < value <= high:
        raise invalid(name, f"must be more than 0 and at most {high.days} days, got {value!r}")
    return value.total_seconds()


def optional_text(value: Any, name: str, max_chars: int) -> str | None:
    """None, or a str of at most ``max_chars`` characters that PostgreSQL can store
    (:func:`storable_text`)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid(name, f"must be a str or None, not {type(value).__name__}")
    if len(value) > max_chars:
        raise invalid(name, f"must be at most {max_chars} characters, got {len(value)}")
    return storable_text(str.__str__(value), name)
