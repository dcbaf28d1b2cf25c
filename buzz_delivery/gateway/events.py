"""The gateway's workflow events endpoint (SPEC 16 "Engine waits"): a remote agent sends an event
to the steps of a community's workflow runs that wait for it, through
:func:`buzz_delivery.workflows.services.send_event`. Served when ``buzz_delivery.workflows`` is
installed; the signer must be enrolled in the community (403 otherwise, and when the community
is not active). The same checks as every endpoint run first (:func:`~buzz_delivery.gateway.views.endpoint`).
"""

from __future__ import annotations

import uuid
from typing import Any

from django.http import HttpRequest, JsonResponse

from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.gateway.errors import GatewayError
from buzz_delivery.gateway.present import rfc3339
from buzz_delivery.gateway.schema import SEND_EVENT
from buzz_delivery.gateway.views import _require_enrolled, endpoint
from buzz_delivery.workflows.services import send_event


@endpoint("POST", SEND_EVENT)
def send(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID) -> JsonResponse:
    """Send ``{name, key, payload}``: every step of the community waiting for (name, key) resumes
    once with the payload as its output; the event is kept for a wait that starts later. 200
    ``{"resumed", "kept_until"}``; 400 names a bad field; 403 not enrolled there."""
    _require_enrolled(community_id, pubkey, request)
    try:
        sent = send_event(community_id, data["name"], data["key"], data["payload"])
    except CommunityNotWritable:  # fenced between the enrollment check and the send
        raise GatewayError("not_enrolled", "this key is not enrolled in that community") from None
    return JsonResponse({"resumed": sent.resumed, "kept_until": rfc3339(sent.kept_until)})
