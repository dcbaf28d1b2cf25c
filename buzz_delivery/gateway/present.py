"""JSON shapes of deliveries, leases and message events (times in RFC 3339, from the database)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from buzz_delivery.models import Event, WorkflowAgentDelivery
from buzz_delivery.services import Lease, tenancy


def rfc3339(value: dt.datetime | None) -> str | None:
    """An aware datetime as RFC 3339 in UTC (``...Z``), or None."""
    if value is None:
        return None
    return value.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


def cause_of(d: WorkflowAgentDelivery) -> dict[str, str]:
    """``{"kind", "value"}``: the event id as hex, the schedule instant, or the invocation UUID."""
    if d.cause_kind == "event":
        value = bytes(d.cause_event_id or b"").hex()
    elif d.cause_kind == "schedule":
        value = rfc3339(d.cause_scheduled_for) or ""
    else:
        value = str(d.cause_webhook_invocation_id)
    return {"kind": d.cause_kind, "value": value}


def message_of(event: Event | None) -> dict[str, Any] | None:
    """The delivery's message event, or None if it is gone."""
    if event is None:
        return None
    return {
        "event_id": bytes(event.event_id).hex(),
        "kind": event.kind,
        "pubkey": bytes(event.pubkey).hex(),
        "created_at": rfc3339(event.created_at),
        "content": event.content,
        "tags": event.tags,
    }


def delivery_of(d: WorkflowAgentDelivery, message: Event | None) -> dict[str, Any]:
    """A delivery without its JSON snapshots (``execution_trace``/``trigger_context``)."""
    return {
        "id": str(d.id),
        "community_id": str(d.community_id),
        "workflow_id": str(d.workflow_id),
        "run_id": str(d.run_id),
        "step_id": d.step_id,
        "target_pubkey": bytes(d.target_pubkey).hex(),
        "definition_event_id": bytes(d.definition_event_id).hex(),
        "message_event_id": bytes(d.message_event_id).hex(),
        "cause": cause_of(d),
        "status": d.status,
        "attempt": d.attempt,
        "max_attempts": d.max_attempts,
        "lease_generation": d.lease_generation,
        "created_at": rfc3339(d.created_at),
        "claimed_at": rfc3339(d.claimed_at),
        "lease_until": rfc3339(d.lease_until),
        "finished_at": rfc3339(d.finished_at),
        "expires_at": rfc3339(d.expires_at),
        "failure_code": d.failure_code,
        "failure_message": d.failure_message,
        "message": message_of(message),
    }


def lease_of(lease: Lease) -> dict[str, Any]:
    """The fields an agent sends back to renew or finish (its key is the signer)."""
    return {
        "community_id": str(lease.community_id),
        "delivery_id": str(lease.delivery_id),
        "lease_generation": lease.lease_generation,
        "lease_until": rfc3339(lease.lease_until),
    }


def messages_for(deliveries: list[WorkflowAgentDelivery]) -> dict[tuple[uuid.UUID, bytes], Event]:
    """The message events of these deliveries, one query per community."""
    wanted: dict[uuid.UUID, set[bytes]] = {}
    for d in deliveries:
        wanted.setdefault(d.community_id, set()).add(bytes(d.message_event_id))
    found: dict[tuple[uuid.UUID, bytes], Event] = {}
    for community, ids in wanted.items():
        with tenancy.tenant(community):
            events = list(Event.objects.filter(community_id=community, event_id__in=list(ids)))
        for event in events:
            found[(community, bytes(event.event_id))] = event
    return found


def _hex(value: Any) -> str | None:
    return None if value is None else bytes(value).hex()


def run_of(r: Any) -> dict[str, Any]:
    """An agent run (``buzz_delivery.agents.models.AgentRun``) as JSON."""
    return {
        "id": str(r.id),
        "community_id": str(r.community_id),
        "agent_pubkey": bytes(r.agent_pubkey).hex(),
        "state": r.state,
        "unwinding": r.unwinding,
        "shadow": r.shadow,
        "input": r.input,
        "input_hash": _hex(r.input_hash),
        "output": r.output,
        "failure_code": r.failure_code,
        "failure_message": r.failure_message,
        "delivery_id": None if r.delivery_id is None else str(r.delivery_id),
        "lease_generation": r.lease_generation,
        "lease_until": rfc3339(r.lease_until),
        "heartbeat_at": rfc3339(r.heartbeat_at),
        "worker_id": r.worker_id,
        "attempts": r.attempts,
        "max_attempts": r.max_attempts,
        "timeout_at": rfc3339(r.timeout_at),
        "max_tool_calls": r.max_tool_calls,
        "tool_calls_used": r.tool_calls_used,
        "max_cost": r.max_cost,
        "cost_used": r.cost_used,
        "output_chunks": r.output_chunks,
        "created_at": rfc3339(r.created_at),
        "finished_at": rfc3339(r.finished_at),
    }


def journal_entry_of(e: Any) -> dict[str, Any]:
    """A journal entry (``buzz_delivery.agents.models.JournalEntry``) as JSON: what a remote
    handler needs to resume (replay succeeded calls, reconcile pending ones)."""
    return {
        "seq": e.seq,
        "scope": e.scope,
        "index": e.replay_key[1],
        "kind": e.kind,
        "tool_name": e.tool_name,
        "idempotency_key": e.idempotency_key,
        "input_hash": _hex(e.input_hash),
        "cost": e.cost,
        "destructive": e.destructive,
        "compensation": e.compensation,
        "status": e.status,
        "uncertain": e.uncertain,
        "blocked_reason": e.blocked_reason,
        "error": e.error,
        "output": e.output,
        "latency_ms": e.latency_ms,
        "compensation_status": e.compensation_status,
        "created_at": rfc3339(e.created_at),
        "finished_at": rfc3339(e.finished_at),
    }


def run_lease_of(lease: Any) -> dict[str, Any]:
    """An :class:`~buzz_delivery.agents.services.AgentLease` as the fields an agent sends back."""
    return {
        "community_id": str(lease.community_id),
        "run_id": str(lease.run_id),
        "lease_generation": lease.lease_generation,
        "lease_until": rfc3339(lease.lease_until),
        "worker_id": lease.worker_id,
    }
