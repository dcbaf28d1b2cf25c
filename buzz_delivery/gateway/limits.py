"""Per-key and per-community bounds on what one server process serves at once (issue 27).

A gunicorn ``gthread`` worker serves at most ``--threads`` requests at a time, and a long-poll
claim holds its thread for up to ``MAX_WAIT_SECONDS``: one agent key (or the agents of one
community) opening as many long-polls as the process has threads used to starve every other
agent. Each request holds a slot of its key and, when its path names one its key was admitted
to (enrolled there: a request naming another community is refused 403 and holds none of its
slots), of its community (``MAX_REQUESTS_PER_KEY``, ``MAX_REQUESTS_PER_COMMUNITY``); a long-poll claim also holds a
long-poll slot of its key and of each community it waits on (``MAX_LONG_POLLS_PER_KEY``,
``MAX_LONG_POLLS_PER_COMMUNITY``). A request over a bound is refused at once with 429
``too_many_requests`` and ``Retry-After`` (it writes nothing and holds no thread). The counts
are this process's: size the bounds below ``--threads``.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager

from buzz_delivery.gateway.conf import get_settings
from buzz_delivery.gateway.errors import GatewayError

RETRY_AFTER_SECONDS = 1


class Slots:
    """Counts of what is in flight in this process, by name; :meth:`hold` takes one of each
    name it is given, or none of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()

    @contextmanager
    def hold(self, wanted: Iterable[tuple[str, int, str]]) -> Iterator[None]:
        """Hold one slot of each ``(name, bound, what)`` for the block; raises a 429
        ``GatewayError`` naming ``what`` when one is full (nothing held then)."""
        wanted = list(wanted)
        with self._lock:
            for name, bound, what in wanted:
                if self._held[name] >= bound:
                    raise GatewayError(
                        "too_many_requests",
                        f"{what}: at most {bound} at once on this server; retry later",
                        retry_after=RETRY_AFTER_SECONDS,
                    )
            for name, _bound, _what in wanted:
                self._held[name] += 1
        try:
            yield
        finally:
            with self._lock:
                for name, _bound, _what in wanted:
                    self._held[name] -= 1
                    if self._held[name] <= 0:
                        del self._held[name]

    def held(self, name: str) -> int:
        with self._lock:
            return self._held[name]


slots = Slots()


def request(pubkey: bytes, community_id: uuid.UUID | None) -> AbstractContextManager[None]:
    """The slots of one request of ``pubkey`` (and of the community its path names)."""
    conf = get_settings()
    wanted = [(f"request:{pubkey.hex()}", conf.max_requests_per_key, "requests of this key")]
    if community_id is not None:
        wanted.append((f"request:{community_id}", conf.max_requests_per_community, "requests into this community"))
    return slots.hold(wanted)


def long_poll(pubkey: bytes, communities: Iterable[uuid.UUID]) -> AbstractContextManager[None]:
    """The long-poll slots of a claim of ``pubkey`` that waits on ``communities``."""
    conf = get_settings()
    wanted = [(f"wait:{pubkey.hex()}", conf.max_long_polls_per_key, "long-poll claims of this key")]
    wanted += [
        (f"wait:{c}", conf.max_long_polls_per_community, f"long-poll claims into community {c}") for c in communities
    ]
    return slots.hold(wanted)
