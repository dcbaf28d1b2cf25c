"""Typed access to the ``BUZZ_GATEWAY`` settings dict (every key optional; see :data:`DEFAULTS`).

Values are read on every call, so ``override_settings`` works in tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings

DEFAULTS: dict[str, Any] = {
    # A NIP-98 event's created_at must lie within this many seconds of the database clock.
    "AUTH_WINDOW_SECONDS": 60,
    # Largest request body accepted (bytes); a larger one is refused with 413 before it is read.
    "MAX_BODY_BYTES": 64 * 1024,
    # Longest a claim may long-poll (seconds); ``wait_seconds`` above it is a 400.
    "MAX_WAIT_SECONDS": 30,
    # Most deliveries one claim request may return.
    "MAX_CLAIM_LIMIT": 100,
    # While long-polling, claim again at least this often even without a wake hint (seconds):
    # the fallback when a hint was missed or the LISTEN connection is down.
    "POLL_SECONDS": 1.0,
    # What one server process serves at once (issue 27; buzz_delivery.gateway.limits): requests
    # of one agent key, requests into one community (its id in the path), long-poll claims of one
    # key, and long-poll claims waiting on one community. Over a bound: 429, Retry-After. Keep
    # them below gunicorn's --threads, so no key and no community can take every thread.
    "MAX_REQUESTS_PER_KEY": 16,
    "MAX_REQUESTS_PER_COMMUNITY": 24,
    "MAX_LONG_POLLS_PER_KEY": 4,
    "MAX_LONG_POLLS_PER_COMMUNITY": 12,
    # The scheme and host agents sign in the ``u`` tag, e.g. "https://api.example.com" (no
    # trailing slash), when a proxy in front rewrites them; None = ``request.build_absolute_uri()``.
    "PUBLIC_BASE_URL": None,
}


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """The resolved gateway settings. Units: seconds and bytes."""

    auth_window_seconds: float
    max_body_bytes: int
    max_wait_seconds: float
    max_claim_limit: int
    poll_seconds: float
    public_base_url: str | None
    max_requests_per_key: int
    max_requests_per_community: int
    max_long_polls_per_key: int
    max_long_polls_per_community: int


def get_settings() -> GatewaySettings:
    """The current :class:`GatewaySettings` (the user's ``BUZZ_GATEWAY`` over :data:`DEFAULTS`)."""
    raw = {**DEFAULTS, **(getattr(settings, "BUZZ_GATEWAY", None) or {})}
    return GatewaySettings(
        auth_window_seconds=float(raw["AUTH_WINDOW_SECONDS"]),
        max_body_bytes=int(raw["MAX_BODY_BYTES"]),
        max_wait_seconds=float(raw["MAX_WAIT_SECONDS"]),
        max_claim_limit=int(raw["MAX_CLAIM_LIMIT"]),
        poll_seconds=float(raw["POLL_SECONDS"]),
        public_base_url=raw["PUBLIC_BASE_URL"],
        max_requests_per_key=int(raw["MAX_REQUESTS_PER_KEY"]),
        max_requests_per_community=int(raw["MAX_REQUESTS_PER_COMMUNITY"]),
        max_long_polls_per_key=int(raw["MAX_LONG_POLLS_PER_KEY"]),
        max_long_polls_per_community=int(raw["MAX_LONG_POLLS_PER_COMMUNITY"]),
    )
