"""Request bodies of the gateway: one declaration per body that both validates requests and
becomes the body's JSON Schema in the OpenAPI document, so the two cannot drift apart.

Bounds that come from settings (claim limit, long-poll wait, lease length) are read when a
request is validated or the document is served, so both always show the configuration in force.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from buzz_delivery import jsonbounds
from buzz_delivery.backoff import MAX_RETRY_AFTER_SECONDS
from buzz_delivery.conf import get_settings as core_settings
from buzz_delivery.gateway.conf import get_settings
from buzz_delivery.gateway.errors import bad_request

INT64_MAX = 2**63 - 1
# The agents' cost bound (buzz_delivery.agents.conf.MAX_COST_UNITS), repeated: the schema imports
# nothing of the agents app, which may not be installed.
MAX_COST_UNITS = 2**53 - 1


@dataclass(frozen=True)
class Field:
    """One body field. ``kind``: ``integer``, ``number``, ``string``, ``boolean``, ``json`` (any
    JSON value, checked by the service it is handed to) or ``array`` (of ``items`` objects).
    ``bounds`` returns (minimum, maximum) for numbers, (0, maxLength) for strings or (minItems,
    maxItems) for arrays, read at call time."""

    kind: str
    description: str
    required: bool = False
    default: Any = None
    nullable: bool = False
    bounds: Callable[[], tuple[float, float]] | None = None
    enum: tuple[str, ...] | None = None
    items: Body | None = None

    def json_schema(self) -> dict[str, Any]:
        """This field as JSON Schema 2020-12."""
        schema: dict[str, Any] = {}
        if self.kind != "json":
            schema["type"] = [self.kind, "null"] if self.nullable else self.kind
        if self.items is not None:
            schema["items"] = self.items.json_schema()
        if self.bounds is not None:
            low, high = self.bounds()
            if self.kind == "string":
                schema["maxLength"] = int(high)
            elif self.kind == "array":
                schema["minItems"], schema["maxItems"] = int(low), int(high)
            else:
                schema["minimum"], schema["maximum"] = low, high
        if self.enum is not None:
            schema["enum"] = [*self.enum, None] if self.nullable else list(self.enum)
        if not self.required:
            schema["default"] = self.default
        schema["description"] = self.description
        return schema

    def clean(self, name: str, value: Any) -> Any:
        """``value`` checked against this field; raises a 400 ``GatewayError`` naming ``name``."""
        if self.kind == "json":
            try:
                jsonbounds.check(value)
            except jsonbounds.JSONRefused as exc:
                raise bad_request(name, str(exc)) from None
            return value
        if value is None:
            if self.nullable:
                return None
            raise bad_request(name, "must not be null")
        if self.kind == "boolean":
            if not isinstance(value, bool):
                raise bad_request(name, "must be true or false")
            return value
        if self.kind == "array":
            return self._clean_array(name, value)
        if self.kind in ("integer", "number"):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise bad_request(name, f"must be a{'n integer' if self.kind == 'integer' else ' number'}")
            if self.kind == "integer" and not isinstance(value, int):
                raise bad_request(name, "must be an integer")
            if isinstance(value, float) and not math.isfinite(value):
                raise bad_request(name, "must be a finite number")
        elif self.kind == "string":
            if not isinstance(value, str):
                raise bad_request(name, "must be a string")
            why = jsonbounds.bad_text(value)
            if why:
                raise bad_request(name, why)
        if self.bounds is not None:
            low, high = self.bounds()
            if self.kind == "string":
                if len(value) > high:
                    raise bad_request(name, f"must be at most {int(high)} characters")
            elif not low <= value <= high:
                raise bad_request(name, f"must be within {low:g}..{high:g}")
        if self.enum is not None and value not in self.enum:
            raise bad_request(name, f"must be one of {', '.join(self.enum)}")
        return value

    def _clean_array(self, name: str, value: Any) -> list[Any]:
        if not isinstance(value, list):
            raise bad_request(name, "must be an array")
        if self.bounds is not None:
            low, high = self.bounds()
            if not low <= len(value) <= high:
                raise bad_request(name, f"must hold {int(low)}..{int(high)} items")
        assert self.items is not None, "an array field declares its items"
        return [self.items.clean(item, prefix=f"{name}[{i}].") for i, item in enumerate(value)]


@dataclass(frozen=True)
class Body:
    """A JSON object body with exactly these fields (unknown ones are refused by name)."""

    name: str
    fields: dict[str, Field] = field(default_factory=dict)

    def json_schema(self) -> dict[str, Any]:
        """The body as a JSON Schema object (``additionalProperties: false``)."""
        return {
            "type": "object",
            "additionalProperties": False,
            "required": [n for n, f in self.fields.items() if f.required],
            "properties": {n: f.json_schema() for n, f in self.fields.items()},
        }

    def clean(self, data: Any, *, prefix: str = "") -> dict[str, Any]:
        """The validated body with defaults filled in; raises a 400 naming the first bad field
        (``prefix`` + its name: ``deliveries[2].lease_generation`` inside an array)."""
        if not isinstance(data, dict):
            raise bad_request(prefix.rstrip(".") or "body", "must be a JSON object")
        for name in data:
            if name not in self.fields:
                raise bad_request(prefix + name, "is not a field of this request")
        out = {}
        for name, spec in self.fields.items():
            if name not in data:
                if spec.required:
                    raise bad_request(prefix + name, "is required")
                out[name] = spec.default
            else:
                out[name] = spec.clean(prefix + name, data[name])
        return out


def _claim_limit() -> tuple[float, float]:
    return 1, get_settings().max_claim_limit


def _wait() -> tuple[float, float]:
    return 0, get_settings().max_wait_seconds


def _lease() -> tuple[float, float]:
    conf = core_settings()
    return float(conf.min_lease_seconds), float(conf.max_lease_seconds)


def _generation() -> tuple[float, float]:
    return 1, INT64_MAX


LEASE_SECONDS = Field("number", "lease length in seconds; null = the server's default", nullable=True, bounds=_lease)
LEASE_GENERATION = Field(
    "integer", "the lease's generation (fence token) from the claim", required=True, bounds=_generation
)

CLAIM = Body(
    "ClaimRequest",
    {
        "limit": Field("integer", "most deliveries to claim", default=1, bounds=_claim_limit),
        "wait_seconds": Field(
            "number", "long-poll: wait up to this long for a delivery when none is pending", default=0, bounds=_wait
        ),
        "lease_seconds": LEASE_SECONDS,
    },
)
RENEW = Body("RenewRequest", {"lease_generation": LEASE_GENERATION, "lease_seconds": LEASE_SECONDS})
FINISH = Body(
    "FinishRequest",
    {
        "lease_generation": LEASE_GENERATION,
        "outcome": Field(
            "string", "finished, failed, or retry (back to pending after a backoff)", required=True,
            enum=("finished", "failed", "retry"),
        ),
        "failure_code": Field(
            "string", "with outcome failed only: a short machine-readable code", nullable=True, bounds=lambda: (0, 64)
        ),
        "failure_message": Field(
            "string", "with outcome failed or retry: what went wrong", nullable=True, bounds=lambda: (0, 10_000)
        ),
        "retry_after": Field(
            "number", "with outcome retry: seconds before the next attempt at the earliest (a provider's "
            "Retry-After); the backoff, with jitter, applies when longer", nullable=True,
            bounds=lambda: (0, MAX_RETRY_AFTER_SECONDS),
        ),
    },
)  # fmt: skip

# --- batch finish of deliveries ------------------------------------------------------------------

BATCH_LEASE = {
    "delivery_id": Field("string", "a delivery of the signer in this community (UUID)", required=True,
                         bounds=lambda: (0, 36)),
    "lease_generation": LEASE_GENERATION,
}  # fmt: skip
_OR_REQUEST = "; null or absent = the request's own"
_OR_REQUESTS = "; null or absent = the request's own if this delivery names no outcome (else none)"
BATCH_ITEM = Body(
    "BatchFinishItem",
    {
        **BATCH_LEASE,
        "outcome": Field("string", "finished, failed or retry for this delivery" + _OR_REQUEST, nullable=True,
                         enum=("finished", "failed", "retry")),
        "failure_code": Field("string", FINISH.fields["failure_code"].description + _OR_REQUESTS, nullable=True,
                              bounds=lambda: (0, 64)),
        "failure_message": Field("string", FINISH.fields["failure_message"].description + _OR_REQUESTS,
                                 nullable=True, bounds=lambda: (0, 10_000)),
        "retry_after": Field("number", FINISH.fields["retry_after"].description + _OR_REQUESTS, nullable=True,
                             bounds=lambda: (0, MAX_RETRY_AFTER_SECONDS)),
    },
)  # fmt: skip
BATCH_FINISH = Body(
    "BatchFinishRequest",
    {
        "deliveries": Field(
            "array", "the leases to settle, no delivery twice, each with its own outcome and failure text if it "
            "has them", required=True, bounds=_claim_limit, items=BATCH_ITEM
        ),
        "outcome": Field("string", "finished, failed or retry: of every delivery that names none (null: each "
                         "names its own)", nullable=True, enum=("finished", "failed", "retry")),
        "failure_code": FINISH.fields["failure_code"],
        "failure_message": FINISH.fields["failure_message"],
        "retry_after": FINISH.fields["retry_after"],
    },
)  # fmt: skip

BATCH_RENEW = Body(
    "BatchRenewRequest",
    {
        "deliveries": Field(
            "array", "the leases to renew, no delivery twice", required=True, bounds=_claim_limit,
            items=Body("BatchRenewItem", BATCH_LEASE),
        ),
        "lease_seconds": LEASE_SECONDS,
    },
)  # fmt: skip

# --- agent runs (buzz_delivery.agents, SPEC section 12) -------------------------------------------


def _run_limit() -> tuple[float, float]:
    return 1, min(100, get_settings().max_claim_limit)


def _seq() -> tuple[float, float]:
    return 1, 10**9


WORKER_ID = Field(
    "string", "the holder's name (echo the claim's lease.worker_id); null = gateway:<first 16 hex of the key>",
    nullable=True, bounds=lambda: (0, 200),
)  # fmt: skip
RUN_LEASE_FIELDS = {
    "lease_generation": Field(
        "integer", "the run lease's generation (fence token) from the claim", required=True, bounds=_generation
    ),
    "worker_id": WORKER_ID,
}


def _optional_int(description: str) -> Field:
    """A nullable integer the service bounds (its ``ValidationError`` names the field)."""
    return Field("integer", description, nullable=True)


ACCEPT = Body(
    "AcceptRequest",
    {
        "lease_generation": LEASE_GENERATION,
        "input": Field("json", "a JSON object merged over the message into the run's input, or null", default=None),
        "shadow": Field("boolean", "shadow mode: destructive calls are journaled but blocked", default=False),
        "max_tool_calls": _optional_int("journal entries cap (0..100000); null = server default"),
        "max_cost": _optional_int("cost units cap; null = server default"),
        "max_attempts": _optional_int("attempts (1..100); null = server default"),
        "timeout_seconds": _optional_int("absolute deadline from now (1..2592000); null = none"),
    },
)  # fmt: skip
RUN_CLAIM = Body(
    "RunClaimRequest",
    {
        "limit": Field("integer", "most runs to claim", default=1, bounds=_run_limit),
        "wait_seconds": Field(
            "number", "long-poll: wait up to this long for a run when none is claimable", default=0, bounds=_wait
        ),
        "lease_seconds": LEASE_SECONDS,
        "worker_id": WORKER_ID,
    },
)
HEARTBEAT = Body("HeartbeatRequest", {**RUN_LEASE_FIELDS, "lease_seconds": LEASE_SECONDS})
# The entry's replay key (agents migration 0022, docs/agents.md "Resume"): call ``index`` of scope
# ``scope``; a remote runtime sends both for every call and approval.
REPLAY_KEY_FIELDS = {
    "scope": Field(
        "string", "the call's replay scope ('' is the run's root; at most 200 characters)", default="",
        bounds=lambda: (0, 200),
    ),
    "index": Field(
        "integer", "the call's position in its scope (1, 2, ...); null: its seq (the root scope only)",
        nullable=True, bounds=_seq,
    ),
}  # fmt: skip
CALL = Body(
    "CallRequest",
    {
        **RUN_LEASE_FIELDS,
        "tool_name": Field("string", "the tool (1..200 characters)", required=True, bounds=lambda: (0, 200)),
        "args": Field("json", "the call's arguments (JSON; its SHA-256 is journaled)", required=True),
        "cost": Field("integer", "cost units counted against max_cost", default=0, bounds=lambda: (0, MAX_COST_UNITS)),
        "compensation": Field("json", "compensation descriptor (a JSON object), or null", default=None),
        "destructive": Field("boolean", "blocked in shadow mode", default=False),
        **REPLAY_KEY_FIELDS,
    },
)
RESULT = Body(
    "CallResultRequest",
    {
        **RUN_LEASE_FIELDS,
        "seq": Field("integer", "the journal entry", required=True, bounds=_seq),
        "ok": Field("boolean", "true: succeeded with output; false: failed with error", required=True),
        "output": Field("json", "the call's output (ok only)", default=None),
        "error": Field("string", "what went wrong (failed only)", nullable=True, bounds=lambda: (0, 10_000)),
        "latency_ms": Field("integer", "how long the call took", nullable=True, bounds=lambda: (0, 2**31 - 1)),
        "uncertain": Field("boolean", "failed only: the effect is unknown (compensate it)", default=False),
    },
)


# --- batches of agent-run transitions (issue 29): many runs of one community per request ---------

BATCH_RUN_ID = Field("string", "a run of the signer in this community (UUID)", required=True, bounds=lambda: (0, 36))


def _batch(name: str, item: Body, what: str) -> Body:
    """A batch body: ``runs`` (items of ``item``'s fields, each naming its run and its lease
    generation) and the holder's ``worker_id``, shared by every item."""
    fields = {n: f for n, f in item.fields.items() if n != "worker_id"}
    return Body(
        f"Batch{name}Request",
        {
            "runs": Field("array", f"the runs to {what}, each under its own lease, no run twice", required=True,
                          bounds=_run_limit,
                          items=Body(f"Batch{name}Item", {"run_id": BATCH_RUN_ID, **fields})),
            "worker_id": WORKER_ID,
        },
    )  # fmt: skip


COMPLETE = Body("CompleteRequest", {**RUN_LEASE_FIELDS, "output": Field("json", "the run's output", required=True)})
BATCH_COMPLETE = _batch("Complete", COMPLETE, "complete")
BATCH_CALLS = _batch("Call", CALL, "journal one call each for")
BATCH_HEARTBEAT = Body(
    "BatchHeartbeatRequest",
    {
        "runs": Field("array", "the run leases to renew, no run twice", required=True, bounds=_run_limit,
                      items=Body("BatchHeartbeatItem", {"run_id": BATCH_RUN_ID,
                                                        "lease_generation": RUN_LEASE_FIELDS["lease_generation"]})),
        "worker_id": WORKER_ID,
        "lease_seconds": LEASE_SECONDS,
    },
)  # fmt: skip
BATCH_RESULTS = _batch("Result", RESULT, "record one call result each for")


def steps_limit() -> tuple[float, float]:
    return 0, _run_limit()[1]


def _steps(batches: dict[str, Body]) -> Body:
    """A steps body (issue 29): per kind, the ``runs`` items of its batch body (0..100 each, at
    most 100 in all, no run twice), and the holder's ``worker_id``."""
    fields = {
        kind: Field("array", f"as ``runs`` of {body.name}", default=[], bounds=steps_limit,
                    items=body.fields["runs"].items)
        for kind, body in batches.items()
    }  # fmt: skip
    return Body("BatchStepsRequest", {**fields, "worker_id": WORKER_ID})


BATCH_STEPS = _steps({"results": BATCH_RESULTS, "calls": BATCH_CALLS, "complete": BATCH_COMPLETE})
APPROVAL = Body(
    "ApprovalRequest",
    {
        **RUN_LEASE_FIELDS,
        "prompt": Field("string", "what the human is asked", default="", bounds=lambda: (0, 10_000)),
        "deadline_seconds": Field(
            "integer", "the approval expires after this long", default=86400, bounds=lambda: (1, 30 * 86400)
        ),
        **REPLAY_KEY_FIELDS,
    },
)
FAIL = Body(
    "FailRequest",
    {
        **RUN_LEASE_FIELDS,
        "failure_code": Field("string", "1..64 characters", required=True, bounds=lambda: (0, 64)),
        "failure_message": FINISH.fields["failure_message"],
    },
)
BATCH_FAIL = _batch("Fail", FAIL, "fail")
COMPENSATION_BEGIN = Body(
    "CompensationBeginRequest",
    {**RUN_LEASE_FIELDS, "seq": Field("integer", "entry to undo", required=True, bounds=_seq)},
)
COMPENSATION_FINISH = Body(
    "CompensationFinishRequest",
    {
        **RUN_LEASE_FIELDS,
        "seq": Field("integer", "the entry being undone", required=True, bounds=_seq),
        "ok": Field("boolean", "true: compensated; false: compensation_failed (stops the chain)", required=True),
        "error": Field("string", "what went wrong", nullable=True, bounds=lambda: (0, 10_000)),
    },
)
BATCH_COMPENSATION_BEGIN = _batch("CompensationBegin", COMPENSATION_BEGIN, "begin undoing one entry each for")
BATCH_COMPENSATION_FINISH = _batch(
    "CompensationFinish", COMPENSATION_FINISH, "record one entry's compensation each for"
)
RUN_EMIT = Body(
    "EmitRequest",
    {
        **RUN_LEASE_FIELDS,
        "chunk": Field("string", "text to append to the run's output stream (1..MAX_CHUNK_BYTES bytes of UTF-8)",
                       required=True, bounds=lambda: (0, 1024 * 1024)),
    },
)  # fmt: skip
RUN_OUTPUT = Body(
    "RunOutputRequest",
    {
        "after": Field("integer", "return the chunks after this seq (0: from the start)", default=0,
                       bounds=lambda: (0, 2**31 - 1)),
        "limit": Field("integer", "most chunks to return", default=200, bounds=lambda: (1, 1000)),
        "wait_seconds": Field(
            "number", "long-poll: wait up to this long for a chunk when there is none yet (and the run is not over)",
            default=0, bounds=_wait,
        ),
    },
)  # fmt: skip
RUN_BODIES = (ACCEPT, RUN_CLAIM, HEARTBEAT, CALL, RESULT, APPROVAL, COMPLETE, BATCH_COMPLETE, BATCH_CALLS,
              BATCH_RESULTS, BATCH_HEARTBEAT, FAIL, BATCH_FAIL, COMPENSATION_BEGIN, BATCH_COMPENSATION_BEGIN,
              COMPENSATION_FINISH, BATCH_COMPENSATION_FINISH, RUN_EMIT, RUN_OUTPUT, BATCH_STEPS)  # fmt: skip
BODIES = (CLAIM, RENEW, FINISH, BATCH_FINISH, BATCH_RENEW)

# --- workflow events (buzz_delivery.workflows, SPEC 16 "Engine waits") ----------------------------

SEND_EVENT = Body(
    "SendEventRequest",
    {
        "name": Field("string", "the event's name (1..200 of A-Z a-z 0-9 _ . : / @ -)", required=True,
                      bounds=lambda: (0, 200)),
        "key": Field("string", "the key the waiting steps computed (1..500 characters)", required=True,
                     bounds=lambda: (0, 500)),
        "payload": Field("json", "any JSON value: the output of every step it resumes"),
    },
)  # fmt: skip
EVENT_BODIES = (SEND_EVENT,)
