"""System checks of ``BUZZ_WORKFLOWS`` (``manage.py check``), in the app's namespace:

- ``buzz_workflows.E001``: an unknown key, or a setting that is not a dict;
- ``buzz_workflows.E002``: a value of the wrong type;
- ``buzz_workflows.E003``: a value out of its bounds;
- ``buzz_workflows.W004``: ``BACKOFF_BASE_SECONDS`` above ``BACKOFF_CAP_SECONDS`` (every
  backoff is then the cap);
- ``buzz_workflows.W005``: ``MAX_DEPTH`` or ``MAX_MAP_ITEMS`` above what the engine takes (it
  takes its own bound: 8, 10,000).

Errors are for values the engine cannot honour; a value it clamps or caps itself, as it always
did, is a warning (a configuration that ran before still starts).

Registered by the app's ``ready()``; the bounds are the ones the engine's services enforce. The
helpers are the core's (:mod:`buzz_delivery.checks`)."""

from __future__ import annotations

import re
from typing import Any

from django.core import checks

from buzz_delivery.checks import capped_setting, int_setting, lease_setting, seconds_setting, user_settings
from buzz_delivery.workflows.conf import DEFAULTS
from buzz_delivery.workflows.definition import FUNCTION_NAME, MAP_ITEMS_LIMIT
from buzz_delivery.workflows.models import MAX_DEPTH

SETTING = "BUZZ_WORKFLOWS"
APP = "buzz_workflows"
# PostgreSQL's integer (the event's kind column, a step's max_attempts).
MAX_INTEGER = 2**31 - 1
MAX_MESSAGE_KIND = MAX_INTEGER
# How long an event may be kept for later waits: any length a timestamp can add (a century),
# not a wait's own bound (a wait may start long after the event was sent).
MAX_EVENT_RETENTION_SECONDS = 100 * 366 * 86400
# The shortest retention that keeps send_event's promise to a wait that starts while the send is
# in flight (the wait sees the event, or the send sees the waiting step, never neither). The send
# keeps its event for the retention from its last statement, and the wait judges it live against
# its own first statement (services/waits.py): what the retention must still cover is a send's
# commit (its last statement to its commit: the WAL flush, a synchronous standby's answer) and
# the difference between the clocks of the nodes that stamp the two statements. A minute is many
# times both. 0 (keep no event) let an event sent while a wait was starting be taken by neither.
MIN_EVENT_RETENTION_SECONDS = 60


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
    # Larger than a jsonb value can hold is never reached: no upper bound (it never had one).
    errors += int_setting(SETTING, raw, "MAX_OUTPUT_BYTES", APP, 1, float("inf"))
    # The default of a step's max_attempts column (an integer): a definition's own "retry" is
    # bounded by MAX_RETRY_ATTEMPTS, the settings' default never was.
    errors += int_setting(SETTING, raw, "MAX_ATTEMPTS", APP, 1, MAX_INTEGER)
    # A backoff is added to a timestamp (steps.retry_delay): any length it can add, as retention.
    backoff = seconds_setting(SETTING, raw, "BACKOFF_BASE_SECONDS", APP, 0, MAX_EVENT_RETENTION_SECONDS)
    backoff += seconds_setting(SETTING, raw, "BACKOFF_CAP_SECONDS", APP, 0, MAX_EVENT_RETENTION_SECONDS)
    errors += backoff
    if not backoff:
        errors += capped_setting(
            SETTING, raw, "BACKOFF_BASE_SECONDS", "BACKOFF_CAP_SECONDS", APP, "every backoff is the cap."
        )
    errors += _clamped("MAX_DEPTH", raw, 0, MAX_DEPTH)
    pubkey = raw["AUTHOR_PUBKEY"]
    if not isinstance(pubkey, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", pubkey):
        errors.append(
            checks.Error(
                f"{SETTING}['AUTHOR_PUBKEY'] must be 64 hex characters (32 bytes), got {pubkey!r}.",
                id=f"{APP}.E002",
            )
        )
    errors += int_setting(SETTING, raw, "MESSAGE_KIND", APP, 0, MAX_MESSAGE_KIND)
    retention = seconds_setting(SETTING, raw, "EVENT_RETENTION_SECONDS", APP, 0, MAX_EVENT_RETENTION_SECONDS)
    errors += retention
    if not retention and raw["EVENT_RETENTION_SECONDS"] < MIN_EVENT_RETENTION_SECONDS:
        errors.append(
            checks.Error(
                f"{SETTING}['EVENT_RETENTION_SECONDS'] must be at least {MIN_EVENT_RETENTION_SECONDS} (seconds),"
                f" got {raw['EVENT_RETENTION_SECONDS']!r}: shorter, an event sent while a wait_event step is"
                " starting could be taken by neither the send nor the wait.",
                id=f"{APP}.E003",
            )
        )
    errors += _clamped("MAX_MAP_ITEMS", raw, 1, MAP_ITEMS_LIMIT)
    return errors


def _clamped(key: str, raw: dict[str, Any], low: int, taken: int) -> list[checks.CheckMessage]:
    """An int of at least ``low``; above ``taken`` a warning: the engine takes ``taken`` (conf.py)."""
    errors = int_setting(SETTING, raw, key, APP, low, float("inf"))
    if not errors and raw[key] > taken:
        errors.append(
            checks.Warning(f"{SETTING}[{key!r}] is {raw[key]!r}: the engine takes {taken}.", id=f"{APP}.W005")
        )
    return errors
