"""Settings of agent runs: the ``BUZZ_AGENTS`` dict (every key optional)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings

# NOTIFY channel on which the database announces claimable agent runs (payload: community id).
NOTIFY_CHANNEL = "buzz_agents"

DEFAULTS: dict[str, Any] = {
    "LEASE_SECONDS": 60,  # run lease length (seconds), within the core's lease bounds
    "MAX_ATTEMPTS": 3,  # lapsed leases a run survives before it ends failed/attempts_exhausted
    "RETRY_DELAY_SECONDS": 5,  # first backoff of a reclaimed run; doubles with each attempt
    "RETRY_DELAY_MAX_SECONDS": 300,  # the backoff's cap
    "MAX_TOOL_CALLS": 100,  # default budget: journal entries per run
    "MAX_COST": 1_000_000,  # default budget: cost units per run
    "MAX_OUTPUT_BYTES": 256_000,  # largest JSON a call result or run output may record
}


@dataclass(frozen=True, slots=True)
class AgentSettings:
    lease_seconds: float
    max_attempts: int
    retry_delay_seconds: float
    retry_delay_max_seconds: float
    max_tool_calls: int
    max_cost: int
    max_output_bytes: int


def get_settings() -> AgentSettings:
    """``BUZZ_AGENTS`` merged over :data:`DEFAULTS` (read on every call)."""
    raw = {**DEFAULTS, **(getattr(settings, "BUZZ_AGENTS", None) or {})}
    return AgentSettings(
        lease_seconds=float(raw["LEASE_SECONDS"]),
        max_attempts=int(raw["MAX_ATTEMPTS"]),
        retry_delay_seconds=float(raw["RETRY_DELAY_SECONDS"]),
        retry_delay_max_seconds=float(raw["RETRY_DELAY_MAX_SECONDS"]),
        max_tool_calls=int(raw["MAX_TOOL_CALLS"]),
        max_cost=int(raw["MAX_COST"]),
        max_output_bytes=int(raw["MAX_OUTPUT_BYTES"]),
    )
