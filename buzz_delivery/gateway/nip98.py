"""NIP-98 HTTP auth events (SPEC section 14): build, sign, parse and verify, without Django.

The ``Authorization`` header is ``Nostr <base64 of the event JSON>``; the event is a NIP-01
event of kind 27235 whose tags name the absolute URL (``u``), the HTTP method (``method``) and,
for a request with a body, the SHA-256 of the body as lowercase hex (``payload``). Its ``id`` is
the SHA-256 of the NIP-01 serialization ``[0, pubkey, created_at, kind, tags, content]``; its
``sig`` a BIP-340 Schnorr signature of the id by ``pubkey`` (secp256k1, x-only 32-byte key),
checked with ``coincurve`` (bindings to Bitcoin Core's libsecp256k1).

Time and replay (``created_at`` within a window of the database clock, each id used once) are
judged by :mod:`buzz_delivery.gateway.auth`, which owns the database side.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import coincurve

from buzz_delivery import jsonbounds

KIND_HTTP_AUTH = 27235
SCHEME = "Nostr"
# Longest Authorization header accepted (characters); an honest event is well under 1 KiB.
MAX_HEADER_CHARS = 8192
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_HEX128 = re.compile(r"[0-9a-f]{128}\Z")
EVENT_MAX_DEPTH = 8
EVENT_KEYS = frozenset({"id", "pubkey", "created_at", "kind", "tags", "content", "sig"})


class AuthError(Exception):
    """The Authorization header is missing, malformed, badly signed or does not cover this
    request. ``code`` is stable (``auth_missing``, ``auth_invalid``); the message says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class VerifiedEvent:
    """A NIP-98 event whose id and signature checked out: ``pubkey`` and ``event_id`` are the
    32-byte values, ``created_at`` Unix seconds, ``tags`` the first value of each tag name."""

    event_id: bytes
    pubkey: bytes
    created_at: int
    tags: dict[str, str]


def body_hash(body: bytes) -> str:
    """The ``payload`` tag value of a body: SHA-256, lowercase hex."""
    return hashlib.sha256(body).hexdigest()


def serialize(pubkey_hex: str, created_at: int, kind: int, tags: list[list[str]], content: str) -> bytes:
    """The NIP-01 serialization whose SHA-256 is the event id (UTF-8, no whitespace)."""
    return json.dumps(
        [0, pubkey_hex, created_at, kind, tags, content], separators=(",", ":"), ensure_ascii=False
    ).encode("utf-8")


@functools.lru_cache(maxsize=16)
def _signer(private_key: bytes) -> tuple[coincurve.PrivateKey, str]:
    """The key object of a secret and its x-only public key (hex), made once per secret: a
    worker signs every request with the same key (issue 29: the client's CPU per request)."""
    key = coincurve.PrivateKey(private_key)
    return key, key.public_key_xonly.format().hex()


def sign_event(
    private_key: bytes, url: str, method: str, body: bytes = b"", *, created_at: int | None = None
) -> dict[str, Any]:
    """A signed NIP-98 event for one request. ``private_key``: the 32-byte secret; ``url``: the
    absolute URL exactly as sent (with its query); ``method``: e.g. ``"POST"``; ``body``: the
    exact bytes sent (a ``payload`` tag is added when it is not empty; a random ``nonce`` tag
    always, so no two events are alike); ``created_at``: Unix
    seconds (default: now, from this machine's clock; the server allows a window around its own)."""
    key, pubkey_hex = _signer(bytes(private_key))
    tags = [["u", url], ["method", method.upper()]]
    if body:
        tags.append(["payload", body_hash(body)])
    # Two identical requests within one second would otherwise be the same event, and the
    # second a replay: a random nonce tag makes every event unique (extra tags are allowed).
    tags.append(["nonce", secrets.token_hex(16)])
    stamp = int(time.time()) if created_at is None else created_at
    digest = hashlib.sha256(serialize(pubkey_hex, stamp, KIND_HTTP_AUTH, tags, "")).digest()
    return {
        "id": digest.hex(),
        "pubkey": pubkey_hex,
        "created_at": stamp,
        "kind": KIND_HTTP_AUTH,
        "tags": tags,
        "content": "",
        "sig": key.sign_schnorr(digest).hex(),
    }


def encode_header(event: dict[str, Any]) -> str:
    """The ``Authorization`` header value that carries ``event``."""
    return f"{SCHEME} " + base64.b64encode(json.dumps(event, separators=(",", ":")).encode("utf-8")).decode("ascii")


def public_key_of(private_key: bytes) -> bytes:
    """The 32-byte x-only public key (the agent's ``target_pubkey``) of a 32-byte secret."""
    return coincurve.PrivateKey(private_key).public_key_xonly.format()


def _invalid(message: str) -> AuthError:
    return AuthError("auth_invalid", message)


def parse_header(value: str | None) -> dict[str, Any]:
    """The event object carried by an ``Authorization`` header value. Raises :class:`AuthError`
    (``auth_missing`` when absent, ``auth_invalid`` when not ``Nostr <base64 JSON object>``)."""
    if not value:
        raise AuthError("auth_missing", "an Authorization: Nostr <base64 event> header is required")
    if len(value) > MAX_HEADER_CHARS:
        raise _invalid(f"the Authorization header is longer than {MAX_HEADER_CHARS} characters")
    scheme, _, token = value.strip().partition(" ")
    if scheme != SCHEME or not token:
        raise _invalid("the Authorization scheme must be 'Nostr' followed by a base64 event")
    try:
        decoded = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise _invalid("the Authorization token is not base64 of a JSON event") from None
    try:
        # An event is three levels deep (tags: a list of lists of strings); a key twice would
        # let the signed serialization and the fields read here disagree.
        event = jsonbounds.loads(decoded, max_depth=EVENT_MAX_DEPTH)
    except jsonbounds.JSONRefused as exc:
        raise _invalid(f"the Authorization event is not acceptable JSON: {exc}") from None
    if not isinstance(event, dict):
        raise _invalid("the Authorization event must be a JSON object")
    return event


def verify_event(event: dict[str, Any]) -> VerifiedEvent:
    """Check an event's shape, kind, id and BIP-340 signature. Raises :class:`AuthError`
    (``auth_invalid``) naming what is wrong; says nothing about time, URL, method or body."""
    if set(event) != EVENT_KEYS:
        raise _invalid(f"the event must have exactly the fields {', '.join(sorted(EVENT_KEYS))}")
    pubkey, event_id, sig = event["pubkey"], event["id"], event["sig"]
    created_at, kind, tags, content = event["created_at"], event["kind"], event["tags"], event["content"]
    if not (isinstance(pubkey, str) and _HEX64.match(pubkey)):
        raise _invalid("event.pubkey must be 64 lowercase hex characters")
    if not (isinstance(event_id, str) and _HEX64.match(event_id)):
        raise _invalid("event.id must be 64 lowercase hex characters")
    if not (isinstance(sig, str) and _HEX128.match(sig)):
        raise _invalid("event.sig must be 128 lowercase hex characters")
    if isinstance(created_at, bool) or not isinstance(created_at, int) or not 0 <= created_at <= 10**11:
        raise _invalid("event.created_at must be Unix seconds (an integer)")
    if isinstance(kind, bool) or kind != KIND_HTTP_AUTH:
        raise _invalid(f"event.kind must be {KIND_HTTP_AUTH}")
    if not isinstance(content, str):
        raise _invalid("event.content must be a string")
    if not isinstance(tags, list) or not all(
        isinstance(tag, list) and tag and all(isinstance(part, str) for part in tag) for tag in tags
    ):
        raise _invalid("event.tags must be a list of non-empty lists of strings")
    try:
        digest = hashlib.sha256(serialize(pubkey, created_at, kind, tags, content)).digest()
    except UnicodeEncodeError:
        raise _invalid("the event holds text that is not valid Unicode") from None
    if digest.hex() != event_id:
        raise _invalid("event.id is not the SHA-256 of the event's NIP-01 serialization")
    try:
        ok = coincurve.PublicKeyXOnly(bytes.fromhex(pubkey)).verify(bytes.fromhex(sig), digest)
    except ValueError:
        ok = False
    if not ok:
        raise _invalid("event.sig is not a valid BIP-340 signature of event.id by event.pubkey")
    first: dict[str, str] = {}
    for tag in tags:
        if len(tag) >= 2:
            first.setdefault(tag[0], tag[1])
    return VerifiedEvent(event_id=digest, pubkey=bytes.fromhex(pubkey), created_at=created_at, tags=first)


def check_covers(event: VerifiedEvent, *, url: str, method: str, body: bytes) -> None:
    """Check that a verified event covers this request: ``u`` equals ``url`` exactly, ``method``
    equals ``method``, ``payload`` equals the body's SHA-256 (required when the body is not
    empty). Raises :class:`AuthError` (``auth_invalid``) naming the tag."""
    if event.tags.get("u") != url:
        raise _invalid("the event's u tag is not this request's absolute URL")
    if event.tags.get("method") != method.upper():
        raise _invalid("the event's method tag is not this request's method")
    payload = event.tags.get("payload")
    if payload is None:
        if body:
            raise _invalid("a request with a body needs a payload tag (SHA-256 of the body, hex)")
    elif payload != body_hash(body):
        raise _invalid("the event's payload tag is not the SHA-256 of this request's body")
