"""One LISTEN loop for every wake-up thread (issue 27): the delivery worker's hints, the
orchestrator's, the gateway's long-poll wake, and the agents' worker's.

A NOTIFY payload is anyone's: any role may ``pg_notify`` on any channel, with any text up to
8000 bytes. A payload the handler cannot use (not JSON, nested too deeply, the wrong shape, a
handler bug) is ignored and counted (``ignored``); it never ends the loop. Any other error
(the connection lost, or anything else) closes the connection, waits ``retry_seconds`` and
starts again, LISTEN included (``restarts``): the thread lives until ``stop`` is set. Hints
only wake pollers, so nothing is lost while it restarts; ``on_listen`` runs after each
(re)connection so its owner can poll for what it may have missed.

``pause(True)`` closes its connections until ``pause(False)``: an owner that polls anyway and needs
no hints for a while (a workflow orchestrator that follows a live leader, issue 31) holds no
listening backend, which PostgreSQL would signal on every notifying commit of the database,
whatever the channel. Resuming LISTENs again and runs ``on_listen`` as any (re)connection does.

On a Citus coordinator it LISTENs on every other active primary node too (read from the
coordinator's ``pg_dist_node`` at each (re)connection, with the same connection parameters but
the node's host and port): a trigger on a shard sends its NOTIFY on the node that holds the shard,
where a listener of the coordinator alone never hears it (docs/scale-out.md).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from psycopg import sql

NOTIFY_WAIT_SECONDS = 0.5
NODE_RETRY_SECONDS = 10.0  # a Citus node that could not be reached is tried again after this
NODE_REFRESH_SECONDS = 300.0  # a Citus coordinator's node list is read again after this

Handler = Callable[[str, str], None]


def first_line(exc: BaseException) -> str:
    """The first line of an error's text (or its class name), for a log line."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


# The other active primary nodes of a Citus cluster, seen from the node connected to (none without
# Citus): where the shards are, and where their triggers' NOTIFYs are sent.
OTHER_NODES = """
SELECT n.nodename, n.nodeport FROM pg_catalog.pg_dist_node AS n
WHERE n.isactive AND n.noderole = 'primary'
  AND n.groupid <> (SELECT g.groupid FROM pg_catalog.pg_dist_local_group AS g)
ORDER BY n.nodeid
"""


def other_nodes(conn: psycopg.Connection[Any]) -> list[tuple[str, int]]:
    """``(host, port)`` of the Citus cluster's other active primary nodes, or ``[]`` when the
    database has no Citus metadata."""
    (citus,) = conn.execute("SELECT to_regclass('pg_catalog.pg_dist_node') IS NOT NULL").fetchone()  # type: ignore[misc]
    if not citus:
        return []
    return [(host, int(port)) for host, port in conn.execute(OTHER_NODES).fetchall()]


class Listener(threading.Thread):
    """LISTENs on ``channels`` over its own autocommit psycopg connection (``conn_params``: the
    keyword arguments of ``psycopg.connect``, e.g. from Django's ``get_connection_params()``)
    and calls ``on_notify(channel, payload)`` for each notification. ``on_listen()`` runs after
    every (re)connection, ``on_lost()`` after every loss. Counters: ``notifications``,
    ``ignored`` (payloads ``on_notify`` raised on), ``restarts`` (errors survived), ``pauses``
    (times :meth:`pause` closed its connections)."""

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
        self.pauses = 0
        self._paused = False
        self._resumed = threading.Event()  # set by pause(False): a paused loop LISTENs again at once
        self._conns: list[psycopg.Connection[Any]] = []
        self._relisten_at: float | None = None  # when to read a cluster's nodes again (monotonic)

    def pause(self, paused: bool) -> None:
        """Stop listening (``True``: the connections are closed within
        :data:`NOTIFY_WAIT_SECONDS`) or listen again (``False``: at once, then ``on_listen``).
        Any thread may call it; calling it again with the same value does nothing."""
        if paused == self._paused:
            return
        self._paused = paused
        if not paused:
            self._resumed.set()

    @property
    def paused(self) -> bool:
        return self._paused

    def _subscribe(self, conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
        try:
            for channel in self.channels:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        except BaseException:
            conn.close()
            raise
        return conn

    def _listen(self) -> list[psycopg.Connection[Any]]:
        """LISTEN on the database of ``conn_params`` and, on a Citus coordinator, on each other
        node (read first: a LISTEN stays each connection's last statement). A node that cannot
        be reached is logged and left out: the coordinator's hints still arrive, and the nodes
        are tried again (and their list read again) after :data:`NODE_RETRY_SECONDS`."""
        first = psycopg.connect(**self.conn_params, autocommit=True)
        try:
            nodes = other_nodes(first)
        except BaseException:
            first.close()
            raise
        conns = [self._subscribe(first)]
        missing = 0
        for host, port in nodes:
            params = {**self.conn_params, "host": host, "port": port}
            try:
                conns.append(self._subscribe(psycopg.connect(**params, autocommit=True)))
            except Exception as exc:  # one node down or refusing us must not silence the others
                missing += 1
                self.log.warning("node_unreachable role=%s node=%s:%s error=%s", self.name, host, port, first_line(exc))
        # On a cluster the node list is read again now and then (nodes come and go), and sooner
        # while one is missing.
        self._relisten_at = (
            time.monotonic() + (NODE_RETRY_SECONDS if missing else NODE_REFRESH_SECONDS) if nodes else None
        )
        return conns

    def _close(self) -> None:
        conns, self._conns = self._conns, []
        for conn in conns:
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
                    if self._paused:
                        if self._conns:
                            self.pauses += 1
                            self._close()
                        self._resumed.wait(NOTIFY_WAIT_SECONDS)  # the stop is looked at as often
                        self._resumed.clear()  # (the flag is read again first: nothing is lost)
                        continue
                    if not self._conns:
                        self._conns = self._listen()
                        if self.on_listen is not None:
                            self.on_listen()
                    if self._relisten_at is not None and time.monotonic() >= self._relisten_at:
                        self._close()  # read the nodes again (on_listen then polls what a gap hid)
                        continue
                    if len(self._conns) == 1:
                        for notify in self._conns[0].notifies(timeout=NOTIFY_WAIT_SECONDS):
                            self._deliver(notify.channel, notify.payload)
                        continue
                    # Several nodes: wait for any of them, then take what each has (not waiting).
                    # A selector, not select(): a descriptor past 1023 (a busy worker) is fine.
                    with selectors.DefaultSelector() as selector:
                        for conn in self._conns:
                            selector.register(conn.fileno(), selectors.EVENT_READ)
                        selector.select(NOTIFY_WAIT_SECONDS)
                    for conn in self._conns:
                        for notify in conn.notifies(timeout=0):
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
