"""System checks of ``BUZZ_WORKFLOWS`` (``manage.py check``), in the app's namespace:

- ``buzz_workflows.E001``: an unknown key, or a setting that is not a dict;
- ``buzz_workflows.E002``: a value of the wrong type;
- ``buzz_workflows.E003``: a value out of its bounds;
- ``buzz_workflows.E004``: ``BACKOFF_BASE_SECONDS`` above ``BACKOFF_CAP_SECONDS``.

Registered by the app's ``ready()``; the bounds are the ones the engine's services enforce. The
helpers are the core's (:mod:`buzz_delivery.checks`)."""

from __future__ import annotations

import re
from typing import Any

from django.core import checks

from buzz_delivery.checks import int_setting, lease_setting, seconds_setting, user_settings
from buzz_delivery.workflows.conf import DEFAULTS
from buzz_delivery.workflows.definition import (
    FUNCTION_NAME,
    MAP_ITEMS_LIMIT,
    MAX_BACKOFF_SECONDS,
    MAX_RETRY_ATTEMPTS,
)
from buzz_delivery.workflows.models import MAX_DEPTH

SETTING = "BUZZ_WORKFLOWS"
APP = "buzz_workflows"
# PostgreSQL's integer (the event's kind column).
MAX_MESSAGE_KIND = 2**31 - 1
# What a jsonb value can hold (255 MB): a larger output bound could never be reached.
MAX_JSON_BYTES = 255 * 1024 * 1024
# How long an event may be kept for later waits: any length a timestamp can add (a century),
# not a wait's own bound (a wait may start long after the event was sent).
MAX_EVENT_RETENTION_SECONDS = 100 * 366 * 86400


def _type_error(key: str, expected: str, value: Any) -> checks.CheckMessage:
    return checks.Error(f"{SETTING}[{key!r}] must be {expected}, not {type(value).__name__}.", id=f"{APP}.E002")


@checks.register(checks.Tags.compatibility)
def check_workflow_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Reject ``BUZZ_WORKFLOWS`` values the engine could not honour."""
    raw, errors = user_settings(SETTING, APP, DEFAULTS)
    errors += lease_setting(SETTING, raw, "LEASE_SECONDS", APP)
    functions = raw["FUNCTIONS"]
    if not isinstance(functions, dict):
        errors.append(_type_error("FUNCTIONS", 'a dict {"name": "package.module:callable"}', functions))
    else:
        for name, path in functions.items():
            if not isinstance(name, str) or not FUNCTION_NAME.match(name):
                errors.append(
                    checks.Error(
                        f"{SETTING}['FUNCTIONS'] has a name no definition can use: {name!r}.",
                        hint=f"A function step's name matches {FUNCTION_NAME.pattern}.",
                        id=f"{APP}.E002",
                    )
                )
            if not isinstance(path, str) or not re.fullmatch(r"\w+(\.\w+)*:\w+", path):
                errors.append(
                    checks.Error(
                        f"{SETTING}['FUNCTIONS'][{name!r}] must be a str 'package.module:callable', got {path!r}.",
                        id=f"{APP}.E002",
                    )
                )
    modules = raw["MODULES"]
    if not isinstance(modules, list | tuple) or not all(isinstance(m, str) for m in modules):
        errors.append(_type_error("MODULES", "a list of module names (str)", modules))
    errors += int_setting(SETTING, raw, "MAX_OUTPUT_BYTES", APP, 1, MAX_JSON_BYTES)
    errors += int_setting(SETTING, raw, "MAX_ATTEMPTS", APP, 1, MAX_RETRY_ATTEMPTS)
    backoff = seconds_setting(SETTING, raw, "BACKOFF_BASE_SECONDS", APP, 0, MAX_BACKOFF_SECONDS)
    backoff += seconds_setting(SETTING, raw, "BACKOFF_CAP_SECONDS", APP, 0, MAX_BACKOFF_SECONDS)
    errors += backoff
    if not backoff and raw["BACKOFF_BASE_SECONDS"] > raw["BACKOFF_CAP_SECONDS"]:
        errors.append(
            checks.Error(
                f"{SETTING}['BACKOFF_BASE_SECONDS'] must not exceed {SETTING}['BACKOFF_CAP_SECONDS'].",
                id="buzz_workflows.E004",
            )
        )
    errors += int_setting(SETTING, raw, "MAX_DEPTH", APP, 0, MAX_DEPTH)
    pubkey = raw["AUTHOR_PUBKEY"]
    if not isinstance(pubkey, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", pubkey):
        errors.append(
            checks.Error(
                f"{SETTING}['AUTHOR_PUBKEY'] must be 64 hex characters (32 bytes), got {pubkey!r}.",
                id=f"{APP}.E002",
            )
        )
    errors += int_setting(SETTING, raw, "MESSAGE_KIND", APP, 0, MAX_MESSAGE_KIND)
    errors += seconds_setting(SETTING, raw, "EVENT_RETENTION_SECONDS", APP, 0, MAX_EVENT_RETENTION_SECONDS)
    errors += int_setting(SETTING, raw, "MAX_MAP_ITEMS", APP, 1, MAP_ITEMS_LIMIT)
    return errors
