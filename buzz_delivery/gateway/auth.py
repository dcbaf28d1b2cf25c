"""Authenticating a gateway request (SPEC section 14): NIP-98, the database clock, the replay store.

The verified event's pubkey is the caller's identity and the lease scope (the deliveries'
``target_pubkey``): no request field can name another target. Checks, cheapest first: header
shape, event shape, id, BIP-340 signature, the ``u``/``method``/``payload`` tags against this
request; then one statement judges ``created_at`` against the database clock and records the
event id, for a key enrolled in an active community (a replay or a stale event is refused, a key
enrolled nowhere is a 403 and writes nothing). Nothing else is written by a refused request.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django.http import HttpRequest

from buzz_delivery.gateway import nip98
from buzz_delivery.gateway.conf import get_settings
from buzz_delivery.gateway.errors import GatewayError
from buzz_delivery.gateway.replay import Admission, admit_event


def request_url(request: HttpRequest) -> str:
    """The absolute URL the agent must sign in its ``u`` tag: ``PUBLIC_BASE_URL`` + the path and
    query when that setting is given, else Django's ``build_absolute_uri()``."""
    base = get_settings().public_base_url
    if base:
        return base.rstrip("/") + request.get_full_path()
    return request.build_absolute_uri()


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated request's signer: ``pubkey``, and the ``active`` communities where it
    holds a live enrollment, read when its event id was recorded (the same statement)."""

    pubkey: bytes
    communities: list[uuid.UUID]


def authenticate(request: HttpRequest, body: bytes) -> bytes:
    """The 32-byte pubkey that signed this request: :func:`authenticate_caller`'s."""
    return authenticate_caller(request, body).pubkey


def authenticate_caller(request: HttpRequest, body: bytes) -> Caller:
    """The 32-byte pubkey that signed this request. Raises :class:`GatewayError` with a 401 code:
    ``auth_missing``, ``auth_invalid`` (shape, id, signature, or tags not covering this URL,
    method and ``body``), ``auth_stale`` (``created_at`` more than ``AUTH_WINDOW_SECONDS`` from
    the database clock), ``auth_replayed`` (the event id was used before), or ``not_enrolled``
    (403: the key held no live enrollment in an active community when it signed)."""
    try:
        event = nip98.verify_event(nip98.parse_header(request.headers.get("Authorization")))
        nip98.check_covers(event, url=request_url(request), method=request.method or "", body=body)
    except nip98.AuthError as exc:
        raise GatewayError(exc.code, str(exc)) from None
    window = get_settings().auth_window_seconds
    admitted = admit_event(event.event_id, event.pubkey, event.created_at, window_seconds=window)
    admission = admitted.admission
    if admission is Admission.STALE:
        raise GatewayError("auth_stale", f"the event's created_at is more than {window:g} s from the server's clock")
    if admission is Admission.REPLAYED:
        raise GatewayError("auth_replayed", "this event id was already used: sign every request afresh")
    if admission is Admission.NOT_ENROLLED:
        raise GatewayError("not_enrolled", "this key is not enrolled in any active community")
    return Caller(event.pubkey, admitted.communities)
