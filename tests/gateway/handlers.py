"""Handlers for the remote worker tests (``python -m buzz_delivery.gateway.client work``).

``scripted``: by step id prefix: ``perm_`` raises a permanent failure, ``retry_`` a plain
exception, anything else returns. Sleeps ``GATEWAY_HANDLER_SLEEP`` seconds first and appends
the delivery id to ``GATEWAY_HANDLER_LOG`` when it starts.
"""

from __future__ import annotations

import os
import time

from buzz_delivery.gateway.client import PermanentFailure


class BadPayload(PermanentFailure):
    pass


def scripted(delivery: dict) -> None:
    log = os.environ.get("GATEWAY_HANDLER_LOG")
    if log:
        with open(log, "a") as out:
            out.write(delivery["id"] + "\n")
    time.sleep(float(os.environ.get("GATEWAY_HANDLER_SLEEP", "0")))
    if delivery["step_id"].startswith("perm_"):
        raise BadPayload("cannot parse")
    if delivery["step_id"].startswith("retry_"):
        raise RuntimeError("try again")
