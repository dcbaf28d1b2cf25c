"""Settings of agent runs: the ``BUZZ_AGENTS`` dict (every key optional)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings

# NOTIFY channel on which the database announces claimable agent runs (payload: community id).
NOTIFY_CHANNEL = "buzz_agents"

# Largest cost of one call and largest cost budget of a run (cost units): 2**53 - 1, the largest
# integer every JSON client holds exactly; a run's spent cost plus one more call then always fits
# the bigint the statement adds them in (2**62 did not: two calls of 2**62 overflowed it).
MAX_COST_UNITS = 2**53 - 1

DEFAULTS: dict[str, Any] = {
    "LEASE_SECONDS": 60,  # run lease length (seconds), within the core's lease bounds
    "MAX_ATTEMPTS": 3,  # lapsed leases a run survives before it ends failed/attempts_exhausted
    "RETRY_DELAY_SECONDS": 5,  # first backoff of a reclaimed run; doubles with each attempt
    "RETRY_DELAY_MAX_SECONDS": 300,  # the backoff's cap
    # The operator's policy defaults (issue 27): a community's or an agent's policy row
    # (buzz_delivery.agents.services.policy) overrides them; a caller may ask for less, never more.
    "MAX_TOOL_CALLS": 100,  # budget: journal entries per run
    "MAX_COST": 1_000_000,  # budget: cost units per run
    "MAX_TIMEOUT_SECONDS": None,  # longest deadline of a run (None = a run has none unless asked)
    "MAX_LEASE_SECONDS": None,  # longest run lease (None = the core's MAX_LEASE_SECONDS)
    "SHADOW": False,  # True: every run is a shadow run (destructive calls blocked)
    "MAX_OUTPUT_BYTES": 256_000,  # largest JSON a call result or run output may record
    # Streamed output (ctx.emit, issue 29): bytes (UTF-8) of one chunk, and of all chunks of a run.
    "MAX_CHUNK_BYTES": 64 * 1024,
    "MAX_STREAM_BYTES": 1024 * 1024,
}


@dataclass(frozen=True, slots=True)
class AgentSettings:
    lease_seconds: float
    max_attempts: int
    retry_delay_seconds: float
    retry_delay_max_seconds: float
    max_tool_calls: int
    max_cost: int
    max_timeout_seconds: int | None
    max_lease_seconds: float | None
    shadow: bool
    max_output_bytes: int
    max_chunk_bytes: int
    max_stream_bytes: int


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
        max_timeout_seconds=None if raw["MAX_TIMEOUT_SECONDS"] is None else int(raw["MAX_TIMEOUT_SECONDS"]),
        max_lease_seconds=None if raw["MAX_LEASE_SECONDS"] is None else float(raw["MAX_LEASE_SECONDS"]),
        shadow=bool(raw["SHADOW"]),
        max_output_bytes=int(raw["MAX_OUTPUT_BYTES"]),
        max_chunk_bytes=int(raw["MAX_CHUNK_BYTES"]),
        max_stream_bytes=int(raw["MAX_STREAM_BYTES"]),
    )
