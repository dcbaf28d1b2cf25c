"""System checks (``manage.py check``) with stable ids ``buzz_delivery.E0xx``."""

from __future__ import annotations

import re
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from buzz_delivery.conf import DEFAULTS, raw_settings
from buzz_delivery.services.flow import AGENT_KINDS, AGENT_SETTING, STEP_KINDS, STEP_SETTING, parse_limits
from buzz_delivery.services.ratelimits import parse_rate_limits


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# Helpers for the settings dicts of the apps (BUZZ_WORKFLOWS, BUZZ_AGENTS): each returns the
# errors of one key, ids in the app's own namespace (``<app>.E001`` an unknown key or a setting
# that is not a dict, ``E002`` a value of the wrong type, ``E003`` a value out of its bounds).


def user_settings(setting: str, app: str, defaults: dict[str, Any]) -> tuple[dict[str, Any], list[checks.CheckMessage]]:
    """``settings.<setting>`` merged over ``defaults``, and the errors of its shape: not a dict,
    or keys the app does not know (each named, with the known ones in the hint)."""
    from django.conf import settings

    user = getattr(settings, setting, None) or {}
    if not isinstance(user, dict):
        error = checks.Error(f"{setting} must be a dict, not {type(user).__name__}.", id=f"{app}.E001")
        return dict(defaults), [error]
    errors: list[checks.CheckMessage] = [
        checks.Error(
            f"{setting} has an unknown key {key!r}.",
            hint=f"Known keys: {', '.join(sorted(defaults))}.",
            id=f"{app}.E001",
        )
        for key in user
        if key not in defaults
    ]
    return {**defaults, **user}, errors


def _number_error(
    setting: str, key: str, value: Any, app: str, low: float, high: float, *, integer: bool, unit: str
) -> checks.CheckMessage | None:
    name = f"{setting}[{key!r}]"
    kind = "an int" if integer else "a number"
    if not (isinstance(value, int) if integer else _is_number(value)) or isinstance(value, bool):
        return checks.Error(f"{name} must be {kind}{unit}, not {type(value).__name__}.", id=f"{app}.E002")
    if not low <= value <= high:  # NaN and the infinities fail this too
        return checks.Error(f"{name} must be within {low:g}..{high:g}{unit}, got {value!r}.", id=f"{app}.E003")
    return None


def int_setting(
    setting: str, raw: dict[str, Any], key: str, app: str, low: int, high: float, *, optional: bool = False
) -> list[checks.CheckMessage]:
    """``raw[key]`` is an int (not a bool) within ``low..high`` (or None when ``optional``)."""
    value = raw[key]
    if optional and value is None:
        return []
    error = _number_error(setting, key, value, app, low, high, integer=True, unit="")
    return [] if error is None else [error]


def seconds_setting(
    setting: str, raw: dict[str, Any], key: str, app: str, low: float, high: float, *, optional: bool = False
) -> list[checks.CheckMessage]:
    """``raw[key]`` is a number of seconds (int or float, not a bool) within ``low..high``."""
    value = raw[key]
    if optional and value is None:
        return []
    error = _number_error(setting, key, value, app, low, high, integer=False, unit=" (seconds)")
    return [] if error is None else [error]


def capped_setting(
    setting: str, raw: dict[str, Any], key: str, cap_key: str, app: str, consequence: str
) -> list[checks.CheckMessage]:
    """A warning (``<app>.W004``) when ``raw[key]`` exceeds ``raw[cap_key]``, two values already
    checked: the runtime takes the smaller, so the setting works but does not mean what it says
    (``consequence`` says what happens)."""
    if raw[key] <= raw[cap_key]:
        return []
    return [checks.Warning(f"{setting}[{key!r}] exceeds {setting}[{cap_key!r}]: {consequence}", id=f"{app}.W004")]


def lease_setting(
    setting: str, raw: dict[str, Any], key: str, app: str, *, optional: bool = False, above: bool = False
) -> list[checks.CheckMessage]:
    """``raw[key]`` is a lease length within the core's ``MIN_LEASE_SECONDS..MAX_LEASE_SECONDS``
    (what :func:`buzz_delivery.services.validation.lease_seconds` accepts); ``above``: any length
    from ``MIN_LEASE_SECONDS`` up (a cap on leases, which never binds above the core's own). When
    those bounds are themselves bad (``buzz_delivery.E002``), only the type is checked."""
    core = raw_settings()
    low, high = core["MIN_LEASE_SECONDS"], core["MAX_LEASE_SECONDS"]
    if not (_is_number(low) and _is_number(high)):
        low, high = float("-inf"), float("inf")
    if above:
        high = float("inf")
    errors = seconds_setting(setting, raw, key, app, low, high, optional=optional)
    for error in errors:
        if error.id == f"{app}.E003":
            error.hint = "BUZZ_DELIVERY['MIN_LEASE_SECONDS']..['MAX_LEASE_SECONDS'] bound every lease."
    return errors


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
    bad: set[str] = set()
    for key in (
        "LEASE_SECONDS",
        "MIN_LEASE_SECONDS",
        "MAX_LEASE_SECONDS",
        "RETRY_BACKOFF_BASE_SECONDS",
        "RETRY_BACKOFF_CAP_SECONDS",
    ):
        if not _is_number(raw[key]) or raw[key] <= 0:
            bad.add(key)
            errors.append(
                checks.Error(f"BUZZ_DELIVERY[{key!r}] must be a number > 0 (seconds).", id="buzz_delivery.E002")
            )
    # Each comparison needs only its own keys to be numbers: every other error is reported with it.
    lease_keys = {"LEASE_SECONDS", "MIN_LEASE_SECONDS", "MAX_LEASE_SECONDS"}
    if not bad & lease_keys and not raw["MIN_LEASE_SECONDS"] <= raw["LEASE_SECONDS"] <= raw["MAX_LEASE_SECONDS"]:
        errors.append(
            checks.Error(
                "BUZZ_DELIVERY['LEASE_SECONDS'] must lie within MIN_LEASE_SECONDS..MAX_LEASE_SECONDS.",
                id="buzz_delivery.E003",
            )
        )
    backoff_keys = {"RETRY_BACKOFF_BASE_SECONDS", "RETRY_BACKOFF_CAP_SECONDS"}
    if not bad & backoff_keys and raw["RETRY_BACKOFF_BASE_SECONDS"] > raw["RETRY_BACKOFF_CAP_SECONDS"]:
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
    try:
        parse_limits(raw["CONCURRENCY_LIMITS"])
    except ImproperlyConfigured as exc:
        errors.append(checks.Error(str(exc), id="buzz_delivery.E032"))
    for setting, kinds, code in (
        (AGENT_SETTING, AGENT_KINDS, "buzz_delivery.E034"),
        (STEP_SETTING, STEP_KINDS, "buzz_delivery.E035"),
    ):
        try:
            parse_limits(raw[setting], setting, kinds)
        except ImproperlyConfigured as exc:
            errors.append(checks.Error(str(exc), id=code))
    try:
        parse_rate_limits(raw["RATE_LIMITS"])
    except ImproperlyConfigured as exc:
        errors.append(checks.Error(str(exc), id="buzz_delivery.E033"))
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


@checks.register(checks.Tags.compatibility)
def check_tenant_isolation_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """The row-level security settings (SPEC section 13) have the right types."""
    raw = raw_settings()
    errors: list[checks.CheckMessage] = []
    for key in ("TENANT_ROLE", "MAINTENANCE_ROLE"):
        if not isinstance(raw[key], str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", raw[key]):
            errors.append(
                checks.Error(
                    f"BUZZ_DELIVERY[{key!r}] must be a role name (an SQL identifier).", id="buzz_delivery.E011"
                )
            )
    if not isinstance(raw["SWITCH_ROLES"], bool):
        errors.append(checks.Error("BUZZ_DELIVERY['SWITCH_ROLES'] must be True or False.", id="buzz_delivery.E012"))
    if not errors and raw["TENANT_ROLE"] == raw["MAINTENANCE_ROLE"]:
        errors.append(
            checks.Error(
                "BUZZ_DELIVERY['TENANT_ROLE'] and ['MAINTENANCE_ROLE'] must be two roles.", id="buzz_delivery.E013"
            )
        )
    return errors


@checks.register(checks.Tags.database)
def check_runtime_role_obeys_rls(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Warn when enforcement is on but the role the tenant code runs as would bypass it: a
    superuser, a BYPASSRLS role, or the tables' owner (with FORCE the owner obeys the policies,
    but may switch them off). A database check, as Django's own: ``manage.py check --database
    default`` and ``migrate`` run it. Skipped silently when the database cannot be reached."""
    from django.db import connection

    if not databases or "default" not in databases:
        return []
    return runtime_role_warnings(connection)


def runtime_role_warnings(connection: Any) -> list[checks.CheckMessage]:
    """``W020``/``W021``/``W022`` of :func:`check_runtime_role_obeys_rls` on ``connection``
    (``manage.py tenant_isolation enable`` and ``status`` print them too)."""
    from django.db import DatabaseError

    from buzz_delivery import isolation

    if check_tenant_isolation_settings() or connection.vendor != "postgresql":
        return []
    raw = raw_settings()
    try:
        with connection.cursor() as cursor:
            if not isolation.enforced(cursor):
                return []
            cursor.execute("SELECT current_user")
            runtime = raw["TENANT_ROLE"] if raw["SWITCH_ROLES"] else cursor.fetchone()[0]
            cursor.execute(
                "SELECT r.rolsuper, r.rolbypassrls, EXISTS (SELECT FROM pg_class c"
                " WHERE c.oid = to_regclass('buzz_delivery_delivery_record')"
                " AND pg_has_role(r.oid, c.relowner, 'USAGE')),"
                " coalesce((SELECT pg_has_role(r.oid, m.oid, 'USAGE') FROM pg_roles m WHERE m.rolname = %s), false)"
                " FROM pg_roles r WHERE r.rolname = %s",
                [raw["MAINTENANCE_ROLE"], runtime],
            )
            row = cursor.fetchone()
            cursor.execute(
                "SELECT has_function_privilege(r.oid, %s, 'EXECUTE') FROM pg_roles r WHERE r.rolname = %s",
                [isolation.ACTIVITY_FUNCTIONS[0], runtime],
            )
            reads_activity = bool((cursor.fetchone() or [False])[0])
            cursor.execute(
                "SELECT array_agg(n) FROM unnest(%s::text[]) n"
                " WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = n)"
                " OR NOT pg_has_role(current_user, n, 'MEMBER')",
                [[raw["TENANT_ROLE"], raw["MAINTENANCE_ROLE"]]],
            )
            unsettable = cursor.fetchone()[0] or [] if raw["SWITCH_ROLES"] else []
    except DatabaseError:
        return []
    if row is None:
        return [
            checks.Warning(
                f"Tenant isolation is on, but the role {runtime!r} does not exist.",
                hint="Run `manage.py tenant_isolation sql` as a DBA, or set BUZZ_DELIVERY['TENANT_ROLE'].",
                id="buzz_delivery.W020",
            )
        ]
    reasons = ("is a superuser", "has BYPASSRLS", "owns the tables", f"is a member of {raw['MAINTENANCE_ROLE']!r}")
    why = [w for w, on in zip(reasons, row, strict=True) if on]
    found: list[checks.CheckMessage] = []
    if unsettable:
        found.append(
            checks.Warning(
                f"SWITCH_ROLES is on, but the login may not SET ROLE to {', '.join(unsettable)}: "
                "the services will fail.",
                hint="GRANT those roles to the login (docs/tenant-isolation.md).",
                id="buzz_delivery.W021",
            )
        )
    if reads_activity and not row[0]:
        found.append(
            checks.Warning(
                f"Tenant isolation is on, but the tenant code's role {runtime!r} may read pg_stat_activity: "
                "every session of a shared tenant login sees the others' statements, values included.",
                hint="Run the pg_stat_activity statements of `manage.py tenant_isolation sql` as a superuser "
                "(docs/security.md).",
                id="buzz_delivery.W022",
            )
        )
    if not why:
        return found
    return [
        *found,
        checks.Warning(
            f"Tenant isolation is on, but the tenant code's role {runtime!r} {' and '.join(why)}: "
            "row-level security does not hold it.",
            hint="Set BUZZ_DELIVERY['SWITCH_ROLES'] = True, or log in as a plain member of "
            f"{raw['TENANT_ROLE']!r} (docs/tenant-isolation.md).",
            id="buzz_delivery.W020",
        ),
    ]


# A bearer token shorter than this is guessable; 32 random bytes as hex is 64 characters.
METRICS_TOKEN_MIN_CHARS = 24


@checks.register(checks.Tags.security)
def check_metrics_token(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``METRICS_TOKEN`` is None or a long printable string (buzz_delivery.metrics)."""
    token = raw_settings().get("METRICS_TOKEN")
    if token is None or (
        isinstance(token, str) and len(token) >= METRICS_TOKEN_MIN_CHARS and token.isprintable() and token.isascii()
    ):
        return []
    return [
        checks.Error(
            f"BUZZ_DELIVERY['METRICS_TOKEN'] must be None or a printable ASCII string of at least "
            f"{METRICS_TOKEN_MIN_CHARS} characters (e.g. secrets.token_hex(32)).",
            id="buzz_delivery.E030",
        )
    ]


@checks.register(checks.Tags.security, deploy=True)
def check_metrics_protected(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``check --deploy``: say that ``/metrics`` is open while ``METRICS_TOKEN`` is unset."""
    if raw_settings().get("METRICS_TOKEN"):
        return []
    return [
        checks.Warning(
            "The metrics view (buzz_delivery.metrics.metrics_view) answers anyone: set "
            "BUZZ_DELIVERY['METRICS_TOKEN'] and give your scraper the token, or keep the URL off the "
            "public network (your proxy's access rules).",
            id="buzz_delivery.W030",
        )
    ]
