"""Shared helpers of the engine's services: JSON values, outcome reads, settings."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

from buzz_delivery import jsonbounds
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all
from buzz_delivery.services.tenancy import tenant_scoped

_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
MAX_INPUT_BYTES = 1_000_000


class BadJSON(ValueError):
    """A value is not storable JSON (``code`` says why: ``output_not_json``/``output_too_large``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def json_text(value: Any, max_bytes: int) -> str:
    """``value`` as JSON text jsonb can store, at most ``max_bytes`` and nested at most
    :data:`~buzz_delivery.jsonbounds.MAX_DEPTH` levels (so every reader, the admin's included,
    can load it back); raises :class:`BadJSON`."""
    try:
        jsonbounds.check(value, strict=False)
    except jsonbounds.JSONRefused as exc:
        raise BadJSON("output_not_json", str(exc)) from None
    try:
        text = json.dumps(value, cls=DjangoJSONEncoder, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise BadJSON("output_not_json", f"not JSON-serialisable: {exc}") from None
    if _JSON_NUL.search(text):
        raise BadJSON("output_not_json", "holds a NUL character, which jsonb cannot store")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadJSON("output_not_json", "holds a lone surrogate code point") from None
    if len(text.encode()) > max_bytes:
        raise BadJSON("output_too_large", f"serialises to more than {max_bytes} bytes")
    return text


def _by_value(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)  # 1.0 is the number 1, as jsonb compares numbers
    if isinstance(value, dict):
        return {str(k): _by_value(item) for k, item in value.items()}
    if isinstance(value, list | tuple):
        return [_by_value(item) for item in value]
    return value


def canonical_json(value: Any) -> str:
    """The text two JSON values are compared by, wherever the services judge "the same input"
    (``start_run``'s and ``intake_event``'s idempotency keys): sorted keys, no spaces, numbers
    by value as jsonb compares them (``1`` and ``1.0`` are equal), and ``true`` is not ``1``
    (as Python's ``==`` would have it)."""
    return json.dumps(_by_value(value), cls=DjangoJSONEncoder, sort_keys=True, separators=(",", ":"), allow_nan=False)


def json_argument(value: Any, name: str, max_bytes: int = MAX_INPUT_BYTES) -> str:
    """Like :func:`json_text` for an argument: raises ``ValidationError`` keyed ``name``."""
    try:
        return json_text(value, max_bytes)
    except BadJSON as exc:
        raise v.invalid(name, str(exc)) from None


@tenant_scoped
def community_active(community_id: uuid.UUID) -> bool:
    rows = fetch_all(
        "SELECT deletion_state = 'active' FROM buzz_delivery_community WHERE id = %(id)s", {"id": community_id}
    )
    return bool(rows and rows[0][0])
