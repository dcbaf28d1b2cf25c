"""Issue 29 review: a stop while a settle batch is being sent again (the gateway unreachable)
ends: the tries are bounded (SETTLE_TRIES), the batch is counted ``settle_errors``, its lease
released, and both settler threads and both claimers have ended when ``run()`` returns."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import httpx

from buzz_delivery.gateway.client import SETTLE_TRIES, RemoteClaim, RemoteLease, RemoteOutcome, RemoteWorker

FAR = (datetime.now(UTC) + timedelta(hours=1)).isoformat()


class Unreachable:
    timeout = 1.0

    def __init__(self) -> None:
        self.given = False
        self.tries = 0
        self.lock = threading.Lock()

    def claim(self, limit, *, wait_seconds=0, lease_seconds=None):
        with self.lock:
            if self.given:
                return []
            self.given = True
        return [RemoteClaim({"id": "d1", "step_id": "ok"}, RemoteLease("c1", "d1", 1, FAR))]

    def settle_many(self, settles):
        with self.lock:
            self.tries += 1
        raise httpx.ConnectError("connection refused")

    def renew_many(self, leases, lease_seconds=None):
        return [RemoteOutcome("renewed", lease=x) for x in leases]


def test_a_stop_while_a_settle_is_sent_again_ends_every_thread():
    gateway = Unreachable()
    worker: RemoteWorker

    def handler(delivery):
        worker.request_stop("SIGTERM")

    worker = RemoteWorker(gateway, handler, concurrency=2, wait_seconds=0.1, shutdown_grace=30)  # type: ignore[arg-type]
    summary = worker.run()
    assert gateway.tries == SETTLE_TRIES
    assert (summary["settle_errors"], summary["abandoned"], summary["reason"]) == (1, 0, "SIGTERM"), summary
    alive = [t.name for t in threading.enumerate() if t.name.startswith(("gateway-settler", "gateway-claimer"))]
    assert alive == []
