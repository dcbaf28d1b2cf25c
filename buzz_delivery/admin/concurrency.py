"""The concurrency limits page (issue 32, docs/flow-control.md): each declared kind of
``BUZZ_DELIVERY["CONCURRENCY_LIMITS"]`` with its maximum per key, and per key that holds slots
the slots held and, for a key at its limit, its waiters (the pending deliveries of that key: no
claim takes one of them until a slot of the key is free). Read-only: the slots are written only
by the claims of :mod:`buzz_delivery.services.flow`; the limits are settings, never rows.

How it reads (Citus's router form, SPEC 15): one walk lists the communities that hold a slot of
any declared kind (one index probe per community on the claimed-lease index; a pushed-down join
of colocated tables on Citus), then per community and kind one statement groups its claimed
deliveries holding a slot by key, and one more counts the waiters of its keys at the limit, each
count capped at :data:`WAITERS_CAP` (the polling index for a target). Every statement after the
walk names its community, so it runs on that community's node alone. At most
:data:`COMMUNITIES` communities and :data:`KEYS_PER_COMMUNITY` keys per community and kind are
shown, the busiest keys first.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from django.db import connection

from buzz_delivery.services import flow
from buzz_delivery.services.sql import COMMUNITY, DELIVERY

COMMUNITIES = 50
KEYS_PER_COMMUNITY = 50
WAITERS_CAP = 10_000


def _holds_a_slot(kinds: list[str], alias: str = "d") -> str:
    return " OR ".join(f"{alias}.{flow.KINDS[kind][0]} IS NOT NULL" for kind in kinds)


def communities_holding_slots(kinds: list[str]) -> str:
    """The walk: communities (id order after ``%(after)s``) with a claimed delivery holding a
    slot of one of ``kinds``."""
    return f"""
SELECT c.id, c.name FROM {COMMUNITY} AS c
WHERE c.id > %(after)s
  AND EXISTS (SELECT 1 FROM {DELIVERY} AS d
              WHERE d.community_id = c.id AND d.status = 'claimed' AND ({_holds_a_slot(kinds)}))
ORDER BY c.id
LIMIT %(page)s
"""


def held_by_key(kind: str) -> str:
    """One community's claimed deliveries holding a slot of ``kind``, grouped by key, busiest first."""
    column, key = flow.KINDS[kind]
    columns = ", ".join(f"d.{c}" for c in key)
    return f"""
SELECT {columns + ", " if key else ""}count(*) AS held
FROM {DELIVERY} AS d
WHERE d.community_id = %(community_id)s AND d.status = 'claimed' AND d.{column} IS NOT NULL
{f"GROUP BY {columns} " if key else ""}ORDER BY held DESC{", " + columns if key else ""}
LIMIT %(rows)s
"""


_KEY_TYPES = {"target_pubkey": "bytea", "workflow_id": "uuid"}


def waiters_of(kind: str) -> str:
    """One community's pending deliveries per key of ``kind`` among ``%(keys)s`` (the keys at
    their limit), each count capped at ``%(cap)s``."""
    _, key = flow.KINDS[kind]
    pending = f"SELECT 1 FROM {DELIVERY} AS d WHERE d.community_id = %(community_id)s AND d.status = 'pending'"
    if not key:
        return f"SELECT count(*) FROM ({pending} LIMIT %(cap)s) AS w"
    (column,) = key
    return f"""
SELECT k.key, (SELECT count(*) FROM ({pending} AND d.{column} = k.key LIMIT %(cap)s) AS w)
FROM unnest(%(keys)s::{_KEY_TYPES[column]}[]) AS k(key)
"""


@dataclass(frozen=True)
class KeyUse:
    """One key of a kind in one community: ``held`` slots of ``limit``; ``waiters`` its pending
    deliveries when it is at its limit (None below it), capped at :data:`WAITERS_CAP`."""

    community_id: uuid.UUID
    community_name: str
    key: str
    held: int
    limit: int
    waiters: int | None

    @property
    def at_limit(self) -> bool:
        return self.held >= self.limit

    @property
    def waiters_text(self) -> str:
        if self.waiters is None:
            return ""
        return f"{WAITERS_CAP}+" if self.waiters >= WAITERS_CAP else str(self.waiters)


@dataclass
class KindUse:
    """One declared kind: its maximum per key and the keys holding its slots."""

    kind: str
    limit: int
    keys: list[KeyUse] = field(default_factory=list)

    @property
    def held(self) -> int:
        return sum(k.held for k in self.keys)

    @property
    def keys_at_limit(self) -> int:
        return sum(1 for k in self.keys if k.at_limit)

    @property
    def waiters(self) -> int:
        return sum(k.waiters or 0 for k in self.keys)


@dataclass
class ConcurrencyUse:
    kinds: list[KindUse]
    communities: int
    more_communities: bool
    waiters_cap: int = WAITERS_CAP


def _key_text(kind: str, value: Any) -> str:
    if kind == "target":
        return bytes(value).hex()
    return "" if value is None else str(value)


def load_concurrency_use() -> ConcurrencyUse:
    """Read each declared kind's use, per community (see the module's docstring)."""
    declared = flow.declared_limits()
    kinds = {kind: KindUse(kind, cap) for kind, cap in declared.items()}
    if not declared:
        return ConcurrencyUse([], 0, False)
    with connection.cursor() as cursor:
        cursor.execute(communities_holding_slots(list(declared)), {"after": uuid.UUID(int=0), "page": COMMUNITIES + 1})
        found = cursor.fetchall()
        for community_id, name in found[:COMMUNITIES]:
            for kind, cap in declared.items():
                params = {"community_id": community_id, "rows": KEYS_PER_COMMUNITY, "cap": WAITERS_CAP}
                cursor.execute(held_by_key(kind), params)
                held = [(row[:-1], row[-1]) for row in cursor.fetchall()]
                full = [key for key, n in held if n >= cap]
                waiting: dict[Any, int] = {}
                if full and not flow.KINDS[kind][1]:
                    cursor.execute(waiters_of(kind), params)
                    waiting[()] = cursor.fetchone()[0]
                elif full:
                    cursor.execute(waiters_of(kind), {**params, "keys": [key[0] for key in full]})
                    waiting = {(bytes(k) if isinstance(k, memoryview) else k,): n for k, n in cursor.fetchall()}
                for key, n in held:
                    norm = tuple(bytes(k) if isinstance(k, memoryview) else k for k in key)
                    kinds[kind].keys.append(
                        KeyUse(
                            community_id=community_id,
                            community_name=name,
                            key=_key_text(kind, norm[0]) if norm else "(the community)",
                            held=n,
                            limit=cap,
                            waiters=waiting.get(norm, 0) if n >= cap else None,
                        )
                    )
    for use in kinds.values():
        use.keys.sort(key=lambda k: (-k.held, str(k.community_id), k.key))
    return ConcurrencyUse(list(kinds.values()), min(len(found), COMMUNITIES), len(found) > COMMUNITIES)
