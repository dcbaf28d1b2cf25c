"""The holder identity a process records when it claims (``claimed_by``, issue 17)."""

from __future__ import annotations

import os
import socket

from buzz_delivery.models import HOLDER_MAX_CHARS


def holder_identity(name: str) -> str:
    """``host:pid:name``, cut to the 200 characters a holder may have (the host name gives way)."""
    tail = f":{os.getpid()}:{name}"
    host = socket.gethostname()[: max(HOLDER_MAX_CHARS - len(tail), 0)]
    return (host + tail)[:HOLDER_MAX_CHARS]
