"""Fairness between communities (issue 32): the round-robin order and the share of a claim
round that the fleet-wide workers (``run_agent_worker`` over several communities, the
event-loop agent worker; ``run_workflow_worker --all`` has the same order in SQL) give each
community with work.

A claim round walks the communities with work from the one after the community the last round
ended at (by id, wrapping round), and gives each of them its share of the room (the room split
evenly, at least one each) before any gets more; what is left then goes to those that filled
their share. So a community with a backlog of any size never gets a second share while another
with work waits: the other's item is claimed in the next round, after at most the claim batch
already under way.

    >>> import uuid
    >>> a, b, c = (uuid.UUID(int=n) for n in (1, 2, 3))
    >>> [u.int for u in round_robin([c, a, b], after=a)]
    [2, 3, 1]
    >>> share(50, 3), share(2, 3), share(50, 0)
    (17, 1, 50)
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable


def round_robin(communities: Iterable[uuid.UUID], after: uuid.UUID | None) -> list[uuid.UUID]:
    """``communities`` (each once) in id order from the first after ``after``, wrapping round
    (``after`` None: from the first)."""
    ordered = sorted(set(communities))
    if after is None:
        return ordered
    return [c for c in ordered if c > after] + [c for c in ordered if c <= after]


def share(room: int, communities: int) -> int:
    """Each community's share of a round's ``room``: split evenly, rounded up, at least 1."""
    return max(1, -(-room // max(communities, 1)))
