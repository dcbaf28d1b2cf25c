"""Rate limits by key (issue 32, docs/flow-control.md): at most ``limit`` units per ``period``
seconds per key in one community, held in PostgreSQL across any number of processes and machines.

The operator declares the keys in the server settings (never anything a caller or a stored row
says), ``BUZZ_DELIVERY["RATE_LIMITS"]``: a dict of key name to ``{"limit": R, "period": P}``, for
example ``{"openai": {"limit": 500, "period": 60}}`` (500 requests a minute) or, weighted,
``{"openai-tokens": {"limit": 90_000, "period": 60}}`` (tokens a minute, each call taking its
weight). A key that is not declared is refused by name before any SQL.

**Algorithm: a fixed window on the database clock.** Each (community, key) has one row of
``buzz_delivery_rate_limit`` holding the start of its current window (the database clock's
``buzz_delivery_now()`` rounded down to a multiple of the period since the epoch) and the units
``used`` in it. :func:`take` is ONE statement (``INSERT ... ON CONFLICT (community_id, key) DO
UPDATE``): a statement whose window is newer than the row's starts the window again with its
weight; otherwise it adds its weight if ``used + weight <= limit`` and leaves the row's units
alone if not. The row lock of the upsert orders concurrent takes, so the units granted in one
window never exceed the limit. It returns :class:`Granted` or :class:`Wait` (seconds until the
window ends, by the database clock).

**Tolerance.** Within every window (aligned on the period) at most ``limit`` units are granted.
Over an arbitrary stretch of ``period`` seconds that straddles a window's end up to
``2 * limit`` may be granted (the end of one window and the start of the next): a fixed window's
burst at its edge. Units charged after a call (a weight computed from the call's result,
:func:`charge`) are added whatever the limit, so a window may end over its limit by what was
charged; the next take of that window then waits for the next window.

Rows are per community (the distribution key, SPEC 15): a key's limit holds for each community
separately, not across communities.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured, ValidationError

from buzz_delivery.conf import raw_settings
from buzz_delivery.models import new_uuid7
from buzz_delivery.services.db import fetch_all
from buzz_delivery.services.tenancy import tenant_scoped

SETTING = "RATE_LIMITS"
KEY_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"  # the table's CHECK (rate_limit_key_format)
MAX_LIMIT = 10**12  # units per period
MIN_PERIOD_SECONDS = 0.1
MAX_PERIOD_SECONDS = 86_400 * 31
# A charge adds its units whatever the limit: the take statement run with this as its limit.
_NO_LIMIT = 2**62


@dataclass(frozen=True, slots=True)
class RateLimitSpec:
    """One declared key: at most ``limit`` units per ``period`` seconds (per community)."""

    key: str
    limit: int
    period: float


@dataclass(frozen=True, slots=True)
class Granted:
    """The units were taken: ``used`` is the window's total after the take, ``at`` the
    database clock of the take statement."""

    used: int
    window_start: dt.datetime
    at: dt.datetime


@dataclass(frozen=True, slots=True)
class Wait:
    """Not now: the window has ``used`` units and ends in ``seconds`` (database clock); take
    again after that."""

    seconds: float
    used: int
    window_start: dt.datetime


TakeOutcome = Granted | Wait


def parse_rate_limits(value: Any) -> dict[str, RateLimitSpec]:
    """The declared keys, validated: raises ``ImproperlyConfigured`` naming the field (e.g.
    ``BUZZ_DELIVERY['RATE_LIMITS']['openai']['period']``). ``None`` or ``{}``: none."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ImproperlyConfigured(
            f"BUZZ_DELIVERY[{SETTING!r}] must be a dict of key name to {{'limit': int, 'period': seconds}}"
        )
    specs: dict[str, RateLimitSpec] = {}
    for key, spec in value.items():
        field = f"BUZZ_DELIVERY[{SETTING!r}][{key!r}]"
        if not isinstance(key, str) or not re.fullmatch(KEY_PATTERN, key):
            raise ImproperlyConfigured(f"{field}: a key name is 1..64 characters of A-Z a-z 0-9 _ . : -")
        if not isinstance(spec, Mapping):
            raise ImproperlyConfigured(f"{field} must be a dict {{'limit': int, 'period': seconds}}, got {spec!r}")
        unknown = sorted(str(k) for k in spec if k not in ("limit", "period"))
        if unknown:
            raise ImproperlyConfigured(f"{field}[{unknown[0]!r}]: unknown field; known: 'limit', 'period'")
        limit, period = spec.get("limit"), spec.get("period")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise ImproperlyConfigured(f"{field}['limit'] must be an int within 1..{MAX_LIMIT}, got {limit!r}")
        if (
            isinstance(period, bool)
            or not isinstance(period, int | float)
            or not MIN_PERIOD_SECONDS <= period <= MAX_PERIOD_SECONDS
        ):
            raise ImproperlyConfigured(
                f"{field}['period'] must be a number of seconds within {MIN_PERIOD_SECONDS}..{MAX_PERIOD_SECONDS}, "
                f"got {period!r}"
            )
        specs[key] = RateLimitSpec(key=key, limit=int(limit), period=float(period))
    return dict(sorted(specs.items()))


def declared_rate_limits() -> dict[str, RateLimitSpec]:
    """The operator's keys from the settings (read per call, like every setting)."""
    return parse_rate_limits(raw_settings().get(SETTING))


def rate_limit_of(rate_key: Any) -> RateLimitSpec:
    """The declared limit of ``rate_key``; a key that is not declared (or not a string) is a
    ``ValidationError`` keyed ``rate_key`` that names it (nothing is written). Bad settings raise
    ``ImproperlyConfigured`` naming the field."""
    declared = declared_rate_limits()
    if not isinstance(rate_key, str) or rate_key not in declared:
        known = ", ".join(declared) or "none"
        message = f"{rate_key!r} is not a rate limit key declared in BUZZ_DELIVERY['RATE_LIMITS'] (declared: {known})"
        raise ValidationError({"rate_key": message})
    return declared[rate_key]


def check_weight(weight: Any, spec: RateLimitSpec, *, field: str = "weight") -> int:
    """``weight`` as units to take under ``spec``: an int in ``0..limit`` (more could never be
    granted), else a ``ValidationError`` keyed ``field``."""
    if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= spec.limit:
        raise ValidationError(
            {field: f"must be an int within 0..{spec.limit} (the limit of {spec.key!r}), got {weight!r}"}
        )
    return weight


# The one take statement. The window of the statement is computed in VALUES (the database clock,
# once per statement); the CASEs compare columns only (SPEC 15: no clock inside a CASE). A row
# whose window is older than the statement's starts again; an older statement (one that read
# the clock before a concurrent take moved the window on) counts in the row's newer window.
TAKE = """
INSERT INTO buzz_delivery_rate_limit AS r (id, community_id, key, window_start, used, granted, taken_at)
VALUES (
    %(id)s, %(community_id)s, %(key)s,
    to_timestamp(floor(extract(epoch FROM buzz_delivery_now()) / %(period)s) * %(period)s),
    %(weight)s, true, buzz_delivery_now()
)
ON CONFLICT (community_id, key) DO UPDATE SET
    used = CASE
        WHEN r.window_start < EXCLUDED.window_start THEN EXCLUDED.used
        WHEN r.used + EXCLUDED.used <= %(limit)s THEN r.used + EXCLUDED.used
        ELSE r.used END,
    granted = (r.window_start < EXCLUDED.window_start OR r.used + EXCLUDED.used <= %(limit)s),
    window_start = GREATEST(r.window_start, EXCLUDED.window_start),
    taken_at = EXCLUDED.taken_at
RETURNING r.granted, r.used, r.window_start, r.taken_at
"""


@tenant_scoped
def take(community_id: uuid.UUID | str, rate_key: str, weight: int = 1) -> TakeOutcome:
    """Take ``weight`` units of ``rate_key`` in ``community_id`` if the current window has room
    (one statement, the database clock): :class:`Granted`, or :class:`Wait` with the seconds
    until the window ends. ``weight`` 0 asks only whether the window is not over its limit
    (after a :func:`charge`). Bad input (an undeclared key, a weight outside ``0..limit``, a
    community that is not a UUID) raises ``ValidationError`` naming the field before any SQL."""
    spec = rate_limit_of(rate_key)
    check_weight(weight, spec)
    return _run(_community(community_id), spec, weight, spec.limit)


@tenant_scoped
def charge(community_id: uuid.UUID | str, rate_key: str, weight: int) -> Granted:
    """Add ``weight`` units (already spent: a weight known after the call) to the current window
    of ``rate_key``, whatever its limit (the same statement as :func:`take`). The window may end
    over its limit; later takes then wait for the next window."""
    spec = rate_limit_of(rate_key)
    if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= MAX_LIMIT:
        raise ValidationError({"weight": f"must be an int within 0..{MAX_LIMIT}, got {weight!r}"})
    outcome = _run(_community(community_id), spec, weight, _NO_LIMIT)
    assert isinstance(outcome, Granted)
    return outcome


# Units taken and not used (a claim that found fewer deliveries than it took units for), given
# back to the window they were taken in and to no later one: a window never grants more than its
# limit, whoever takes the units given back.
GIVE_BACK = """
UPDATE buzz_delivery_rate_limit AS r SET used = GREATEST(r.used - %(units)s, 0)
WHERE r.community_id = %(community_id)s AND r.key = %(key)s AND r.window_start = %(window_start)s
RETURNING r.used
"""


@tenant_scoped
def give_back(community_id: uuid.UUID | str, rate_key: str, units: int, window_start: dt.datetime) -> bool:
    """Give ``units`` taken in the window that started at ``window_start`` (a :class:`Granted`'s)
    back to it, if it is still the current window (one statement). True when given back; False
    once the window moved on (its units no longer matter)."""
    spec = rate_limit_of(rate_key)
    check_weight(units, spec, field="units")
    params = {"community_id": _community(community_id), "key": spec.key, "units": units, "window_start": window_start}
    return bool(fetch_all(GIVE_BACK, params))


def _community(community_id: Any) -> uuid.UUID:
    try:
        return community_id if isinstance(community_id, uuid.UUID) else uuid.UUID(str(community_id))
    except ValueError:
        raise ValidationError({"community_id": f"must be a UUID, got {community_id!r}"}) from None


def _run(community: uuid.UUID, spec: RateLimitSpec, weight: int, limit: int) -> TakeOutcome:
    params = {
        "id": new_uuid7(),
        "community_id": community,
        "key": spec.key,
        "period": spec.period,
        "weight": weight,
        "limit": limit,
    }
    granted, used, window_start, taken_at = fetch_all(TAKE, params)[0]
    if granted:
        return Granted(used=used, window_start=window_start, at=taken_at)
    return Wait(seconds=seconds_left(spec, window_start, taken_at), used=used, window_start=window_start)


def seconds_left(spec: RateLimitSpec, window_start: dt.datetime, at: dt.datetime) -> float:
    """Seconds until the window that began at ``window_start`` ends, seen from ``at`` (a take
    statement's clock), within ``0..period``. The row's window began by the clock of the
    statement that moved it, at or before now: it ends within a period. The statement's clock
    may read earlier (read before it waited on the row's lock, or on a shard behind another), so
    what it computes is capped at a period (every caller: a Wait's seconds, a worker's pause on a
    window exactly used up). The window ends at the first multiple of the period (since the
    epoch) after its start, where a statement's window (:data:`TAKE`) is next newer: that is its
    start plus the period when aligned, and sooner when the row's window is aligned on a period
    the operator has since changed (60 s raised to an hour: the row's minute ends at the hour)."""
    start = window_start.timestamp()
    # The window's own multiple of the period, then the next one. A millisecond's tolerance: the
    # start is that multiple rounded to the microsecond, and a float quotient of an epoch by 0.1
    # errs by about 1e-6 (a start read a hair low would end the window at its start: no wait).
    boundary = (math.floor((start + 1e-3) / spec.period) + 1) * spec.period
    left = min(start + spec.period, boundary) - at.timestamp()
    return min(max(left, 0.0), float(spec.period))


@dataclass(frozen=True, slots=True)
class RateUse:
    """What one (community, key) has used in its current window (0 once the window ended)."""

    community_id: uuid.UUID
    key: str
    limit: int
    period: float
    used: int
    window_start: dt.datetime | None


USE = """
SELECT r.community_id, r.key, r.window_start, r.used, buzz_delivery_now()
FROM buzz_delivery_rate_limit AS r
WHERE r.key = ANY (%(keys)s)
ORDER BY r.key, r.community_id
LIMIT %(limit)s
"""


def current_use(*, limit: int = 1000) -> list[RateUse]:
    """Each declared key's use in its current window, per community (the operator's view: the
    admin page and /metrics; a fleet read, at most ``limit`` rows). Keys no longer declared are
    left out."""
    from buzz_delivery.services.tenancy import fleet

    declared = declared_rate_limits()
    if not declared:
        return []
    with fleet():
        rows = fetch_all(USE, {"keys": list(declared), "limit": limit})
    found = []
    for community, key, window_start, used, now in rows:
        spec = declared[key]
        current = window_start + dt.timedelta(seconds=spec.period) > now
        found.append(
            RateUse(
                community_id=community,
                key=key,
                limit=spec.limit,
                period=spec.period,
                used=used if current else 0,
                window_start=window_start if current else None,
            )
        )
    return found
