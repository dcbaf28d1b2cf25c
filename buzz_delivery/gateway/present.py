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
