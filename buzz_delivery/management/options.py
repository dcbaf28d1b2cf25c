"""argparse ``type=`` validators shared by the management commands.

Each raises :class:`argparse.ArgumentTypeError`, which argparse reports as
``argument --name: <message>`` (a ``CommandError`` under ``call_command``).
"""

from __future__ import annotations

import argparse
import math
import uuid
from collections.abc import Callable


def int_in(low: int = 1, high: int | None = None) -> Callable[[str], int]:
    """An int within ``low..high`` (inclusive; no upper bound when ``high`` is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
        return value

    return parse


positive_int = int_in(1)


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def fraction(text: str) -> float:
    """A number strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must lie strictly between 0 and 1, got {text}")
    return value


def uuid_value(text: str) -> uuid.UUID:
    """A UUID, such as a community id."""
    try:
        return uuid.UUID(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a valid UUID: {text[:80]!r}") from None


def pubkey_hex(text: str) -> bytes:
    """A 32-byte public key as 64 hex characters."""
    if len(text) != 64:
        raise argparse.ArgumentTypeError(f"must be 64 hex characters, got {len(text)}")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be 64 hex characters") from None
