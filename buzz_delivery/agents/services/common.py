"""Helpers shared by the agent-run services: hashing, JSON, lease checks, outcome reads."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

from buzz_delivery.agents.services import sql
from buzz_delivery.agents.services.types import AgentLease, AlreadyTerminal, CallsInFlight, LeaseLost
from buzz_delivery.agents.states import RUN_TERMINAL
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all
from buzz_delivery.workflows.services.common import BadJSON, json_text


def canonical(value: Any) -> str:
    """Canonical JSON text of ``value`` (sorted keys, no spaces): what hashes are taken of."""
    return json.dumps(value, cls=DjangoJSONEncoder, sort_keys=True, separators=(",", ":"), allow_nan=False)


def sha256_json(value: Any) -> bytes:
    """SHA-256 (32 bytes) of :func:`canonical` ``value``."""
    return hashlib.sha256(canonical(value).encode()).digest()


def json_value(value: Any, name: str, max_bytes: int) -> str:
    """``value`` as storable JSON text, or ``ValidationError`` keyed ``name`` (before SQL)."""
    try:
        return json_text(value, max_bytes)
    except BadJSON as exc:
        raise v.invalid(name, str(exc)) from None


def lease_value(value: Any) -> AgentLease:
    if not isinstance(value, AgentLease):
        raise v.invalid("lease", f"must be an AgentLease, not {type(value).__name__}")
    return value


def lease_params(lease: Any, **extra: Any) -> dict[str, Any]:
    lease = lease_value(lease)
    return {
        "community_id": lease.community_id,
        "run_id": lease.run_id,
        "lease_generation": lease.lease_generation,
        "worker_id": lease.worker_id,
        **extra,
    }


def missed(params: dict[str, Any]) -> AlreadyTerminal | LeaseLost:
    """Judge a fenced statement that matched nothing: the run at the holder's generation and
    terminal is ``AlreadyTerminal`` (the true holder's retry); a cancel right after the holder's
    generation (the run ``cancelled``, or unwinding for the cancel) is ``LeaseLost("cancelled")``;
    anything else ``LeaseLost``."""
    rows = fetch_all(sql.RUN_AT, params)
    if not rows:
        return LeaseLost()
    state, generation, worker, *_ = rows[0]
    if generation == params["lease_generation"] and worker == params["worker_id"] and state in RUN_TERMINAL:
        return AlreadyTerminal(state)
    if generation == params["lease_generation"] + 1 and (
        state == "cancelled" or fetch_all(sql.RUN_UNWINDING_FOR_CANCEL, params)
    ):
        return LeaseLost("cancelled")
    return LeaseLost()


def holds(params: dict[str, Any]) -> bool:
    """The holder's lease holds (current, its generation and worker, the run leased, active and
    not unwinding)."""
    rows = fetch_all(sql.RUN_AT, params)
    if not rows:
        return False
    state, generation, worker, _used, _cap, _cost, _cost_cap, unwinding, current, active = rows[0]
    return bool(
        generation == params["lease_generation"]
        and worker == params["worker_id"]
        and state in ("running", "waiting_tool")
        and current
        and active
        and not unwinding
    )


def in_flight_or_missed(params: dict[str, Any]) -> CallsInFlight | AlreadyTerminal | LeaseLost:
    """Judge a completion that matched nothing: with its lease holding, :class:`CallsInFlight`
    naming the holder's own calls in flight (journaled under its generation, still pending); none
    when a call was journaled after the completion's snapshot and recorded since (the statement
    saw the run's call count ahead of its snapshot's entries): nothing written, complete again.
    Else :func:`missed`."""
    in_flight = tuple(row[0] for row in fetch_all(sql.CALLS_IN_FLIGHT, params))
    if holds(params):
        return CallsInFlight(in_flight)
    return missed(params)
