"""The OpenAPI 3.1 document of the gateway, built from the same body declarations the views
validate with (:mod:`buzz_delivery.gateway.schema`) and the settings in force.

The agent-run endpoints (SPEC section 12) are in the document exactly when they are served
(``buzz_delivery.agents`` installed), under ``/runs/claim`` and
``/communities/{community_id}/runs/{run_id}/...``, with the same auth and error shapes.
"""

from __future__ import annotations

from typing import Any

from buzz_delivery.gateway.errors import STATUS_OF_CODE
from buzz_delivery.gateway.schema import BODIES, EVENT_BODIES, RUN_BODIES

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
            "reason": {"type": "string", "description": "409 of a run: cancelled when a cancel fenced the holder"},
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
    "SendEventResponse": _obj(
        {
            "resumed": {"type": "integer", "minimum": 0, "description": "waiting steps it resumed, each once"},
            "kept_until": {**TIME, "description": "until when a wait that starts later takes it"},
        }
    ),
    "BatchRunResponse": _obj(
        {
            "results": {
                "type": "array",
                "items": _obj(
                    {
                        "run_id": UUID,
                        "outcome": {
                            "type": "string",
                            "description": "what the one-run endpoint answers, or not_found",
                        },
                        "state": {"type": "string"},
                        "reason": {"type": ["string", "null"]},
                        "seqs": {
                            "type": "array",
                            "items": {"type": "integer"},
                            "description": "unwinding: the entries to compensate, highest first",
                        },
                        "seq": {"type": "integer"},
                        "idempotency_key": {"type": "string"},
                        "status": {"type": "string"},
                        "lease": {"type": "object"},
                        "budget": {"type": "string"},
                        "used": {"type": "integer"},
                        "cap": {"type": "integer"},
                        "compensation": {},
                        "args": {},
                        "output": {},
                        "key": {"type": "string"},
                    },
                    required=["run_id", "outcome"],
                ),
            }
        }
    ),
    "BatchRenewResponse": _obj(
        {
            "results": {
                "type": "array",
                "items": _obj(
                    {
                        "delivery_id": UUID,
                        "outcome": {"type": "string", "enum": ["renewed", "lease_lost", "not_found"]},
                        "lease": _ref("Lease"),
                    },
                    required=["delivery_id", "outcome"],
                ),
            }
        }
    ),
    "BatchFinishResponse": _obj(
        {
            "results": {
                "type": "array",
                "items": _obj(
                    {
                        "delivery_id": UUID,
                        "outcome": {
                            "type": "string",
                            "enum": ["settled", "already_terminal", "lease_lost", "not_found"],
                        },
                        "status": {"type": "string", "enum": ["finished", "failed", "pending", "expired"]},
                    },
                    required=["delivery_id", "outcome"],
                ),
            }
        }
    ),
}
# A steps request's answer (issue 29): per kind, the answers its batch route gives, in order.
SCHEMAS["BatchStepsResponse"] = _obj(
    {kind: SCHEMAS["BatchRunResponse"]["properties"]["results"] for kind in ("results", "calls", "complete")}
)

NULLABLE_TEXT = {"type": ["string", "null"]}
RUN_STATES = ["pending", "running", "waiting_tool", "waiting_approval", "completed", "failed", "cancelled", "timeout"]
RUN_SCHEMAS: dict[str, Any] = {
    "Run": _obj(
        {
            "id": UUID, "community_id": UUID, "agent_pubkey": HEX64,
            "state": {"type": "string", "enum": RUN_STATES},
            "unwinding": {"type": "boolean"}, "shadow": {"type": "boolean"}, "input": {},
            "input_hash": {"type": ["string", "null"]}, "output": {},
            "failure_code": NULLABLE_TEXT, "failure_message": NULLABLE_TEXT,
            "delivery_id": {"type": ["string", "null"], "format": "uuid"},
            "lease_generation": {"type": "integer", "minimum": 0}, "lease_until": NULLABLE_TIME,
            "heartbeat_at": NULLABLE_TIME, "worker_id": NULLABLE_TEXT,
            "attempts": {"type": "integer", "minimum": 0}, "max_attempts": {"type": "integer", "minimum": 1},
            "timeout_at": NULLABLE_TIME, "max_tool_calls": {"type": "integer"}, "tool_calls_used": {"type": "integer"},
            "max_cost": {"type": "integer"}, "cost_used": {"type": "integer"},
            "output_chunks": {"type": "integer", "minimum": 0}, "created_at": TIME,
            "finished_at": NULLABLE_TIME,
        }
    ),
    "JournalEntry": _obj(
        {
            "seq": {"type": "integer", "minimum": 1},
            "scope": {"type": "string", "description": "the entry's replay scope ('' is the run's root)"},
            "index": {"type": "integer", "minimum": 1, "description": "its call's position in its scope"},
            "kind": {"type": "string", "enum": ["tool", "approval"]},
            "tool_name": {"type": "string"}, "idempotency_key": {"type": "string"}, "input_hash": HEX64,
            "cost": {"type": "integer"}, "destructive": {"type": "boolean"}, "compensation": {},
            "status": {"type": "string", "enum": ["pending", "succeeded", "failed"]},
            "uncertain": {"type": "boolean"}, "blocked_reason": NULLABLE_TEXT, "error": NULLABLE_TEXT,
            "output": {}, "latency_ms": {"type": ["integer", "null"]},
            "compensation_status": {
                "type": ["string", "null"], "enum": ["compensating", "compensated", "compensation_failed", None]
            },
            "created_at": TIME, "finished_at": NULLABLE_TIME,
        }
    ),
    "RunLease": _obj(
        {
            "community_id": UUID, "run_id": UUID, "lease_generation": {"type": "integer", "minimum": 1},
            "lease_until": TIME, "worker_id": {"type": "string"},
        }
    ),
    "RunClaimResponse": _obj(
        {"claims": {"type": "array", "items": _obj({"run": _ref("Run"), "lease": _ref("RunLease")})}}
    ),
    "RunResponse": _obj({"run": _ref("Run"), "journal": {"type": "array", "items": _ref("JournalEntry")}}),
    "RunOutputResponse": _obj(
        {
            "chunks": {
                "type": "array",
                "items": _obj({"seq": {"type": "integer"}, "chunk": {"type": "string"}}, ["seq", "chunk"]),
            },
            "after": {"type": "integer"},
            "terminal": {"type": "boolean"},
            "done": {"type": "boolean"},
        },
        ["chunks", "after", "terminal", "done"],
    ),
    "RunOutcome": _obj(
        {
            "outcome": {
                "type": "string",
                "enum": ["accepted", "already_terminal", "renewed", "journaled", "blocked", "budget_exceeded",
                         "recorded", "already_recorded", "approval_requested", "calls_in_flight", "finished",
                         "unwinding", "begun", "not_next", "run_ended", "emitted", "too_large"],
            },
            "run_id": UUID, "state": {"type": "string", "enum": RUN_STATES}, "status": {"type": "string"},
            "lease": _ref("RunLease"), "seq": {"type": "integer"}, "idempotency_key": {"type": "string"},
            "reason": {"type": "string"}, "budget": {"type": "string", "enum": ["tool_calls", "cost"]},
            "used": {"type": "integer"}, "cap": {"type": "integer"}, "approval_id": UUID,
            "seqs": {"type": "array", "items": {"type": "integer"}}, "compensation": {}, "args": {}, "output": {},
            "key": {"type": "string"}, "workflow_state": {"type": "string"}, "field": {"type": "string"},
            "size": {"type": "integer"},
        },
        required=["outcome"],
    ),
}  # fmt: skip

_C, _D, _T = "0193a5a0-0000-7000-8000-00000000000c", "0193a5a0-0000-7000-8000-00000000000d", "2026-12-01T12:00:00Z"
_D2 = "0193a5a0-0000-7000-8000-00000000000e"
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
    "BatchFinishRequest": {
        "deliveries": [
            {"delivery_id": _D, "lease_generation": 1},
            {
                "delivery_id": _D2,
                "lease_generation": 2,
                "outcome": "retry",
                "failure_message": "timeout",
                "retry_after": 30,
            },
        ],
        "outcome": "finished",
    },
    "BatchFinishResponse": {
        "results": [
            {"delivery_id": _D, "outcome": "settled", "status": "finished"},
            {"delivery_id": _D2, "outcome": "settled", "status": "pending"},
        ]
    },
    "BatchRenewRequest": {"deliveries": [{"delivery_id": _D, "lease_generation": 1}], "lease_seconds": 60},
    "BatchRenewResponse": {"results": [{"delivery_id": _D, "outcome": "renewed", "lease": _LEASE}]},
    "BatchCompleteRequest": {
        "runs": [{"run_id": "0193a5a0-0000-7000-8000-0000000000a1", "lease_generation": 1, "output": {"ok": True}}],
        "worker_id": "w1",
    },
    "BatchHeartbeatRequest": {
        "runs": [{"run_id": "0193a5a0-0000-7000-8000-0000000000a1", "lease_generation": 1}],
        "worker_id": "w1",
        "lease_seconds": 60,
    },
    "BatchCallRequest": {
        "runs": [
            {
                "run_id": "0193a5a0-0000-7000-8000-0000000000a1",
                "lease_generation": 1,
                "tool_name": "search",
                "args": {"q": "x"},
            }
        ],
        "worker_id": "w1",
    },
    "BatchResultRequest": {
        "runs": [
            {
                "run_id": "0193a5a0-0000-7000-8000-0000000000a1",
                "lease_generation": 1,
                "seq": 1,
                "ok": True,
                "output": {"hits": 3},
            }
        ],
        "worker_id": "w1",
    },
    "BatchFailRequest": {
        "runs": [
            {
                "run_id": "0193a5a0-0000-7000-8000-0000000000a1",
                "lease_generation": 1,
                "failure_code": "handler_error",
                "failure_message": "RuntimeError: upstream gone",
            }
        ],
        "worker_id": "w1",
    },
    "BatchCompensationBeginRequest": {
        "runs": [{"run_id": "0193a5a0-0000-7000-8000-0000000000a1", "lease_generation": 2, "seq": 3}],
        "worker_id": "w1",
    },
    "BatchCompensationFinishRequest": {
        "runs": [{"run_id": "0193a5a0-0000-7000-8000-0000000000a1", "lease_generation": 2, "seq": 3, "ok": True}],
        "worker_id": "w1",
    },
    "BatchRunResponse": {
        "results": [{"run_id": "0193a5a0-0000-7000-8000-0000000000a1", "outcome": "finished", "state": "completed"}]
    },
    "SendEventRequest": {"name": "payment.received", "key": "order:42", "payload": {"amount": 1200}},
    "SendEventResponse": {"resumed": 1, "kept_until": _T},
}
_R = "0193a5a0-0000-7000-8000-0000000000a1"
_R2, _R3 = "0193a5a0-0000-7000-8000-0000000000a2", "0193a5a0-0000-7000-8000-0000000000a3"
_RUN_LEASE = {"community_id": _C, "run_id": _R, "lease_generation": 1, "lease_until": _T, "worker_id": "w1"}
_RUN = {
    "id": _R,
    "community_id": _C,
    "agent_pubkey": "ab" * 32,
    "state": "running",
    "unwinding": False,
    "shadow": False,
    "input": {"content": "hello"},
    "input_hash": "01" * 32,
    "output": None,
    "failure_code": None,
    "failure_message": None,
    "delivery_id": _D,
    "lease_generation": 1,
    "lease_until": _T,
    "heartbeat_at": _T,
    "worker_id": "w1",
    "attempts": 0,
    "max_attempts": 3,
    "timeout_at": None,
    "max_tool_calls": 100,
    "tool_calls_used": 1,
    "max_cost": 1000000,
    "cost_used": 0,
    "output_chunks": 0,
    "created_at": _T,
    "finished_at": None,
}
_ENTRY = {
    "seq": 1,
    "scope": "",
    "index": 1,
    "kind": "tool",
    "tool_name": "search",
    "idempotency_key": f"{_R}:1",
    "input_hash": "02" * 32,
    "cost": 0,
    "destructive": False,
    "compensation": None,
    "status": "succeeded",
    "uncertain": False,
    "blocked_reason": None,
    "error": None,
    "output": {"hits": 3},
    "latency_ms": 12,
    "compensation_status": None,
    "created_at": _T,
    "finished_at": _T,
}
_RL = {"lease_generation": 1, "worker_id": "w1"}
RUN_EXAMPLES: dict[str, Any] = {
    "Run": _RUN, "JournalEntry": _ENTRY, "RunLease": _RUN_LEASE,
    "RunClaimResponse": {"claims": [{"run": _RUN, "lease": _RUN_LEASE}]},
    "RunResponse": {"run": _RUN, "journal": [_ENTRY]},
    "RunOutputResponse": {"chunks": [{"seq": 3, "chunk": "Looking up "}], "after": 3, "terminal": False,
                          "done": False},
    "EmitRequest": {**_RL, "chunk": "Looking it up… "},
    "RunOutputRequest": {"after": 2, "limit": 200, "wait_seconds": 10},
    "RunOutcome": {"outcome": "journaled", "seq": 2, "idempotency_key": f"{_R}:2"},
    "AcceptRequest": {"lease_generation": 1, "input": {"priority": "high"}, "max_tool_calls": 10},
    "RunClaimRequest": {"limit": 4, "lease_seconds": 60, "worker_id": "w1"},
    "HeartbeatRequest": {**_RL, "lease_seconds": 60},
    "CallRequest": {**_RL, "tool_name": "search", "args": {"q": "buzz"}, "compensation": {"function": "m:undo"}},
    "CallResultRequest": {**_RL, "seq": 1, "ok": True, "output": {"hits": 3}, "latency_ms": 12},
    "ApprovalRequest": {**_RL, "prompt": "send the refund?", "deadline_seconds": 3600},
    "CompleteRequest": {**_RL, "output": {"answer": 42}},
    "FailRequest": {**_RL, "failure_code": "tool_error", "failure_message": "search is down"},
    "CompensationBeginRequest": {**_RL, "seq": 1},
    "CompensationFinishRequest": {**_RL, "seq": 1, "ok": True},
    "BatchStepsRequest": {
        "results": [{"run_id": _R, "lease_generation": 1, "seq": 1, "ok": True, "output": {"hits": 3}}],
        "calls": [{"run_id": _R2, "lease_generation": 1, "tool_name": "search", "args": {"q": "buzz"}}],
        "complete": [{"run_id": _R3, "lease_generation": 2, "output": {"answer": 42}}],
        "worker_id": "w1",
    },
    "BatchStepsResponse": {
        "results": [{"run_id": _R, "outcome": "recorded", "status": "succeeded"}],
        "calls": [{"run_id": _R2, "outcome": "journaled", "seq": 3, "idempotency_key": f"{_R2}:3"}],
        "complete": [{"run_id": _R3, "outcome": "finished", "state": "completed"}],
    },
}  # fmt: skip


def _content(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(name), "example": {**EXAMPLES, **RUN_EXAMPLES}[name]}}


COMMUNITY_PARAM = {"name": "community_id", "in": "path", "required": True, "schema": UUID}
PATH_PARAMS = [COMMUNITY_PARAM, {"name": "delivery_id", "in": "path", "required": True, "schema": UUID}]
RUN_PARAMS = [COMMUNITY_PARAM, {"name": "run_id", "in": "path", "required": True, "schema": UUID}]
AUTH_ERRORS = ("400", "401", "403", "413", "429", "503")


def _errors(*statuses: str) -> dict[str, Any]:
    descriptions = {
        "400": "a field is missing, extra, mistyped or out of range (``field`` names it)",
        "401": "missing, invalid, stale or replayed NIP-98 signature",
        "403": "the key is not enrolled there",
        "404": "no such delivery (or run) for this key",
        "409": "lease lost",
        "413": "body too large",
        "429": "this key or community has as many requests or long-polls in flight as its bound allows (Retry-After)",
        "503": "database unavailable",
    }
    return {s: {"description": descriptions[s], "content": _content("Error")} for s in statuses}


def _operation(
    op_id: str, summary: str, response: str, body: str | None, *extra_errors: str, params: bool | list = False
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
        op["parameters"] = PATH_PARAMS if params is True else params
    if body is not None:
        op["requestBody"] = {"required": True, "content": _content(body)}
    return op


DELIVERY = "/communities/{community_id}/deliveries/{delivery_id}"
RUN = "/communities/{community_id}/runs/{run_id}"


def _run_paths() -> dict[str, Any]:
    def post(op_id: str, summary: str, body: str, response: str = "RunOutcome") -> dict[str, Any]:
        return {"post": _operation(op_id, summary, response, body, "403", "404", "409", params=RUN_PARAMS)}

    return {
        f"{DELIVERY}/accept": {
            "post": _operation(
                "acceptDelivery", "Settle a held delivery and start its agent run", "RunOutcome", "AcceptRequest",
                "403", "404", "409", params=True,
            )
        },
        "/runs/claim": {
            "post": _operation("claimRuns", "Claim the signer's pending agent runs", "RunClaimResponse",
                               "RunClaimRequest", "403")
        },
        RUN: {"get": _operation("readRun", "A run and its journal", "RunResponse", None, "403", "404",
                                params=RUN_PARAMS)},
        f"{RUN}/heartbeat": post("heartbeatRun", "Renew the run lease", "HeartbeatRequest"),
        f"{RUN}/calls": post("journalCall", "Journal a tool call before making it", "CallRequest"),
        f"{RUN}/results": post("recordCallResult", "Record a call's result", "CallResultRequest"),
        f"{RUN}/approval": post("requestApproval", "Park the run on an approval", "ApprovalRequest"),
        f"{RUN}/complete": post(
            "completeRun", "End the run completed (calls_in_flight while the holder's calls are not recorded)",
            "CompleteRequest",
        ),
        **{
            f"/communities/{{community_id}}/runs/{action}": {
                "post": _operation(op, summary, "BatchStepsResponse" if action == "steps" else "BatchRunResponse",
                                   body, "403", params=[COMMUNITY_PARAM])
            }
            for action, op, summary, body in (
                ("complete", "completeRuns", "Complete many runs of one community (each: finished, calls_in_flight...)",
                 "BatchCompleteRequest"),
                ("calls", "journalCalls", "Journal one call for each of many runs", "BatchCallRequest"),
                ("results", "recordCallResults", "Record one call result for each of many runs",
                 "BatchResultRequest"),
                ("steps", "recordRunSteps", "Record results, journal calls and complete runs of one community "
                 "in one request", "BatchStepsRequest"),
                ("heartbeat", "heartbeatRuns", "Renew many run leases of one community", "BatchHeartbeatRequest"),
                ("fail", "failRuns", "Fail many runs of one community (or start their unwinding)",
                 "BatchFailRequest"),
                ("compensations/begin", "beginCompensations", "Begin undoing one entry for each of many runs",
                 "BatchCompensationBeginRequest"),
                ("compensations/finish", "finishCompensations",
                 "Record one entry's compensation for each of many runs", "BatchCompensationFinishRequest"),
            )
        },
        f"{RUN}/emit": post("emitOutput", "Append a chunk to the run's output stream", "EmitRequest"),
        f"{RUN}/output": {"post": _operation("readRunOutput", "The run's streamed output after a seq (long-poll)",
                                             "RunOutputResponse", "RunOutputRequest", "403", "404",
                                             params=RUN_PARAMS)},
        f"{RUN}/fail": post("failRun", "Fail the run (or start unwinding)", "FailRequest"),
        f"{RUN}/compensations/begin": post("beginCompensation", "Begin undoing an entry", "CompensationBeginRequest"),
        f"{RUN}/compensations/finish": post(
            "finishCompensation", "Record an entry's compensation", "CompensationFinishRequest"
        ),
    }  # fmt: skip


def document(server_url: str = "/gateway/v1") -> dict[str, Any]:
    """The OpenAPI 3.1 document; ``server_url`` is the prefix the gateway is mounted under.
    Bounds that are settings (limits, lease lengths) are those in force now."""
    from buzz_delivery.gateway.urls import agents_installed, workflows_installed

    runs, events = agents_installed(), workflows_installed()
    schemas = {**SCHEMAS, **(RUN_SCHEMAS if runs else {})}
    if not events:
        schemas.pop("SendEventResponse")
    for body in BODIES + (RUN_BODIES if runs else ()) + (EVENT_BODIES if events else ()):
        schemas[body.name] = body.json_schema()
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "buzz_delivery agent gateway",
            "version": "1",
            "description": "Remote agents claim, renew and settle their deliveries and drive their agent runs. "
            "Every request is signed "
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
            "/communities/{community_id}/deliveries/finish": {
                "post": _operation(
                    "finishDeliveries", "Settle many leases of one community at once", "BatchFinishResponse",
                    "BatchFinishRequest", "403", params=[COMMUNITY_PARAM],
                )
            },
            "/communities/{community_id}/deliveries/renew": {
                "post": _operation(
                    "renewDeliveries", "Extend many leases of one community at once", "BatchRenewResponse",
                    "BatchRenewRequest", "403", params=[COMMUNITY_PARAM],
                )
            },
            **(_run_paths() if runs else {}),
            **(_event_paths() if events else {}),
        },
    }  # fmt: skip


def _event_paths() -> dict[str, Any]:
    return {
        "/communities/{community_id}/events": {
            "post": _operation(
                "sendEvent", "Send a workflow event: resume the steps waiting for its name and key",
                "SendEventResponse", "SendEventRequest", "403", params=[COMMUNITY_PARAM],
            )
        },
    }  # fmt: skip
