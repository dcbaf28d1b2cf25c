"""The gateway's HTTP endpoints (SPEC section 14): thin views over the core services.

Every endpoint runs the same checks in the same order (:func:`endpoint`): method (405), body
size (413), NIP-98 signature, time window and replay (401), path and body fields (400), then
the view itself: enrollment (403), scope (404), lease (409). The signer's key is the target of
every claim, renew, finish and read; no field can name another. A refused request writes
nothing but its event id in the replay store (recorded as soon as the signature checks out, for
a key enrolled in an active community; in the request's own transaction for the run batches,
see ``endpoint(one_transaction=True)``); a key or community past its bound on requests in
flight is a 429 (:mod:`buzz_delivery.gateway.limits`).
"""

from __future__ import annotations

import logging
import random
import re
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from functools import wraps
from typing import Any

from django.core.exceptions import ValidationError
from django.db import DatabaseError, InterfaceError, OperationalError, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from buzz_delivery import jsonbounds
from buzz_delivery import services as core
from buzz_delivery.gateway import limits, present
from buzz_delivery.gateway import services as gateway
from buzz_delivery.gateway.auth import Caller, authenticate, authenticate_caller
from buzz_delivery.gateway.conf import get_settings
from buzz_delivery.gateway.errors import GatewayError, bad_request
from buzz_delivery.gateway.schema import BATCH_FINISH, BATCH_RENEW, CLAIM, FINISH, RENEW, Body
from buzz_delivery.gateway.wake import delivery_key, hub
from buzz_delivery.services import AlreadyTerminal, Lease, LeaseLost, Renewed, Settle, Settled
from buzz_delivery.services.db import node_lost
from buzz_delivery.tracing import http as tracing_http

logger = logging.getLogger("buzz_delivery.gateway")

View = Callable[..., JsonResponse]


def read_body(request: HttpRequest) -> bytes:
    """The raw body, refused with 413 when its declared length exceeds ``MAX_BODY_BYTES``
    (before it is read)."""
    limit = get_settings().max_body_bytes
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        declared = 0
    if declared > limit:
        raise GatewayError("payload_too_large", f"the body is larger than {limit} bytes")
    body = request.body
    if len(body) > limit:
        raise GatewayError("payload_too_large", f"the body is larger than {limit} bytes")
    return body


def parse_json(raw: bytes, body: Body | None) -> dict[str, Any]:
    """The request's JSON body validated against ``body`` (None: the body must be empty)."""
    if body is None:
        if raw:
            raise bad_request("body", "this request takes no body")
        return {}
    try:
        # Each field's value is checked by its Field (depth, text PostgreSQL can store), so a
        # refusal names it; a key twice, NaN or nesting the parser cannot take is the body's.
        data = jsonbounds.loads(raw, checked=False)
    except jsonbounds.JSONRefused as exc:
        raise bad_request("body", str(exc)) from None
    return body.clean(data)


def parse_uuid(name: str, value: str) -> uuid.UUID:
    """A path segment that must be a UUID (400 naming it otherwise)."""
    try:
        return uuid.UUID(value)
    except ValueError:
        raise bad_request(name, "must be a UUID") from None


def _field_of(exc: ValidationError) -> str:
    if hasattr(exc, "error_dict"):
        return next(iter(exc.error_dict))
    return "body"


def _refused(run: Callable[[], HttpResponse]) -> HttpResponse:
    """``run()``, with the refusals every endpoint shares turned into their responses."""
    try:
        return run()
    except GatewayError as exc:
        return exc.response()
    except ValidationError as exc:
        field = _field_of(exc)
        return bad_request(field, "; ".join(exc.messages)).response()
    except (OperationalError, InterfaceError) as exc:
        return _unavailable(exc)
    except DatabaseError as exc:
        # Citus losing a worker's connection mid-transaction (XX000, an InternalError), as any
        # lost connection: 503, which the clients send again, fenced (a 500 they do not: a step
        # batch's runs were given up, a settle's leases left to lapse).
        if not node_lost(exc):
            raise
        return _unavailable(exc)


def _unavailable(exc: Exception) -> HttpResponse:
    logger.warning("gateway database unavailable: %s", str(exc).strip().splitlines()[:1])
    return GatewayError("unavailable", "the database is unavailable; retry later").response()


def endpoint(
    method: str, body: Body | None = None, *, one_transaction: bool = False
) -> Callable[[View], Callable[..., HttpResponse]]:
    """Wrap a view ``view(request, pubkey, data, **path_uuids)`` in the common checks.

    ``one_transaction`` (issue 29: a holder's batch writes, which never wait): the event id is
    recorded in the same transaction as the view's writes, so the request pays one commit (one
    WAL flush) instead of two, and an id is never recorded without its request's writes nor the
    writes without the id. A refused request (any 4xx) is answered inside that
    transaction, which then commits its event id as the autocommit form does; a 503 (a
    database error, even one a savepoint contained) rolls it back, no write is kept, and its
    event id is then recorded alone: the client may send it again, signed anew. Such a view
    refuses only before it writes (its checks and reads come first), and a write it made before
    a later error stays, as in autocommit. Not for a long-poll (it would hold a transaction open
    while it waits) nor for a service that retries its own deadlocks (it does not retry inside
    a transaction)."""

    def decorate(view: View) -> Callable[..., HttpResponse]:
        @csrf_exempt
        @wraps(view)
        @tracing_http.server_span  # one span per request, child of its traceparent (when tracing)
        def wrapper(request: HttpRequest, **path: str) -> HttpResponse:
            if request.method != method:
                error = GatewayError("method_not_allowed", f"use {method} for this route")
                response = error.response()
                response["Allow"] = method
                return response

            def checked(raw: bytes, pubkey: bytes) -> HttpResponse:
                ids = {name: parse_uuid(name, value) for name, value in path.items()}
                data = parse_json(raw, body)
                # A slot of the path's community only where the key was admitted: a request
                # naming a community its key is not enrolled in (the view refuses it 403) held
                # that community's slots while it was prepared, and one community's keys had
                # another's agents refused 429.
                community = ids.get("community_id")
                if community is not None and community not in _communities(request, pubkey):
                    community = None
                with limits.request(pubkey, community):
                    return view(request, pubkey, data, **ids)

            def caller(raw: bytes) -> bytes:
                who = authenticate_caller(request, raw)
                request.buzz_gateway_caller = who  # type: ignore[attr-defined]  # see _communities
                return who.pubkey

            def serve() -> HttpResponse:
                raw = read_body(request)
                if not one_transaction:
                    return checked(raw, caller(raw))
                with transaction.atomic():
                    pubkey = caller(raw)
                    # A refusal is answered here, inside: the event id commits with it.
                    response = _refused(lambda: checked(raw, pubkey))
                    if response.status_code != 503:
                        return response
                    # A database error (a deadlock's victim in a savepoint, a lock or statement
                    # timeout) after some writes: keep none of them (the client sends a 503'd step
                    # batch again, signed anew: a kept write would apply twice)...
                    transaction.set_rollback(True)
                with suppress(GatewayError):  # ...but its id, alone: this request is not replayed
                    authenticate(request, raw)
                return response

            return _refused(serve)

        return wrapper

    return decorate


def _communities(request: HttpRequest, pubkey: bytes) -> list[uuid.UUID]:
    """The ``active`` communities where ``pubkey`` holds a live enrollment: as the statement that
    recorded the request's event id read them (issue 29: no read of its own, a transaction less
    per request), else read now."""
    caller = getattr(request, "buzz_gateway_caller", None)
    if isinstance(caller, Caller) and caller.pubkey == pubkey:
        return caller.communities
    return gateway.enrolled_communities(pubkey)


def _require_enrolled(community_id: uuid.UUID, pubkey: bytes, request: HttpRequest | None = None) -> None:
    """403 unless the key holds a live enrollment in the ``active`` community: as the request's
    admission read it (``request``), else read now."""
    enrolled = (
        community_id in _communities(request, pubkey)
        if request is not None
        else gateway.is_enrolled(community_id, pubkey)
    )
    if not enrolled:
        raise GatewayError("not_enrolled", "this key is not enrolled in that community")


def _not_found() -> GatewayError:
    return GatewayError("not_found", "no such delivery for this key in that community")


def _lost_or_not_found(community_id: uuid.UUID, delivery_id: uuid.UUID, pubkey: bytes) -> GatewayError:
    """409 when the delivery is the caller's and the lease is simply no longer current; 404
    when there is no such delivery for the caller (another key's looks the same)."""
    delivery = core.get_delivery(community_id, delivery_id)
    if delivery is None or bytes(delivery.target_pubkey) != pubkey:
        return _not_found()
    return GatewayError("lease_lost", "the lease is no longer current: drop the work", outcome="lease_lost")


def _lease(community_id: uuid.UUID, delivery_id: uuid.UUID, pubkey: bytes, generation: int) -> Lease:
    # lease_until is informational in a Lease (the database judges expiry by its own clock).
    return Lease(community_id, delivery_id, pubkey, generation, timezone.now())


def gateway_holder(pubkey: bytes) -> str:
    """The holder identity the gateway records for an agent's claims: ``gateway:<agent key hex>``."""
    return f"gateway:{bytes(pubkey).hex()}"


def _claim_round(communities: list[uuid.UUID], pubkey: bytes, limit: int, lease: float | None) -> list[core.Claim]:
    """Claim up to ``limit`` across the communities, starting at a random one (so no community
    starves another), one statement per community until the limit is reached."""
    order = list(communities)
    random.shuffle(order)
    claims: list[core.Claim] = []
    for community in order:
        claims += core.claim_deliveries(
            community, pubkey, limit=limit - len(claims), lease_seconds=lease, holder=gateway_holder(pubkey)
        )
        if len(claims) >= limit:
            break
    return claims


@endpoint("POST", CLAIM)
def claim(request: HttpRequest, pubkey: bytes, data: dict[str, Any]) -> JsonResponse:
    """Claim up to ``limit`` deliveries addressed to the signer, across every active community
    it is enrolled in; with ``wait_seconds`` > 0, long-poll until one arrives (woken by the wake
    hints) or the wait ends. 200 ``{"claims": [{"delivery", "lease"}]}`` (possibly empty);
    403 when the key is enrolled nowhere."""
    communities = _communities(request, pubkey)
    if not communities:
        raise GatewayError("not_enrolled", "this key is not enrolled in any active community")
    limit, lease_seconds, wait = data["limit"], data["lease_seconds"], float(data["wait_seconds"])
    if wait <= 0:
        claims = _claim_round(communities, pubkey, limit, lease_seconds)
    else:
        deadline = time.monotonic() + wait
        poll = get_settings().poll_seconds
        # The waiter is registered before the first claim: a delivery committed between an empty
        # claim and the sleep still sets the event, so the sleep ends at once.
        # Keyed by (community, key): a hint of a community this request does not claim in (any
        # community may send to any key) does not wake it.
        waits = (delivery_key(c, pubkey) for c in communities)
        with limits.long_poll(pubkey, communities), hub.waiter(*waits) as woken:
            claims = _claim_round(communities, pubkey, limit, lease_seconds)
            while not claims and communities:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                woken.wait(min(poll, remaining))
                woken.clear()
                # Still enrolled, and only where the admission let this request act.
                communities = [c for c in gateway.enrolled_communities(pubkey) if c in communities]
                claims = _claim_round(communities, pubkey, limit, lease_seconds)
    deliveries = [c.delivery for c in claims]
    messages = present.messages_for(deliveries)
    return JsonResponse(
        {
            "claims": [
                {
                    "delivery": present.delivery_of(
                        c.delivery, messages.get((c.delivery.community_id, bytes(c.delivery.message_event_id)))
                    ),
                    "lease": present.lease_of(c.lease),
                }
                for c in claims
            ]
        }
    )


@endpoint("GET")
def read(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID, delivery_id: uuid.UUID):
    """One of the signer's deliveries. 200 ``{"delivery"}``; 403 not enrolled there; 404 when
    there is no such delivery for this key."""
    _require_enrolled(community_id, pubkey, request)
    delivery = core.get_delivery(community_id, delivery_id)
    if delivery is None or bytes(delivery.target_pubkey) != pubkey:
        raise _not_found()
    message = present.messages_for([delivery]).get((community_id, bytes(delivery.message_event_id)))
    return JsonResponse({"delivery": present.delivery_of(delivery, message)})


@endpoint("POST", RENEW)
def renew(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID, delivery_id: uuid.UUID):
    """Extend a current lease (``services.renew_delivery``). 200 ``{"lease"}``; 409 lease lost."""
    _require_enrolled(community_id, pubkey, request)
    lease = _lease(community_id, delivery_id, pubkey, data["lease_generation"])
    outcome = core.renew_delivery(lease, data["lease_seconds"])
    if isinstance(outcome, Renewed):
        return JsonResponse({"lease": present.lease_of(outcome.lease)})
    assert isinstance(outcome, LeaseLost)
    raise _lost_or_not_found(community_id, delivery_id, pubkey)


@endpoint("POST", FINISH)
def finish(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID, delivery_id: uuid.UUID):
    """Settle once (``services.finish_delivery``). 200 ``{"outcome": "settled", "status"}``, or
    200 ``{"outcome": "already_terminal", "status"}`` for the same holder's repeat (a retry after
    a lost response is a success, and the recorded status never flips); 409 lease lost."""
    _require_enrolled(community_id, pubkey, request)
    lease = _lease(community_id, delivery_id, pubkey, data["lease_generation"])
    outcome = core.finish_delivery(
        lease,
        data["outcome"],
        failure_code=data["failure_code"],
        failure_message=data["failure_message"],
        retry_after=data["retry_after"],
    )
    if isinstance(outcome, Settled):
        return JsonResponse({"outcome": "settled", "status": outcome.status})
    if isinstance(outcome, AlreadyTerminal):
        return JsonResponse({"outcome": "already_terminal", "status": outcome.status})
    raise _lost_or_not_found(community_id, delivery_id, pubkey)


def _batch_leases(community_id: uuid.UUID, pubkey: bytes, items: list[dict[str, Any]]) -> list[Lease]:
    """The leases of a batch body's ``deliveries``, every item checked before any SQL (a 400
    naming ``deliveries[i].field``)."""
    seen: set[uuid.UUID] = set()
    leases = []
    for i, item in enumerate(items):
        delivery_id = parse_uuid(f"deliveries[{i}].delivery_id", item["delivery_id"])
        if delivery_id in seen:
            raise bad_request(f"deliveries[{i}].delivery_id", "appears twice in the batch")
        seen.add(delivery_id)
        leases.append(_lease(community_id, delivery_id, pubkey, item["lease_generation"]))
    return leases


@endpoint("POST", BATCH_RENEW)
def renew_batch(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID) -> JsonResponse:
    """Extend many of the signer's current leases in one community at once
    (``services.renew_deliveries``, one statement, each row fenced by its own lease). 200
    ``{"results": [{"delivery_id", "outcome", "lease"?}]}`` in request order, each outcome what
    the one-by-one renew answers: ``renewed`` (with the new ``lease``), ``lease_lost``, or
    ``not_found`` (no such delivery for this key); 400 naming the bad item (nothing written);
    403 not enrolled there."""
    _require_enrolled(community_id, pubkey, request)
    leases = _batch_leases(community_id, pubkey, data["deliveries"])
    outcomes = core.renew_deliveries(leases, data["lease_seconds"])
    results: list[dict[str, Any]] = []
    for lease, outcome in zip(leases, outcomes, strict=True):
        row: dict[str, Any] = {"delivery_id": str(lease.delivery_id)}
        if isinstance(outcome, Renewed):
            row.update(outcome="renewed", lease=present.lease_of(outcome.lease))
        else:  # only the leases it missed pay the read that tells lost from not found
            row["outcome"] = _lost_or_not_found(community_id, lease.delivery_id, pubkey).code
        results.append(row)
    return JsonResponse({"results": results})


_SETTLE_TEXTS = ("failure_code", "failure_message", "retry_after")
_SETTLE_ROW = re.compile(r"settles\[(\d+)\]\.(\w+)")


def _batch_settles(leases: list[Lease], data: dict[str, Any]) -> tuple[list[Settle], list[set[str]]]:
    """Each delivery's settle: its own ``outcome`` with its own failure text and ``retry_after``,
    or, naming none, the request's ``outcome`` with the request's (each field the item gives
    instead of the request's); and, per delivery, the fields it took from the request (a 400
    names those as the request's). A 400 names ``deliveries[i].outcome`` when neither names one."""
    settles: list[Settle] = []
    inherited: list[set[str]] = []
    for i, (lease, item) in enumerate(zip(leases, data["deliveries"], strict=True)):
        if item["outcome"] is not None:
            settles.append(Settle(lease, item["outcome"], **{name: item[name] for name in _SETTLE_TEXTS}))
            inherited.append(set())
            continue
        if data["outcome"] is None:
            raise bad_request(f"deliveries[{i}].outcome", "is required: here or as the request's outcome")
        taken = {"outcome", *(name for name in _SETTLE_TEXTS if item[name] is None)}
        texts = {name: data[name] if name in taken else item[name] for name in _SETTLE_TEXTS}
        settles.append(Settle(lease, data["outcome"], **texts))
        inherited.append(taken)
    # A request's failure text or retry_after that no delivery takes is refused, as the single
    # finish refuses a field its outcome does not record, not dropped (found in review).
    for name in _SETTLE_TEXTS:
        if data[name] is not None and not any(name in taken for taken in inherited):
            raise bad_request(name, "is taken by no delivery (each names its own, or its own outcome)")
    return settles, inherited


@endpoint("POST", BATCH_FINISH)
def finish_batch(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID) -> JsonResponse:
    """Settle many of the signer's leases in one community at once
    (``services.settle_deliveries``, one fenced statement, each row fenced by its own lease). Each
    delivery settles with its own ``outcome`` (``finished``, ``failed`` or ``retry``), failure
    text and ``retry_after``, or the request's. 200 ``{"results": [{"delivery_id", "outcome",
    "status"?}]}`` in request order, each outcome what the one-by-one finish answers: ``settled``
    / ``already_terminal`` (with the status), ``lease_lost``, or ``not_found`` (no such delivery
    for this key); 400 naming the bad item's field (``deliveries[2].failure_code``; nothing
    written); 403 not enrolled there."""
    _require_enrolled(community_id, pubkey, request)
    leases = _batch_leases(community_id, pubkey, data["deliveries"])
    settles, inherited = _batch_settles(leases, data)
    try:
        outcomes = core.settle_deliveries(settles)
    except ValidationError as exc:  # combinations the core refuses (failure_code with finished...)
        field = _field_of(exc)
        row = _SETTLE_ROW.fullmatch(field)
        if row:  # the item's own field, or the request's it took
            i, name = int(row.group(1)), row.group(2)
            field = name if name in inherited[i] else f"deliveries[{i}].{name}"
        raise bad_request(field, "; ".join(exc.messages)) from None
    results: list[dict[str, Any]] = []
    for lease, outcome in zip(leases, outcomes, strict=True):
        row_out: dict[str, Any] = {"delivery_id": str(lease.delivery_id)}
        if isinstance(outcome, Settled):
            row_out.update(outcome="settled", status=outcome.status)
        elif isinstance(outcome, AlreadyTerminal):
            row_out.update(outcome="already_terminal", status=outcome.status)
        else:
            row_out["outcome"] = _lost_or_not_found(community_id, lease.delivery_id, pubkey).code
        results.append(row_out)
    return JsonResponse({"results": results})


@endpoint("GET")
def me(request: HttpRequest, pubkey: bytes, data: dict[str, Any]) -> JsonResponse:
    """The signer's key and the active communities it is enrolled in. 200 ``{"pubkey", "communities"}``."""
    return JsonResponse({"pubkey": pubkey.hex(), "communities": [str(c) for c in _communities(request, pubkey)]})


def openapi(request: HttpRequest) -> HttpResponse:
    """The OpenAPI 3.1 document of this API, for the URL it was fetched under (no auth)."""
    from buzz_delivery.gateway.openapi import document

    if request.method != "GET":
        response = GatewayError("method_not_allowed", "use GET for this route").response()
        response["Allow"] = "GET"
        return response
    prefix = request.path.rsplit("/", 1)[0]
    return JsonResponse(document(server_url=prefix), json_dumps_params={"indent": 1})
