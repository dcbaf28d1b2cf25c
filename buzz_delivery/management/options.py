"""argparse ``type=`` validators shared by the management commands.

Each raises :class:`argparse.ArgumentTypeError`, which argparse reports as
``argument --name: <message>`` (a ``CommandError`` under ``call_command``).
"""

from __future__ import annotations

import argparse
import math
import re
import uuid
from collections.abc import Callable

from buzz_delivery.conf import get_settings
from buzz_delivery.services.validation import MAX_POLL_SECONDS

# The bounds of ``ttl_seconds`` in :mod:`buzz_delivery.services.runlock` (its ``_ttl``).
RUN_LEASE_MIN_SECONDS = 1
RUN_LEASE_MAX_SECONDS = 86_400
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


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


def poll_seconds_option(text: str) -> float:
    """A worker's ``--poll-interval``/``--poll-seconds``: > 0 and at most a day
    (``MAX_POLL_SECONDS``): a longer wait than a thread can make ended the worker at its first
    idle poll (OverflowError)."""
    value = positive_seconds(text)
    if value > MAX_POLL_SECONDS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_POLL_SECONDS:g} seconds, got {text[:80]}")
    return value


def hint_stagger_option(text: str) -> float:
    """A delivery worker's ``--hint-stagger``: 0 (off) up to ``MAX_HINT_STAGGER`` seconds."""
    from buzz_delivery.worker.runtime import MAX_HINT_STAGGER

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text[:80]!r}") from None
    if not 0 <= value <= MAX_HINT_STAGGER:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"must be within 0..{MAX_HINT_STAGGER:g} seconds, got {text[:80]}")
    return value


def name_option(high: int) -> Callable[[str], str]:
    """A name such as ``--worker-id``: not blank and at most ``high`` characters."""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"must name it (1..{high} characters), got {text!r}")
        if len(text) > high:
            raise argparse.ArgumentTypeError(f"must be at most {high} characters, got {len(text)}")
        return text

    return parse


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
    """A 32-byte public key as exactly 64 hex digits (0-9, a-f, A-F) and nothing else: no
    whitespace, which ``bytes.fromhex`` would skip and so return fewer than 32 bytes."""
    if len(text) != 64:
        raise argparse.ArgumentTypeError(f"must be 64 hex characters, got {len(text)}")
    if not _HEX64.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be 64 hex characters (0-9, a-f) and nothing else, got {text!r}")
    return bytes.fromhex(text)


def community_target(text: str) -> tuple[uuid.UUID, bytes]:
    """A (community, target) pair written ``COMMUNITY_UUID:TARGET_HEX`` (64 hex digits)."""
    community, sep, target = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"must be COMMUNITY_UUID:TARGET_HEX, got {text[:120]!r}")
    return uuid_value(community), pubkey_hex(target)


def _seconds_within(text: str, low: float, high: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text[:80]!r}") from None
    if not low <= value <= high:  # NaN, the infinities and "1e400" fail this too
        raise argparse.ArgumentTypeError(f"must be within {low:g}..{high:g} seconds, got {text[:80]}")
    return value


def lease_seconds_option(text: str) -> float:
    """A delivery lease length in seconds within ``BUZZ_DELIVERY``'s ``MIN_LEASE_SECONDS`` ..
    ``MAX_LEASE_SECONDS`` (inclusive; read when the option is parsed), the bounds
    :func:`buzz_delivery.services.claim_delivery` and ``renew_delivery`` accept."""
    conf = get_settings()
    return _seconds_within(text, conf.min_lease_seconds, conf.max_lease_seconds)


def run_lease_seconds(text: str) -> float:
    """A maintenance run lease length in seconds, 1..86,400 (inclusive): the bounds of
    ``ttl_seconds`` in :func:`buzz_delivery.services.acquire_run_lease` and ``renew_run_lease``."""
    return _seconds_within(text, RUN_LEASE_MIN_SECONDS, RUN_LEASE_MAX_SECONDS)
