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

from buzz_delivery.conf import get_settings as core_settings
from buzz_delivery.gateway.conf import get_settings
from buzz_delivery.gateway.errors import bad_request

INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Field:
    """One body field. ``kind``: ``integer``, ``number`` or ``string``. ``bounds`` returns
    (minimum, maximum) for numbers or (0, maxLength) for strings, read at call time."""

    kind: str
    description: str
    required: bool = False
    default: Any = None
    nullable: bool = False
    bounds: Callable[[], tuple[float, float]] | None = None
    enum: tuple[str, ...] | None = None

    def json_schema(self) -> dict[str, Any]:
        """This field as JSON Schema 2020-12."""
        schema: dict[str, Any] = {"type": [self.kind, "null"] if self.nullable else self.kind}
        if self.bounds is not None:
            low, high = self.bounds()
            if self.kind == "string":
                schema["maxLength"] = int(high)
            else:
                schema["minimum"], schema["maximum"] = low, high
        if self.enum is not None:
            schema["enum"] = list(self.enum)
        if not self.required:
            schema["default"] = self.default
        schema["description"] = self.description
        return schema

    def clean(self, name: str, value: Any) -> Any:
        """``value`` checked against this field; raises a 400 ``GatewayError`` naming ``name``."""
        if value is None:
            if self.nullable:
                return None
            raise bad_request(name, "must not be null")
        if self.kind in ("integer", "number"):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise bad_request(name, f"must be a{'n integer' if self.kind == 'integer' else ' number'}")
            if self.kind == "integer" and not isinstance(value, int):
                raise bad_request(name, "must be an integer")
            if isinstance(value, float) and not math.isfinite(value):
                raise bad_request(name, "must be a finite number")
        elif self.kind == "string" and not isinstance(value, str):
            raise bad_request(name, "must be a string")
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

    def clean(self, data: Any) -> dict[str, Any]:
        """The validated body with defaults filled in; raises a 400 naming the first bad field."""
        if not isinstance(data, dict):
            raise bad_request("body", "must be a JSON object")
        for name in data:
            if name not in self.fields:
                raise bad_request(name, "is not a field of this request")
        out = {}
        for name, spec in self.fields.items():
            if name not in data:
                if spec.required:
                    raise bad_request(name, "is required")
                out[name] = spec.default
            else:
                out[name] = spec.clean(name, data[name])
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
    },
)  # fmt: skip
BODIES = (CLAIM, RENEW, FINISH)
