"""The operator's policy for agent runs (issue 27, SPEC 16 "Trust"): budgets, attempts, deadline,
lease length and shadow mode are the operator's; a caller may ask for less, never for more.

Layers, most specific first: the agent key's row in its community, the community's row
(``agent_pubkey`` NULL), the ``BUZZ_AGENTS`` settings. A field left NULL in a row inherits from
the next layer. :func:`policy_of` reads both rows in one statement; :func:`bounded` turns what a
caller asked for into what the run gets (never above the policy; a policy with ``shadow``
forces it). ``accept_delivery`` applies it in its transaction, and ``intake_event`` in the one
statement that creates the run (the same layers and bounds in SQL, agents migration 0021); the
run keeps its lease cap, so its claims and heartbeats cannot ask for longer leases either.
:func:`set_policy` and :func:`clear_policy` are the only writers.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from buzz_delivery.agents.conf import MAX_COST_UNITS, get_settings
from buzz_delivery.conf import get_settings as core_settings
from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.models import new_uuid7
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, translated_errors
from buzz_delivery.services.tenancy import tenant_scoped

MAX_TOOL_CALLS = 100_000
MAX_ATTEMPTS = 100
MAX_TIMEOUT_SECONDS = 30 * 86400
FIELDS = ("max_tool_calls", "max_cost", "max_attempts", "max_timeout_seconds", "max_lease_seconds", "shadow")

POLICY_ROWS = """
SELECT p.agent_pubkey IS NOT NULL, p.max_tool_calls, p.max_cost, p.max_attempts, p.max_timeout_seconds,
       p.max_lease_seconds, p.shadow
FROM buzz_agents_policy AS p
WHERE p.community_id = %(community_id)s AND (p.agent_pubkey IS NULL OR p.agent_pubkey = %(agent_pubkey)s)
"""
COMMUNITY_STATE = "SELECT deletion_state FROM buzz_delivery_community WHERE id = %(community_id)s"
UPSERT_POLICY = """
INSERT INTO buzz_agents_policy (id, community_id, agent_pubkey, max_tool_calls, max_cost, max_attempts,
                                max_timeout_seconds, max_lease_seconds, shadow, updated_at, updated_by)
VALUES (%(id)s, %(community_id)s, %(agent_pubkey)s, %(max_tool_calls)s, %(max_cost)s, %(max_attempts)s,
        %(max_timeout_seconds)s, %(max_lease_seconds)s, %(shadow)s, buzz_delivery_now(), %(updated_by)s)
ON CONFLICT (community_id, agent_pubkey) DO UPDATE
SET max_tool_calls = EXCLUDED.max_tool_calls, max_cost = EXCLUDED.max_cost, max_attempts = EXCLUDED.max_attempts,
    max_timeout_seconds = EXCLUDED.max_timeout_seconds, max_lease_seconds = EXCLUDED.max_lease_seconds,
    shadow = EXCLUDED.shadow, updated_at = EXCLUDED.updated_at, updated_by = EXCLUDED.updated_by
RETURNING id
"""
DELETE_POLICY = """
DELETE FROM buzz_agents_policy
WHERE community_id = %(community_id)s AND agent_pubkey IS NOT DISTINCT FROM %(agent_pubkey)s
RETURNING id
"""


@dataclass(frozen=True, slots=True)
class RunPolicy:
    """The caps in force for one agent in one community. ``max_timeout_seconds`` None: no
    deadline unless the caller asks for one; ``max_lease_seconds`` None: the core's bound."""

    max_tool_calls: int
    max_cost: int
    max_attempts: int
    max_timeout_seconds: int | None
    max_lease_seconds: float | None
    shadow: bool


def settings_policy() -> RunPolicy:
    """The ``BUZZ_AGENTS`` layer: ``MAX_TOOL_CALLS``, ``MAX_COST``, ``MAX_ATTEMPTS``,
    ``MAX_TIMEOUT_SECONDS``, ``MAX_LEASE_SECONDS`` and ``SHADOW``."""
    conf = get_settings()
    return RunPolicy(
        max_tool_calls=conf.max_tool_calls,
        max_cost=min(conf.max_cost, MAX_COST_UNITS),
        max_attempts=conf.max_attempts,
        max_timeout_seconds=conf.max_timeout_seconds,
        max_lease_seconds=conf.max_lease_seconds,
        shadow=conf.shadow,
    )


def settings_layer() -> dict[str, Any]:
    """The ``BUZZ_AGENTS`` layer as the parameters of the intake function (agents migration
    0021): ``default_<field>`` of each of :data:`FIELDS`, the policy's last layer, under the
    rows that function reads as :func:`policy_of` does."""
    return {f"default_{name}": value for name, value in zip(FIELDS, _as_tuple(settings_policy()), strict=True)}


def policy_of(community_id: uuid.UUID, agent_pubkey: bytes | None) -> RunPolicy:
    """The policy in force for ``agent_pubkey`` in ``community_id`` (None: for an agent without a
    row of its own): one read of the two rows, run in the caller's scope (and transaction)."""
    rows = fetch_all(POLICY_ROWS, {"community_id": community_id, "agent_pubkey": agent_pubkey})
    layers = sorted(rows, key=lambda row: row[0], reverse=True)  # the agent's row first
    values: dict[str, Any] = {}
    for name, fallback in zip(FIELDS, _as_tuple(settings_policy()), strict=True):
        index = FIELDS.index(name) + 1
        chosen = next((row[index] for row in layers if row[index] is not None), None)
        values[name] = fallback if chosen is None else chosen
    return RunPolicy(**values)


def _as_tuple(policy: RunPolicy) -> tuple[Any, ...]:
    return tuple(getattr(policy, name) for name in FIELDS)


@dataclass(frozen=True, slots=True)
class Ask:
    """What a caller asked for (None: nothing, the policy decides), each value checked against
    its own range by :func:`ask`."""

    shadow: bool
    max_tool_calls: int | None
    max_cost: int | None
    max_attempts: int | None
    timeout_seconds: int | None


def ask(*, shadow: Any, max_tool_calls: Any, max_cost: Any, max_attempts: Any, timeout_seconds: Any) -> Ask:
    """A caller's request, validated before any SQL: ``ValidationError`` keyed by the argument for
    a value out of its own range (``max_tool_calls`` 0..100000, ``max_cost`` 0..2**53-1,
    ``max_attempts`` 1..100, ``timeout_seconds`` 1..30 days, ``shadow`` a bool)."""
    if not isinstance(shadow, bool):
        raise v.invalid("shadow", f"must be a bool, not {type(shadow).__name__}")
    return Ask(
        shadow=shadow,
        max_tool_calls=_optional_int(max_tool_calls, "max_tool_calls", 0, MAX_TOOL_CALLS),
        max_cost=_optional_int(max_cost, "max_cost", 0, MAX_COST_UNITS),
        max_attempts=_optional_int(max_attempts, "max_attempts", 1, MAX_ATTEMPTS),
        timeout_seconds=_optional_int(timeout_seconds, "timeout_seconds", 1, MAX_TIMEOUT_SECONDS),
    )


def _at_most(asked: int | None, cap: int) -> int:
    return cap if asked is None else min(asked, cap)


def bounded(policy: RunPolicy, asked: Ask) -> dict[str, Any]:
    """The run's values from what the caller asked for, within ``policy``: each budget the
    smaller of the two (the policy's when the caller asked none), shadow when either says so,
    the deadline the shorter (the policy's cap when the caller gave none), the policy's lease cap."""
    timeout = asked.timeout_seconds
    if policy.max_timeout_seconds is not None:
        timeout = policy.max_timeout_seconds if timeout is None else min(timeout, policy.max_timeout_seconds)
    return {
        "shadow": asked.shadow or policy.shadow,
        "max_tool_calls": _at_most(asked.max_tool_calls, policy.max_tool_calls),
        "max_cost": _at_most(asked.max_cost, policy.max_cost),
        "max_attempts": _at_most(asked.max_attempts, policy.max_attempts),
        "timeout_seconds": timeout,
        "max_lease_seconds": policy.max_lease_seconds,
    }


def _optional_int(value: Any, name: str, low: int, high: int) -> int | None:
    return None if value is None else v.int_in_range(value, name, low, high)


@tenant_scoped
def set_policy(
    community_id: uuid.UUID | str,
    agent_pubkey: bytes | None = None,
    *,
    max_tool_calls: int | None = None,
    max_cost: int | None = None,
    max_attempts: int | None = None,
    max_timeout_seconds: int | None = None,
    max_lease_seconds: float | None = None,
    shadow: bool | None = None,
    updated_by: str = "",
) -> uuid.UUID:
    """Set the policy of a community (``agent_pubkey`` None) or of one agent key in it, replacing
    the row's fields (None: inherit). Returns the row's id. Runs created afterwards get it; runs
    already created keep theirs. Raises ``ValidationError`` keyed by the argument before SQL,
    ``CommunityNotWritable`` when the community is not ``active``."""
    community = v.uuid_value(community_id, "community_id")
    conf = core_settings()
    if shadow is not None and not isinstance(shadow, bool):
        raise v.invalid("shadow", f"must be a bool or None, not {type(shadow).__name__}")
    params = {
        "id": new_uuid7(),
        "community_id": community,
        "agent_pubkey": None if agent_pubkey is None else v.bytes32(agent_pubkey, "agent_pubkey"),
        "max_tool_calls": _optional_int(max_tool_calls, "max_tool_calls", 0, MAX_TOOL_CALLS),
        "max_cost": _optional_int(max_cost, "max_cost", 0, MAX_COST_UNITS),
        "max_attempts": _optional_int(max_attempts, "max_attempts", 1, MAX_ATTEMPTS),
        "max_timeout_seconds": _optional_int(max_timeout_seconds, "max_timeout_seconds", 1, MAX_TIMEOUT_SECONDS),
        "max_lease_seconds": None
        if max_lease_seconds is None
        else v.seconds_in_range(max_lease_seconds, "max_lease_seconds", conf.min_lease_seconds, conf.max_lease_seconds),
        "shadow": shadow,
        "updated_by": v.optional_text(updated_by, "updated_by", 200) or "",
    }
    with translated_errors(), transaction.atomic():
        _require_active(community)
        return fetch_all(UPSERT_POLICY, params)[0][0]  # type: ignore[no-any-return]


@tenant_scoped
def clear_policy(community_id: uuid.UUID | str, agent_pubkey: bytes | None = None) -> int:
    """Delete the policy row of a community (``agent_pubkey`` None) or of one agent key in it;
    returns 1 when there was one, else 0. Raises as :func:`set_policy`."""
    community = v.uuid_value(community_id, "community_id")
    key = None if agent_pubkey is None else v.bytes32(agent_pubkey, "agent_pubkey")
    with translated_errors(), transaction.atomic():
        _require_active(community)
        return len(fetch_all(DELETE_POLICY, {"community_id": community, "agent_pubkey": key}))


@tenant_scoped
def get_policy(community_id: uuid.UUID | str, agent_pubkey: bytes | None = None) -> RunPolicy:
    """The policy in force for ``agent_pubkey`` (32 bytes; None: an agent without a row of its
    own) in ``community_id`` (a scoped read)."""
    key = None if agent_pubkey is None else v.bytes32(agent_pubkey, "agent_pubkey")
    return policy_of(v.uuid_value(community_id, "community_id"), key)


def _require_active(community: uuid.UUID) -> None:
    rows = fetch_all(COMMUNITY_STATE, {"community_id": community})
    if not rows:
        raise v.invalid("community_id", "no such community")
    if rows[0][0] != "active":
        raise CommunityNotWritable(f"community {community} is {rows[0][0]}: its policy is fenced (write fence)")
