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
    if not value.strip():
        raise invalid("step_id", "must not be blank")
    if len(value) > STEP_ID_MAX_CHARS:
        raise invalid("step_id", f"must be at most {STEP_ID_MAX_CHARS} characters, got {len(value)}")
    if "\x00" in value:
        raise invalid("step_id", "must not contain NUL characters")
    return value


def aware_datetime(value: Any, name: str) -> dt.datetime:
    """A timezone-aware datetime."""
    if not isinstance(value, dt.datetime):
        raise invalid(name, f"must be a datetime, not {type(value).__name__}")
    if value.tzinfo is None or value.tzinfo.utcoffset(value) is None:
        raise invalid(name, "must be timezone-aware (naive datetimes are refused)")
    return value


def whole_second_instant(value: Any, name: str) -> dt.datetime:
    """An aware datetime with no sub-second part."""
    value = aware_datetime(value, name)
    if value.microsecond:
        raise invalid(name, "must be whole seconds (microsecond must be 0)")
    return value


def int_in_range(value: Any, name: str, low: int, high: int) -> int:
    """An int (not a bool) within ``low..high`` inclusive."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise invalid(name, f"must be within {low}..{high}, got {value}")
    return value


def lease_seconds(value: Any) -> float:
    """A lease length in seconds within the configured bounds (default 15..300); None = default."""
    conf = get_settings()
    if value is None:
        value = conf.lease_seconds
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise invalid("lease_seconds", f"must be a number of seconds, not {type(value).__name__}")
    value = float(value)
    if not value > 0:
        raise invalid("lease_seconds", f"must be > 0, got {value:g}")
    if not conf.min_lease_seconds <= value <= conf.max_lease_seconds:
        raise invalid(
            "lease_seconds",
            f"must be within {conf.min_lease_seconds:g}..{conf.max_lease_seconds:g} seconds, got {value:g}",
        )
    return value


def optional_text(value: Any, name: str, max_chars: int) -> str | None:
    """None, or a str of at most ``max_chars`` characters."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid(name, f"must be a str or None, not {type(value).__name__}")
    if len(value) > max_chars:
        raise invalid(name, f"must be at most {max_chars} characters, got {len(value)}")
    if "\x00" in value:
        raise invalid(name, "must not contain NUL characters (PostgreSQL text cannot store them)")
    return value
