"""Wake hints (SPEC section 7): a thread that LISTENs on the NOTIFY channel and hands the
dispatcher the ids of deliveries committed for its (community, target) pairs.

A hint carries only identifiers (``{"community", "delivery", "target"}``) and grants nothing:
the dispatcher still claims through ``services.claim_delivery(..., delivery_id=...)``, and
polls anyway, so a missed hint (or a lost LISTEN connection) only delays work.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Collection, Iterable
from typing import Any

from buzz_delivery.listening import Listener

logger = logging.getLogger("buzz_delivery.worker")

HINT_KEYS = frozenset({"community", "delivery", "target"})
MAX_QUEUED_HINTS = 10_000

# A worker's (community, target) pair: whose deliveries it claims.
Pair = tuple[uuid.UUID, bytes]


class HintInbox:
    """Thread-safe hand-off from the listener to the dispatcher; wakes it on every put."""

    def __init__(self, wake: threading.Event) -> None:
        self._wake = wake
        self._lock = threading.Lock()
        self._ids: dict[uuid.UUID, Pair] = {}  # insertion-ordered: delivery id -> its pair
        self._at: dict[uuid.UUID, float] = {}  # delivery id -> when its hint came (monotonic)
        self._poll = False

    def put(self, delivery_id: uuid.UUID, pair: Pair) -> None:
        """Queue a hinted delivery id of ``pair`` (beyond MAX_QUEUED_HINTS the dispatcher polls
        instead)."""
        at = time.monotonic()
        with self._lock:
            if len(self._ids) < MAX_QUEUED_HINTS:
                self._ids[delivery_id] = pair
                self._at.setdefault(delivery_id, at)
            else:
                self._poll = True
        self._wake.set()

    def request_poll(self) -> None:
        """Ask for a poll (hints may have been missed, e.g. while LISTEN was reconnecting)."""
        with self._lock:
            self._poll = True
        self._wake.set()

    def drain(self) -> tuple[list[tuple[uuid.UUID, Pair]], bool]:
        """Take every queued (id, pair) (oldest hint first) and whether a poll was requested."""
        with self._lock:
            ids, poll = list(self._ids.items()), self._poll
            self._ids.clear()
            self._at.clear()
            self._poll = False
        return ids, poll

    def drain_due(
        self, held: Collection[Pair], stagger: float, now: float
    ) -> tuple[list[tuple[uuid.UUID, Pair]], bool, float | None]:
        """As :meth:`drain`, but the hints of each ``held`` pair stay queued until its oldest one
        is ``stagger`` seconds old (``now``: monotonic); then all of that pair's hints are taken
        (one window). Also returns when the first pair still held becomes due (None: none left).
        Issue 31's hint fan-out: see ``Worker.hints_lost``."""
        with self._lock:
            oldest: dict[Pair, float] = {}  # held pair -> its oldest queued hint's arrival
            for delivery_id, pair in self._ids.items():
                if pair in held and pair not in oldest:
                    oldest[pair] = self._at[delivery_id]
            waiting = {pair: at + stagger for pair, at in oldest.items() if at + stagger > now}
            ids: list[tuple[uuid.UUID, Pair]] = []
            for delivery_id, pair in list(self._ids.items()):
                if pair in waiting:
                    continue
                ids.append((delivery_id, pair))
                del self._ids[delivery_id]
                del self._at[delivery_id]
            poll = self._poll
            self._poll = False
        return ids, poll, min(waiting.values(), default=None)


def hint_keys(pairs: Iterable[Pair]) -> dict[tuple[str, str], Pair]:
    """The lookup :func:`parse_hint` takes: (community as text, target as hex) -> pair."""
    return {(str(community_id), target.hex()): (community_id, target) for community_id, target in pairs}


def parse_hint(payload: str, wanted: dict[tuple[str, str], Pair]) -> tuple[uuid.UUID, Pair] | None:
    """The delivery id and pair of a well-formed hint for one of the ``wanted`` pairs
    (:func:`hint_keys`), else None (whatever the payload: any role may NOTIFY anything)."""
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or set(data) != HINT_KEYS:
        return None
    if not isinstance(data["community"], str) or not isinstance(data["target"], str):
        return None
    pair = wanted.get((data["community"], data["target"]))
    if pair is None:
        return None
    try:
        return uuid.UUID(str(data["delivery"])), pair
    except ValueError:
        return None


class HintListener(Listener):
    """LISTENs on ``channel`` (see :class:`~buzz_delivery.listening.Listener`: any payload is
    survived, any error restarts it). Hints for one of ``pairs`` go to ``inbox``; after every
    (re)connection it requests a poll (hints may have been missed meanwhile). Stops when
    ``stop`` is set."""

    def __init__(
        self,
        *,
        channel: str,
        pairs: Iterable[Pair],
        inbox: HintInbox,
        conn_params: dict[str, Any],
        stop: threading.Event,
        retry_seconds: float,
    ) -> None:
        super().__init__(
            name="buzz-delivery-listener",
            channels=(channel,),
            conn_params=conn_params,
            stop=stop,
            on_notify=self._hint,
            retry_seconds=retry_seconds,
            on_listen=self._listening,
            logger=logger,
        )
        self.channel = channel
        self.wanted = hint_keys(pairs)
        self.inbox = inbox

    def _hint(self, channel: str, payload: str) -> None:
        hint = parse_hint(payload, self.wanted)
        if hint is not None:
            self.inbox.put(*hint)

    def _listening(self) -> None:
        if len(self.wanted) == 1:
            (community, target), *_ = self.wanted
            logger.info("listening channel=%s community=%s target=%s", self.channel, community, target)
        else:
            logger.info("listening channel=%s pairs=%d", self.channel, len(self.wanted))
        self.inbox.request_poll()
