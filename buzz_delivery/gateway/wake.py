"""Long-poll wake-ups (SPEC sections 7 and 14): one LISTEN connection per server process.

A claim that found nothing registers a waiter for its key in each community it claims in
(:func:`delivery_key`) and sleeps until a wake hint for that (community, target) arrives on the
core's NOTIFY channel, or the poll interval passes (the fallback for a missed hint or a LISTEN
connection that is down), then claims again. A hint grants nothing: it only ends the sleep, and
the claim goes through ``services.claim_deliveries`` as always. A hint wakes only the claims of
its own community: any community's workflows may send to any key, and a hint keyed by the
target alone let one community wake (again and again) the long-polls of a key enrolled only in
another.

With ``buzz_delivery.agents`` installed the same connection also LISTENs on ``buzz_agents``,
whose hints name a community with a claimable agent run; a run claim waits on the keys
``runs:<community id>`` of the communities it is enrolled in.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connections

from buzz_delivery.conf import get_settings as core_settings
from buzz_delivery.listening import Listener

logger = logging.getLogger("buzz_delivery.gateway")

RECONNECT_SECONDS = 2.0


class WakeHub:
    """Waiters keyed by (community, target hex), woken by a daemon thread that LISTENs on the channel.

    The thread (a :class:`~buzz_delivery.listening.Listener`: any payload and any error are
    survived) starts on the first :meth:`waiter` and lives as long as the process. It opens its
    own autocommit psycopg connection with the parameters of Django's ``LISTEN_DATABASE`` alias
    (or ``default``), so it works behind a transaction pooler when that alias is direct.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, set[threading.Event]] = {}
        self._thread: Listener | None = None
        self._stop = threading.Event()  # never set: the thread lives as long as the process
        self.listening = threading.Event()

    @contextmanager
    def waiter(self, *keys: str) -> Iterator[threading.Event]:
        """An event set by every hint for one of ``keys`` (:func:`delivery_key`, or
        ``runs:<community id>``) while the block runs."""
        self._ensure_started()
        event = threading.Event()
        with self._lock:
            for key in keys:
                self._waiters.setdefault(key, set()).add(event)
        try:
            yield event
        finally:
            with self._lock:
                for key in keys:
                    group = self._waiters.get(key)
                    if group is not None:
                        group.discard(event)
                        if not group:
                            del self._waiters[key]

    def _set(self, key: str) -> None:
        with self._lock:
            for event in self._waiters.get(key, ()):
                event.set()

    def wake(self, payload: str) -> None:
        """Wake the waiters of the hint's target in the hint's community (a payload of another
        shape is ignored)."""
        data = json.loads(payload)
        if not isinstance(data, dict):
            return
        community, target = data.get("community"), data.get("target")
        if isinstance(community, str) and isinstance(target, str):
            self._set(f"{community}:{target}")

    def wake_runs(self, payload: str) -> None:
        """Wake the run claims waiting on the community a ``buzz_agents`` hint names."""
        self._set(f"runs:{payload}")

    def _ensure_started(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                alias = core_settings().listen_database or "default"
                params = connections[alias].get_connection_params()
                channel, runs_channel = core_settings().notify_channel, agents_channel()

                def hint(notified: str, payload: str) -> None:
                    if notified == runs_channel:
                        self.wake_runs(payload)
                    else:
                        self.wake(payload)

                def listening() -> None:
                    self.listening.set()
                    logger.info("gateway listening channel=%s runs_channel=%s", channel, runs_channel)

                self._thread = Listener(
                    name="buzz-gateway-wake",
                    channels=[c for c in (channel, runs_channel) if c],
                    conn_params=params,
                    stop=self._stop,
                    on_notify=hint,
                    retry_seconds=RECONNECT_SECONDS,
                    on_listen=listening,
                    on_lost=self.listening.clear,
                    logger=logger,
                )
                self._thread.start()


def delivery_key(community_id: uuid.UUID, pubkey: bytes) -> str:
    """The waiter key of a delivery claim of ``pubkey`` in ``community_id``: what a hint of that
    community for that target wakes (the core's hint names the community as the text of its
    UUID, the target as lowercase hex)."""
    return f"{community_id}:{pubkey.hex()}"


def agents_channel() -> str | None:
    """The agents' NOTIFY channel when ``buzz_delivery.agents`` is installed, else None."""
    from django.apps import apps

    if not apps.is_installed("buzz_delivery.agents"):
        return None
    from buzz_delivery.agents.conf import NOTIFY_CHANNEL

    return NOTIFY_CHANNEL


hub = WakeHub()
