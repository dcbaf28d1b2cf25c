"""The OpenAPI 3.1 document of the gateway, built from the same body declarations the views
validate with (:mod:`buzz_delivery.gateway.schema`) and the settings in force.

The agent-run endpoints (SPEC section 12, ``buzz_delivery.agents``) are not served yet; they
will live under ``/communities/{community_id}/runs/...`` with the same auth and error shapes.
"""

from __future__ import annotations

from typing import Any

from buzz_delivery.gateway.errors import STATUS_OF_CODE
from buzz_delivery.gateway.schema import BODIES

HEX64 = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
UUID = {"type": "string", "format": "uuid"}
TIME = {"type": "string", "format": "date-time"}
NULLABLE_TIME = {"type": ["string", "null"], "format": "date-time"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": list(props) if required is None else required,
        "properties": props,
    }


SCHEMAS: dict[str, Any] = {
    "Error": _obj(
        {
            "code": {"type": "string", "enum": sorted(STATUS_OF_CODE)},
            "message": {"type": "string"},
            "field": {"type": "string", "description": "the offending field (400 only)"},
            "outcome": {"type": "string", "enum": ["lease_lost"], "description": "409 only"},
        },
        required=["code", "message"],
    ),
    "Message": _obj(
        {
            "event_id": HEX64,
            "kind": {"type": "integer"},
            "pubkey": HEX64,
            "created_at": TIME,
            "content": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
        }
    ),
    "Delivery": _obj(
        {
            "id": UUID,
            "community_id": UUID,
            "workflow_id": UUID,
            "run_id": UUID,
            "step_id": {"type": "string", "minLength": 1, "maxLength": 64},
            "target_pubkey": HEX64,
            "definition_event_id": HEX64,
            "message_event_id": HEX64,
            "cause": _obj(
                {
                    "kind": {"type": "string", "enum": ["event", "schedule", "webhook"]},
                    "value": {"type": "string", "description": "event id (hex), instant (RFC 3339) or UUID"},
                }
            ),
            "status": {"type": "string", "enum": ["pending", "claimed", "finished", "failed", "expired"]},
            "attempt": {"type": "integer", "minimum": 0},
            "max_attempts": {"type": ["integer", "null"], "minimum": 1},
            "lease_generation": {"type": "integer", "minimum": 0},
            "created_at": TIME,
            "claimed_at": NULLABLE_TIME,
            "lease_until": NULLABLE_TIME,
            "finished_at": NULLABLE_TIME,
            "expires_at": NULLABLE_TIME,
            "failure_code": {"type": ["string", "null"]},
            "failure_message": {"type": ["string", "null"]},
            "message": {"oneOf": [_ref("Message"), {"type": "null"}]},
        }
    ),
    "Lease": _obj(
        {
            "community_id": UUID,
            "delivery_id": UUID,
            "lease_generation": {"type": "integer", "minimum": 1},
            "lease_until": TIME,
        }
    ),
    "ClaimResponse": _obj(
        {
            "claims": {
                "type": "array",
                "items": _obj({"delivery": _ref("Delivery"), "lease": _ref("Lease")}),
            }
        }
    ),
    "DeliveryResponse": _obj({"delivery": _ref("Delivery")}),
    "RenewResponse": _obj({"lease": _ref("Lease")}),
    "FinishResponse": _obj(
        {
            "outcome": {"type": "string", "enum": ["settled", "already_terminal"]},
            "status": {"type": "string", "enum": ["pending", "finished", "failed", "expired"]},
        }
    ),
    "MeResponse": _obj({"pubkey": HEX64, "communities": {"type": "array", "items": UUID}}),
}

_C, _D, _T = "0193a5a0-0000-7000-8000-00000000000c", "0193a5a0-0000-7000-8000-00000000000d", "2026-12-01T12:00:00Z"
_LEASE = {"community_id": _C, "delivery_id": _D, "lease_generation": 1, "lease_until": "2026-12-01T12:01:00Z"}
_DELIVERY = {
    "id": _D, "community_id": _C, "workflow_id": "0193a5a0-0000-7000-8000-000000000001",
    "run_id": "0193a5a0-0000-7000-8000-000000000002", "step_id": "send_message", "target_pubkey": "ab" * 32,
    "definition_event_id": "cd" * 32, "message_event_id": "ef" * 32,
    "cause": {"kind": "webhook", "value": "6f1c2d3e-0000-4000-8000-000000000000"}, "status": "claimed",
    "attempt": 1, "max_attempts": 3, "lease_generation": 1, "created_at": _T, "claimed_at": _T,
    "lease_until": "2026-12-01T12:01:00Z", "finished_at": None, "expires_at": None, "failure_code": None,
    "failure_message": None,
    "message": {"event_id": "ef" * 32, "kind": 1, "pubkey": "12" * 32, "created_at": _T, "content": "hello",
                "tags": [["p", "ab" * 32]]},
}  # fmt: skip
# One example per schema; the tests validate each against its schema.
EXAMPLES: dict[str, Any] = {
    "ClaimRequest": {"limit": 10, "wait_seconds": 20, "lease_seconds": 60},
    "RenewRequest": {"lease_generation": 1, "lease_seconds": 60},
    "FinishRequest": {
        "lease_generation": 1,
        "outcome": "failed",
        "failure_code": "BadPayload",
        "failure_message": "no",
    },
    "ClaimResponse": {"claims": [{"delivery": _DELIVERY, "lease": _LEASE}]},
    "DeliveryResponse": {"delivery": _DELIVERY},
    "RenewResponse": {"lease": _LEASE},
    "FinishResponse": {"outcome": "settled", "status": "failed"},
    "MeResponse": {"pubkey": "ab" * 32, "communities": [_C]},
    "Delivery": _DELIVERY,
    "Message": _DELIVERY["message"],
    "Lease": _LEASE,
    "Error": {"code": "bad_request", "message": "limit: must be within 1..100", "field": "limit"},
}


def _content(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(name), "example": EXAMPLES[name]}}


PATH_PARAMS = [
    {"name": "community_id", "in": "path", "required": True, "schema": UUID},
    {"name": "delivery_id", "in": "path", "required": True, "schema": UUID},
]
AUTH_ERRORS = ("400", "401", "413", "503")


def _errors(*statuses: str) -> dict[str, Any]:
    descriptions = {
        "400": "a field is missing, extra, mistyped or out of range (``field`` names it)",
        "401": "missing, invalid, stale or replayed NIP-98 signature",
        "403": "the key is not enrolled there",
        "404": "no such delivery for this key",
        "409": "lease lost",
        "413": "body too large",
        "503": "database unavailable",
    }
    return {s: {"description": descriptions[s], "content": _content("Error")} for s in statuses}


def _operation(
    op_id: str, summary: str, response: str, body: str | None, *extra_errors: str, params: bool = False
) -> dict[str, Any]:
    op: dict[str, Any] = {
        "operationId": op_id,
        "summary": summary,
        "security": [{"nip98": []}],
        "responses": {
            "200": {"description": "OK", "content": _content(response)},
            **_errors(*sorted({*AUTH_ERRORS, *extra_errors})),
        },
    }
    if params:
        op["parameters"] = PATH_PARAMS
    if body is not None:
        op["requestBody"] = {"required": True, "content": _content(body)}
    return op


DELIVERY = "/communities/{community_id}/deliveries/{delivery_id}"


def document(server_url: str = "/gateway/v1") -> dict[str, Any]:
    """The OpenAPI 3.1 document; ``server_url`` is the prefix the gateway is mounted under.
    Bounds that are settings (limits, lease lengths) are those in force now."""
    schemas = dict(SCHEMAS)
    for body in BODIES:
        schemas[body.name] = body.json_schema()
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "buzz_delivery agent gateway",
            "version": "1",
            "description": "Remote agents claim, renew and settle their deliveries. Every request is signed "
            "with the agent's key as a NIP-98 event (kind 27235: u, method, payload tags); the signer is the "
            "lease scope. Times are RFC 3339 from the database clock. See docs/gateway.md.",
        },
        "servers": [{"url": server_url}],
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "nip98": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "Authorization",
                    "description": "Nostr <base64 of a signed kind-27235 event>, one per request",
                }
            },
        },
        "paths": {
            "/openapi.json": {
                "get": {
                    "operationId": "openapi",
                    "summary": "This document",
                    "security": [],
                    "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": {}}}}},
                }
            },
            "/me": {"get": _operation("me", "The signer and its communities", "MeResponse", None)},
            "/deliveries/claim": {
                "post": _operation(
                    "claimDeliveries", "Claim (long-poll) across enrolled communities", "ClaimResponse",
                    "ClaimRequest", "403",
                )
            },
            DELIVERY: {
                "get": _operation(
                    "readDelivery", "One of the signer's deliveries", "DeliveryResponse", None, "403", "404",
                    params=True,
                )
            },
            f"{DELIVERY}/renew": {
                "post": _operation(
                    "renewDelivery", "Extend a current lease", "RenewResponse", "RenewRequest", "403", "404", "409",
                    params=True,
                )
            },
            f"{DELIVERY}/finish": {
                "post": _operation(
                    "finishDelivery", "Settle once", "FinishResponse", "FinishRequest", "403", "404", "409",
                    params=True,
                )
            },
        },
    }  # fmt: skip
