"""System checks of ``BUZZ_AGENTS`` (``manage.py check``), in the app's namespace:

- ``buzz_agents.E001``: an unknown key, or a setting that is not a dict;
- ``buzz_agents.E002``: a value of the wrong type;
- ``buzz_agents.E003``: a value out of its bounds;
- ``buzz_agents.W004``: ``RETRY_DELAY_SECONDS`` above ``RETRY_DELAY_MAX_SECONDS`` (every
  backoff is the cap), or ``MAX_CHUNK_BYTES`` above ``MAX_STREAM_BYTES`` (a chunk is bounded by
  the stream's bound too).

Registered by the app's ``ready()``. Errors are for values the runs cannot honour: the policy
keys are the last layer of a run's caps (``policy.settings_policy``, the intake's ``p_default_*``)
and take the bounds of the columns they reach, not the stricter ones of a policy row (a setting
that ran before must not stop ``check`` and the workers now). The helpers are the core's
(:mod:`buzz_delivery.checks`)."""

from __future__ import annotations

from typing import Any

from django.core import checks

from buzz_delivery.agents.conf import DEFAULTS
from buzz_delivery.checks import capped_setting, int_setting, lease_setting, seconds_setting, user_settings

SETTING = "BUZZ_AGENTS"
APP = "buzz_agents"
# Lengths added to now() (the reaper's backoff, a run's deadline): any a timestamp can add, a
# century (now() + make_interval(secs => 10**13) is out of the timestamp's range).
MAX_SECONDS = 100 * 366 * 86400
# PostgreSQL's integer: the run's max_attempts and max_tool_calls, the intake's parameters.
MAX_INTEGER = 2**31 - 1
# A run's streamed bytes are counted in a bigint.
MAX_STREAM_BYTES = 2**62


@checks.register(checks.Tags.compatibility)
def check_agent_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Reject ``BUZZ_AGENTS`` values the agent runs could not honour."""
    raw, errors = user_settings(SETTING, APP, DEFAULTS)
    errors += lease_setting(SETTING, raw, "LEASE_SECONDS", APP)
    errors += int_setting(SETTING, raw, "MAX_ATTEMPTS", APP, 1, MAX_INTEGER)
    delays = seconds_setting(SETTING, raw, "RETRY_DELAY_SECONDS", APP, 0, MAX_SECONDS)
    delays += seconds_setting(SETTING, raw, "RETRY_DELAY_MAX_SECONDS", APP, 0, MAX_SECONDS)
    errors += delays
    if not delays:
        errors += capped_setting(
            SETTING, raw, "RETRY_DELAY_SECONDS", "RETRY_DELAY_MAX_SECONDS", APP, "every backoff is the cap."
        )
    errors += int_setting(SETTING, raw, "MAX_TOOL_CALLS", APP, 0, MAX_INTEGER)
    # A larger MAX_COST is taken as 2**53 - 1 (conf.MAX_COST_UNITS): only its type and sign matter.
    errors += int_setting(SETTING, raw, "MAX_COST", APP, 0, float("inf"))
    # Added to now() for a run's deadline (agents migration 0021): a century at most.
    errors += int_setting(SETTING, raw, "MAX_TIMEOUT_SECONDS", APP, 1, MAX_SECONDS, optional=True)
    # A cap on the lease a claim asks for (least(lease, cap)), itself within the core's bounds: a
    # cap above MAX_LEASE_SECONDS never binds, one below MIN_LEASE_SECONDS would.
    errors += lease_setting(SETTING, raw, "MAX_LEASE_SECONDS", APP, optional=True, above=True)
    if not isinstance(raw["SHADOW"], bool):
        errors.append(checks.Error(f"{SETTING}['SHADOW'] must be True or False.", id=f"{APP}.E002"))
    # Compared in Python with a value's size: a larger bound is never reached, and does no harm.
    errors += int_setting(SETTING, raw, "MAX_OUTPUT_BYTES", APP, 1, float("inf"))
    streams = int_setting(SETTING, raw, "MAX_CHUNK_BYTES", APP, 1, float("inf"))
    streams += int_setting(SETTING, raw, "MAX_STREAM_BYTES", APP, 1, MAX_STREAM_BYTES)
    errors += streams
    if not streams:
        errors += capped_setting(
            SETTING, raw, "MAX_CHUNK_BYTES", "MAX_STREAM_BYTES", APP, "a chunk is bounded by the stream's bound too."
        )
    return errors
