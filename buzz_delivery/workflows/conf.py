"""Settings of the workflow engine: the ``BUZZ_WORKFLOWS`` dict (every key optional)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings

# NOTIFY channel on which the database announces ready steps (payload: the community id).
NOTIFY_CHANNEL = "buzz_workflows"
# Transaction-local setting: 'on' = releases leave the NOTIFY to the transaction (migration 0013).
NOTIFY_DEFERRED_SETTING = "buzz_workflows.notify_deferred"

DEFAULTS: dict[str, Any] = {
    # Step lease length (seconds) when a caller passes none; bounds as the core's leases.
    "LEASE_SECONDS": 60,
    # Dotted paths of callables registered as function steps: {"name": "pkg.mod:func"}.
    "FUNCTIONS": {},
    # Modules imported when the app is ready, for their @workflow_function registrations
    # (besides the ``workflows`` module of every installed app): ["myproject.steps"].
    "MODULES": [],
    # Largest JSON output a step may record (bytes of its JSON text).
    "MAX_OUTPUT_BYTES": 256_000,
    # Retry defaults of a step without "retry": attempts, backoff base and cap (seconds).
    "MAX_ATTEMPTS": 3,
    "BACKOFF_BASE_SECONDS": 2,
    "BACKOFF_CAP_SECONDS": 300,
    # Nesting depth bound of sub_workflow runs (at most 8, the database's CHECK).
    "MAX_DEPTH": 8,
    # The 32-byte author public key (64 hex) of the message events send_message steps post.
    "AUTHOR_PUBKEY": "00" * 32,
    # Kind number of those message events.
    "MESSAGE_KIND": 1,
    # Seconds an event sent by send_event is kept for a wait_event step that starts after it.
    "EVENT_RETENTION_SECONDS": 3600,
    # Most items a map step runs (a longer list fails the step: map_too_large); at most 10,000.
    "MAX_MAP_ITEMS": 1000,
}


@dataclass(frozen=True, slots=True)
class WorkflowSettings:
    lease_seconds: float
    functions: dict[str, str]
    modules: tuple[str, ...]
    max_output_bytes: int
    max_attempts: int
    backoff_base_seconds: float
    backoff_cap_seconds: float
    max_depth: int
    author_pubkey: bytes
    message_kind: int
    event_retention_seconds: int
    max_map_items: int


def get_settings() -> WorkflowSettings:
    """The ``BUZZ_WORKFLOWS`` settings merged over :data:`DEFAULTS` (read on every call)."""
    raw = {**DEFAULTS, **(getattr(settings, "BUZZ_WORKFLOWS", None) or {})}
    return WorkflowSettings(
        lease_seconds=raw["LEASE_SECONDS"],
        functions=dict(raw["FUNCTIONS"]),
        modules=tuple(raw["MODULES"]),
        max_output_bytes=raw["MAX_OUTPUT_BYTES"],
        max_attempts=raw["MAX_ATTEMPTS"],
        backoff_base_seconds=raw["BACKOFF_BASE_SECONDS"],
        backoff_cap_seconds=raw["BACKOFF_CAP_SECONDS"],
        max_depth=min(int(raw["MAX_DEPTH"]), 8),
        author_pubkey=bytes.fromhex(raw["AUTHOR_PUBKEY"]),
        message_kind=raw["MESSAGE_KIND"],
        event_retention_seconds=raw["EVENT_RETENTION_SECONDS"],
        max_map_items=min(int(raw["MAX_MAP_ITEMS"]), 10_000),
    )
