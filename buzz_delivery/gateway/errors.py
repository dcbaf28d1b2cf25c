"""Errors of the gateway's HTTP API as JSON (SPEC section 14): ``{"code", "message", "field"?}``.

Stable codes and their statuses:

====================  ======  ==========================================================
code                  status  when
====================  ======  ==========================================================
bad_request           400     a field is missing, extra, of the wrong type or out of range
                              (``field`` names it; ``body`` for bad JSON / not an object)
auth_missing          401     no ``Authorization: Nostr ...`` header
auth_invalid          401     malformed event, bad id or signature, or u/method/payload
                              tags that do not cover this request
auth_stale            401     ``created_at`` outside the window of the database clock
auth_replayed         401     that event id was already used
not_enrolled          403     the key is not enrolled in that community (or in any, for a
                              claim); says nothing about the community's deliveries
not_found             404     no such delivery for this key in that community (another
                              key's delivery looks exactly like a missing one)
method_not_allowed    405     wrong HTTP method for the route
lease_lost            409     renew/finish with a lease that is no longer current
                              (``outcome``: ``lease_lost``)
payload_too_large     413     body larger than ``BUZZ_GATEWAY['MAX_BODY_BYTES']``
too_many_requests     429     this key (or community) already has as many requests or
                              long-polls in flight on this server as its bound allows
                              (``Retry-After`` says when to try again)
unavailable           503     the database could not be reached; retry later
====================  ======  ==========================================================
"""

from __future__ import annotations

from typing import Any

from django.http import JsonResponse

STATUS_OF_CODE: dict[str, int] = {
    "bad_request": 400,
    "auth_missing": 401,
    "auth_invalid": 401,
    "auth_stale": 401,
    "auth_replayed": 401,
    "not_enrolled": 403,
    "not_found": 404,
    "method_not_allowed": 405,
    "lease_lost": 409,
    "payload_too_large": 413,
    "too_many_requests": 429,
    "unavailable": 503,
}


class GatewayError(Exception):
    """A refusal the API answers with ``STATUS_OF_CODE[code]`` and a JSON error body.
    ``field`` names the offending field of a 400; ``extra`` adds keys (e.g. ``outcome``)."""

    def __init__(self, code: str, message: str, *, field: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.status = STATUS_OF_CODE[code]
        self.field = field
        self.extra = extra

    def response(self) -> JsonResponse:
        """The JSON response of this error."""
        body: dict[str, Any] = {"code": self.code, "message": str(self)}
        if self.field is not None:
            body["field"] = self.field
        body.update(self.extra)
        response = JsonResponse(body, status=self.status)
        if self.status == 401:
            response["WWW-Authenticate"] = "Nostr"
        if "retry_after" in self.extra:
            response["Retry-After"] = str(self.extra["retry_after"])
        return response


def bad_request(field: str, message: str) -> GatewayError:
    """A 400 naming ``field``."""
    return GatewayError("bad_request", f"{field}: {message}", field=field)
