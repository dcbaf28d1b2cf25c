"""One LISTEN loop for every wake-up thread (issue 27): the delivery worker's hints, the
orchestrator's, the gateway's long-poll wake, and the agents' (whose worker should adopt it).

A NOTIFY payload is anyone's: any role may ``pg_notify`` on any channel, with any text up to
8000 bytes. A payload the handler cannot use (not JSON, nested too deeply, the wrong shape, a
handler bug) is ignored and counted (``ignored``); it never ends the loop. Any other error
(the connection lost, or anything else) closes the connection, waits ``retry_seconds`` and
starts again, LISTEN included (``restarts``): the thread lives until ``stop`` is set. Hints
only wake pollers, so nothing is lost while it restarts; ``on_listen`` runs after each
(re)connection so its owner can poll for what it may have missed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from psycopg import sql

NOTIFY_WAIT_SECONDS = 0.5

Handler = Callable[[str, str], None]


def first_line(exc: BaseException) -> str:
    """The first line of an error's text (or its class name), for a log line."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


class Listener(threading.Thread):
    """LISTENs on ``channels`` over its own autocommit psycopg connection (``conn_params``: the
    keyword arguments of ``psycopg.connect``, e.g. from Django's ``get_connection_params()``)
    and calls ``on_notify(channel, payload)`` for each notification. ``on_listen()`` runs after
    every (re)connection, ``on_lost()`` after every loss. Counters: ``notifications``,
    ``ignored`` (payloads ``on_notify`` raised on), ``restarts`` (errors survived)."""

    def __init__(
        self,
        *,
        name: str,
        channels: Iterable[str],
        conn_params: dict[str, Any],
        stop: threading.Event,
        on_notify: Handler,
        retry_seconds: float = 1.0,
        on_listen: Callable[[], None] | None = None,
        on_lost: Callable[[], None] | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        super().__init__(name=name, daemon=True)
        self.channels = tuple(channels)
        self.conn_params = conn_params
        self.stop = stop
        self.on_notify = on_notify
        self.retry_seconds = retry_seconds
        self.on_listen = on_listen
        self.on_lost = on_lost
        self.log = logger or logging.getLogger("buzz_delivery.listening")
        self.notifications = 0
        self.ignored = 0
        self.restarts = 0
        self._conn: psycopg.Connection[Any] | None = None

    def _listen(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(**self.conn_params, autocommit=True)
        try:
            for channel in self.channels:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        except BaseException:
            conn.close()
            raise
        return conn

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # a broken connection may fail to close: dropped anyway
                conn.close()

    def _deliver(self, channel: str, payload: str) -> None:
        self.notifications += 1
        try:
            self.on_notify(channel, payload)
        except Exception as exc:  # anyone may NOTIFY anything: never let one payload stop the loop
            self.ignored += 1
            self.log.debug("ignored_notification channel=%s error=%s", channel, first_line(exc))

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    if self._conn is None:
                        self._conn = self._listen()
                        if self.on_listen is not None:
                            self.on_listen()
                    for notify in self._conn.notifies(timeout=NOTIFY_WAIT_SECONDS):
                        self._deliver(notify.channel, notify.payload)
                except Exception as exc:
                    self.restarts += 1
                    kind = "db_unavailable" if isinstance(exc, psycopg.Error) else "listener_error"
                    self.log.warning("%s role=%s error=%s", kind, self.name, first_line(exc))
                    self._close()
                    if self.on_lost is not None:
                        with contextlib.suppress(Exception):
                            self.on_lost()
                    self.stop.wait(self.retry_seconds)
        finally:
            self._close()
