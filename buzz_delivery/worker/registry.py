"""Keeping a worker process in the live workers registry while it runs (issue 17).

:class:`Heartbeat` registers the process at start, refreshes its heartbeat from a daemon thread
every :data:`~buzz_delivery.services.workers.HEARTBEAT_SECONDS` (one more database connection,
idle between beats) and deregisters it when the ``with`` block ends. A failed heartbeat is
logged and retried at the next beat; it never stops the worker.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from types import TracebackType

from django.db import DatabaseError, close_old_connections, connections

from buzz_delivery.services.workers import HEARTBEAT_SECONDS, WorkerIdentity, deregister_worker, heartbeat_worker

logger = logging.getLogger("buzz_delivery.worker")


class Heartbeat:
    """``with Heartbeat("delivery", "run_delivery_worker", "community=..."):`` keeps this process
    registered as a live worker of that ``kind`` (see :class:`~buzz_delivery.models.WorkerKind`)."""

    def __init__(self, kind: str, name: str, detail: str = "", *, every: float = HEARTBEAT_SECONDS) -> None:
        self.identity = WorkerIdentity(
            id=uuid.uuid4(), kind=kind, host=socket.gethostname()[:255], pid=os.getpid(), name=name, detail=detail
        )
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="buzz-delivery-heartbeat", daemon=True)

    def _beat(self) -> None:
        try:
            heartbeat_worker(self.identity)
        except DatabaseError as exc:
            logger.warning("heartbeat_failed worker=%s error=%s", self.identity.id, exc)
            close_old_connections()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.every):
                self._beat()
        finally:
            connections.close_all()

    def start(self) -> Heartbeat:
        """Register now (on the caller's connection), then beat from the background thread."""
        self._beat()
        logger.info("registered worker=%s kind=%s host=%s pid=%d", *self._shown())
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and delete this process's row (on the caller's connection)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.every + 5)
        try:
            deregister_worker(self.identity.id)
        except DatabaseError as exc:
            logger.warning("deregister_failed worker=%s error=%s; the reaper prunes it", self.identity.id, exc)

    def _shown(self) -> tuple[object, ...]:
        i = self.identity
        return (i.id, i.kind, i.host, i.pid)

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
