"""System checks of ``BUZZ_AGENTS`` (``manage.py check``), in the app's namespace:

- ``buzz_agents.E001``: an unknown key, or a setting that is not a dict;
- ``buzz_agents.E002``: a value of the wrong type;
- ``buzz_agents.E003``: a value out of its bounds;
- ``buzz_agents.E004``: ``RETRY_DELAY_SECONDS`` above ``RETRY_DELAY_MAX_SECONDS``, or
  ``MAX_CHUNK_BYTES`` above ``MAX_STREAM_BYTES``.

Registered by the app's ``ready()``. The policy keys take the bounds of a policy row
(``agent_policy``, :mod:`buzz_delivery.agents.services.policy`); the helpers are the core's
(:mod:`buzz_delivery.checks`)."""

from __future__ import annotations

from typing import Any

from django.core import checks

from buzz_delivery.agents.conf import DEFAULTS
from buzz_delivery.agents.services.policy import MAX_ATTEMPTS, MAX_TOOL_CALLS
from buzz_delivery.checks import int_setting, lease_setting, seconds_setting, user_settings

SETTING = "BUZZ_AGENTS"
APP = "buzz_agents"
# The reaper's backoff is computed in double precision and added to now(): a day is plenty.
MAX_RETRY_DELAY_SECONDS = 86400
# What a jsonb value can hold (255 MB): a larger output bound could never be reached.
MAX_JSON_BYTES = 255 * 1024 * 1024
# A run's streamed bytes are counted in a bigint; a chunk is one text value (at most 1 GB).
MAX_CHUNK_BYTES = 1024**3 - 1
MAX_STREAM_BYTES = 2**62


@checks.register(checks.Tags.compatibility)
def check_agent_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Reject ``BUZZ_AGENTS`` values the agent runs could not honour."""
    raw, errors = user_settings(SETTING, APP, DEFAULTS)
    errors += lease_setting(SETTING, raw, "LEASE_SECONDS", APP)
    errors += int_setting(SETTING, raw, "MAX_ATTEMPTS", APP, 1, MAX_ATTEMPTS)
    delays = seconds_setting(SETTING, raw, "RETRY_DELAY_SECONDS", APP, 0, MAX_RETRY_DELAY_SECONDS)
    delays += seconds_setting(SETTING, raw, "RETRY_DELAY_MAX_SECONDS", APP, 0, MAX_RETRY_DELAY_SECONDS)
    errors += delays
    if not delays and raw["RETRY_DELAY_SECONDS"] > raw["RETRY_DELAY_MAX_SECONDS"]:
        errors.append(
            checks.Error(
                f"{SETTING}['RETRY_DELAY_SECONDS'] must not exceed {SETTING}['RETRY_DELAY_MAX_SECONDS'].",
                id="buzz_agents.E004",
            )
        )
    errors += int_setting(SETTING, raw, "MAX_TOOL_CALLS", APP, 0, MAX_TOOL_CALLS)
    # A larger MAX_COST is taken as 2**53 - 1 (conf.MAX_COST_UNITS): only its type and sign matter.
    errors += int_setting(SETTING, raw, "MAX_COST", APP, 0, float("inf"))
    # No upper bound: the intake takes it as bigint (agents migration 0021), a run's deadline is capped.
    errors += int_setting(SETTING, raw, "MAX_TIMEOUT_SECONDS", APP, 1, float("inf"), optional=True)
    errors += lease_setting(SETTING, raw, "MAX_LEASE_SECONDS", APP, optional=True)
    if not isinstance(raw["SHADOW"], bool):
        errors.append(checks.Error(f"{SETTING}['SHADOW'] must be True or False.", id=f"{APP}.E002"))
    errors += int_setting(SETTING, raw, "MAX_OUTPUT_BYTES", APP, 1, MAX_JSON_BYTES)
    streams = int_setting(SETTING, raw, "MAX_CHUNK_BYTES", APP, 1, MAX_CHUNK_BYTES)
    streams += int_setting(SETTING, raw, "MAX_STREAM_BYTES", APP, 1, MAX_STREAM_BYTES)
    errors += streams
    if not streams and raw["MAX_CHUNK_BYTES"] > raw["MAX_STREAM_BYTES"]:
        errors.append(
            checks.Error(
                f"{SETTING}['MAX_CHUNK_BYTES'] must not exceed {SETTING}['MAX_STREAM_BYTES'].", id="buzz_agents.E004"
            )
        )
    return errors
