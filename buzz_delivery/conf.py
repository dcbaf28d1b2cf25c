"""Typed access to the ``BUZZ_DELIVERY`` settings dict.

Every key is optional; :data:`DEFAULTS` holds the defaults. Values are read on
every call (cheap), so ``override_settings`` works in tests. Bad values are
reported by the system checks in :mod:`buzz_delivery.checks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings

DEFAULTS: dict[str, Any] = {
    # Lease length used when a caller passes ``lease_seconds=None`` (seconds).
    "LEASE_SECONDS": 60,
    # Bounds a lease length must fall within (seconds, inclusive). SPEC section 4.
    "MIN_LEASE_SECONDS": 15,
    "MAX_LEASE_SECONDS": 300,
    # Claims allowed per delivery before it fails with ``attempts_exhausted``; None = unlimited.
    "MAX_ATTEMPTS": 3,
    # Backoff after a ``retry`` finish: base * 2**(attempt-1), capped (seconds). SPEC section 6.
    "RETRY_BACKOFF_BASE_SECONDS": 5,
    "RETRY_BACKOFF_CAP_SECONDS": 300,
    # PostgreSQL NOTIFY channel that carries wake hints (SPEC section 7).
    "NOTIFY_CHANNEL": "buzz_delivery",
    # Rows per reaper / pruner / purge statement.
    "BATCH_SIZE": 1000,
    # Django database alias whose connection the worker LISTENs on for wake hints; None = the
    # worker's own. Name a direct (or session-pooled) alias when workers connect through a
    # transaction pooler, where a LISTEN hears nothing.
    "LISTEN_DATABASE": None,
    # Row-level security (SPEC section 13, docs/tenant-isolation.md): the roles the policies name,
    # and whether the services switch to them per transaction (``SET LOCAL ROLE``). Off: the
    # services run as the login role, which should then be a member of one of them.
    "TENANT_ROLE": "buzz_tenant",
    "MAINTENANCE_ROLE": "buzz_maintenance",
    "SWITCH_ROLES": False,
    # The bearer token /metrics asks for (buzz_delivery.metrics); None = open, as Prometheus
    # exporters are (a staff login is accepted too once it is set).
    "METRICS_TOKEN": None,
    # Concurrency limits by key (issue 32, docs/flow-control.md): key kind ("community",
    # "target", "workflow") -> at most that many deliveries claimed at once per key; {} = none.
    "CONCURRENCY_LIMITS": {},
    # ... of agent runs leased at once ("agent", "community") and of workflow steps running at
    # once ("workflow", "step", "community"); {} = none (services/flow.py).
    "AGENT_CONCURRENCY_LIMITS": {},
    "STEP_CONCURRENCY_LIMITS": {},
    # Rate limits by key (issue 32, docs/flow-control.md, services/ratelimits.py): key name ->
    # {"limit": units, "period": seconds}, at most that many units per period per key in each
    # community (ctx.call(..., rate_key=..., weight=...)); {} = none.
    "RATE_LIMITS": {},
}


@dataclass(frozen=True, slots=True)
class DeliverySettings:
    """The resolved settings. Units: seconds; counts are plain ints."""

    lease_seconds: float
    min_lease_seconds: float
    max_lease_seconds: float
    max_attempts: int | None
    retry_backoff_base_seconds: float
    retry_backoff_cap_seconds: float
    notify_channel: str
    batch_size: int
    listen_database: str | None


def raw_settings() -> dict[str, Any]:
    """The user's ``BUZZ_DELIVERY`` dict merged over :data:`DEFAULTS`."""
    user = getattr(settings, "BUZZ_DELIVERY", None) or {}
    return {**DEFAULTS, **user}


def get_settings() -> DeliverySettings:
    """Return the current :class:`DeliverySettings`."""
    raw = raw_settings()
    return DeliverySettings(
        lease_seconds=raw["LEASE_SECONDS"],
        min_lease_seconds=raw["MIN_LEASE_SECONDS"],
        max_lease_seconds=raw["MAX_LEASE_SECONDS"],
        max_attempts=raw["MAX_ATTEMPTS"],
        retry_backoff_base_seconds=raw["RETRY_BACKOFF_BASE_SECONDS"],
        retry_backoff_cap_seconds=raw["RETRY_BACKOFF_CAP_SECONDS"],
        notify_channel=raw["NOTIFY_CHANNEL"],
        batch_size=raw["BATCH_SIZE"],
        listen_database=raw["LISTEN_DATABASE"],
    )
