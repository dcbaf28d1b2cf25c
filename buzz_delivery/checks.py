"""System checks (``manage.py check``) with stable ids ``buzz_delivery.E0xx``."""

from __future__ import annotations

import re
from typing import Any

from django.core import checks
from django.db import connections

from buzz_delivery.conf import DEFAULTS, raw_settings


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@checks.register(checks.Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Reject ``BUZZ_DELIVERY`` values the services could not honour."""
    errors: list[checks.CheckMessage] = []
    raw = raw_settings()
    for key in raw:
        if key not in DEFAULTS:
            errors.append(
                checks.Error(
                    f"BUZZ_DELIVERY has an unknown key {key!r}.",
                    hint=f"Known keys: {', '.join(sorted(DEFAULTS))}.",
                    id="buzz_delivery.E001",
                )
            )
    for key in (
        "LEASE_SECONDS",
        "MIN_LEASE_SECONDS",
        "MAX_LEASE_SECONDS",
        "RETRY_BACKOFF_BASE_SECONDS",
        "RETRY_BACKOFF_CAP_SECONDS",
    ):
        if not _is_number(raw[key]) or raw[key] <= 0:
            errors.append(
                checks.Error(f"BUZZ_DELIVERY[{key!r}] must be a number > 0 (seconds).", id="buzz_delivery.E002")
            )
    if not errors:
        if not raw["MIN_LEASE_SECONDS"] <= raw["LEASE_SECONDS"] <= raw["MAX_LEASE_SECONDS"]:
            errors.append(
                checks.Error(
                    "BUZZ_DELIVERY['LEASE_SECONDS'] must lie within MIN_LEASE_SECONDS..MAX_LEASE_SECONDS.",
                    id="buzz_delivery.E003",
                )
            )
        if raw["RETRY_BACKOFF_BASE_SECONDS"] > raw["RETRY_BACKOFF_CAP_SECONDS"]:
            errors.append(
                checks.Error(
                    "BUZZ_DELIVERY['RETRY_BACKOFF_BASE_SECONDS'] must not exceed RETRY_BACKOFF_CAP_SECONDS.",
                    id="buzz_delivery.E004",
                )
            )
    max_attempts = raw["MAX_ATTEMPTS"]
    if max_attempts is not None and (
        not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1
    ):
        errors.append(
            checks.Error("BUZZ_DELIVERY['MAX_ATTEMPTS'] must be an int >= 1 or None.", id="buzz_delivery.E005")
        )
    channel = raw["NOTIFY_CHANNEL"]
    if not isinstance(channel, str) or not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", channel):
        errors.append(
            checks.Error(
                "BUZZ_DELIVERY['NOTIFY_CHANNEL'] must be a lowercase SQL identifier of at most 63 characters.",
                id="buzz_delivery.E006",
            )
        )
    batch = raw["BATCH_SIZE"]
    if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= 100_000:
        errors.append(checks.Error("BUZZ_DELIVERY['BATCH_SIZE'] must be an int in 1..100000.", id="buzz_delivery.E007"))
    listen = raw["LISTEN_DATABASE"]
    if listen is not None and (not isinstance(listen, str) or listen not in connections.databases):
        errors.append(
            checks.Error(
                f"BUZZ_DELIVERY['LISTEN_DATABASE'] must be None or an alias of DATABASES, got {listen!r}.",
                hint=f"Aliases: {', '.join(connections.databases)}.",
                id="buzz_delivery.E008",
            )
        )
    return errors


@checks.register(checks.Tags.compatibility)
def check_database_is_postgresql(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Every feature depends on PostgreSQL: refuse any other backend (no connection is opened)."""
    errors: list[checks.CheckMessage] = []
    for alias in connections.databases:
        vendor = connections[alias].vendor
        if vendor != "postgresql":
            errors.append(
                checks.Error(
                    f"buzz_delivery needs PostgreSQL, but database {alias!r} is {vendor!r}.",
                    hint=f"Set settings.DATABASES[{alias!r}]['ENGINE'] to 'django.db.backends.postgresql' "
                    "and point it at a PostgreSQL server.",
                    id="buzz_delivery.E010",
                )
            )
    return errors
