"""The concurrency limits pages (issue 32, docs/flow-control.md): each declared kind of a
concurrency-limit setting with its maximum per key, and per key that holds slots the slots held
and, for a key at its limit, its waiters (the rows of that key no claim takes until a slot of the
key is free). Read-only: the slots are written only by the claims; the limits are settings,
never rows.

One page per setting, on the admin of the rows that hold the slots: the deliveries'
``CONCURRENCY_LIMITS`` (:data:`DELIVERIES`, the delivery admin), the agent runs'
``AGENT_CONCURRENCY_LIMITS`` and the workflow steps' ``STEP_CONCURRENCY_LIMITS`` (declared by
:mod:`buzz_delivery.agents.admin` and :mod:`buzz_delivery.workflows.admin`, which add the page
with :class:`ConcurrencyPageMixin`). A :class:`SlotTable` says what one page reads.

How it reads (Citus's router form, SPEC 15): one walk lists the communities that hold a slot of
any declared kind (one index probe per community on the kind's partial UNIQUE index; a
pushed-down join of colocated tables on Citus), then per community and kind one statement groups
its rows holding a slot by key, and one more counts the waiters of its keys at the limit, each
count capped at :data:`WAITERS_CAP`. Every statement after the walk names its community, so it
runs on that community's node alone. At most :data:`COMMUNITIES` communities and
:data:`KEYS_PER_COMMUNITY` keys per community and kind are shown, the busiest keys first.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse

from buzz_delivery.services import flow
from buzz_delivery.services.sql import COMMUNITY, LIVE_DELIVERIES

COMMUNITIES = 50
KEYS_PER_COMMUNITY = 50
WAITERS_CAP = 10_000


@dataclass(frozen=True)
class SlotTable:
    """What one concurrency page reads (every SQL fragment over alias ``d``, the table's rows).

    ``held``: the condition of the rows that hold slots (the state(s) the slot indexes cover);
    ``kinds``: kind -> (slot column, the columns beside ``community_id`` naming the key of a row
    holding a slot); ``pending``: the condition of the waiting rows; ``waiter_keys``: kind -> the
    same key as expressions over a waiting row (and ``join``, the tables those need, each naming
    the community); ``key_types``: kind -> the SQL types of the key's columns. The words:
    ``noun`` (``deliveries``), ``held_word`` (``claimed``), ``waiting`` (what a waiter is),
    ``freed_by`` (what frees a slot)."""

    setting: str
    declared: Callable[[], dict[str, int]]
    table: str
    held: str
    kinds: Mapping[str, tuple[str, tuple[str, ...]]]
    pending: str
    waiter_keys: Mapping[str, tuple[str, ...]]
    key_types: Mapping[str, tuple[str, ...]]
    noun: str
    held_word: str
    waiting: str
    freed_by: str
    join: str = ""


DELIVERIES = SlotTable(
    setting=flow.SETTING,
    declared=flow.declared_limits,
    table=LIVE_DELIVERIES,
    held="d.status = 'claimed'",
    kinds=flow.KINDS,
    pending="d.status = 'pending'",
    waiter_keys={kind: tuple(f"d.{c}" for c in key) for kind, (_, key) in flow.KINDS.items()},
    key_types={"community": (), "target": ("bytea",), "workflow": ("uuid",)},
    noun="deliveries",
    held_word="claimed",
    waiting="pending deliveries",
    freed_by="settled, retried or reaped",
)


def _holds_a_slot(kinds: list[str], alias: str = "d", source: SlotTable = DELIVERIES) -> str:
    return " OR ".join(f"{alias}.{source.kinds[kind][0]} IS NOT NULL" for kind in kinds)


def communities_holding_slots(kinds: list[str], source: SlotTable = DELIVERIES) -> str:
    """The walk: communities (id order after ``%(after)s``) with a row of ``source`` holding a
    slot of one of ``kinds``."""
    return f"""
SELECT c.id, c.name FROM {COMMUNITY} AS c
WHERE c.id > %(after)s
  AND EXISTS (SELECT 1 FROM {source.table} AS d
              WHERE d.community_id = c.id AND {source.held} AND ({_holds_a_slot(kinds, "d", source)}))
ORDER BY c.id
LIMIT %(page)s
"""


def held_by_key(kind: str, source: SlotTable = DELIVERIES) -> str:
    """One community's rows holding a slot of ``kind``, grouped by key, busiest first."""
    column, key = source.kinds[kind]
    columns = ", ".join(f"d.{c}" for c in key)
    return f"""
SELECT {columns + ", " if key else ""}count(*) AS held
FROM {source.table} AS d
WHERE d.community_id = %(community_id)s AND {source.held} AND d.{column} IS NOT NULL
{f"GROUP BY {columns} " if key else ""}ORDER BY held DESC{", " + columns if key else ""}
LIMIT %(rows)s
"""


def _key_param(i: int) -> str:
    return "keys" if i == 0 else f"keys_{i}"


def _key_name(i: int) -> str:
    return "key" if i == 0 else f"key_{i}"


def waiters_of(kind: str, source: SlotTable = DELIVERIES) -> str:
    """One community's waiting rows per key of ``kind`` among the keys at their limit (one array
    parameter per key column: ``%(keys)s``, ``%(keys_1)s``, ...), each count capped at ``%(cap)s``."""
    key = source.waiter_keys[kind]
    join = f" {source.join}" if source.join else ""
    pending = f"SELECT 1 FROM {source.table} AS d{join} WHERE d.community_id = %(community_id)s AND {source.pending}"
    if not key:
        return f"SELECT count(*) FROM ({pending} LIMIT %(cap)s) AS w"
    same = "".join(f" AND {expr} = k.{_key_name(i)}" for i, expr in enumerate(key))
    names = ", ".join(f"k.{_key_name(i)}" for i in range(len(key)))
    arrays = ", ".join(f"%({_key_param(i)})s::{t}[]" for i, t in enumerate(source.key_types[kind]))
    return f"""
SELECT {names}, (SELECT count(*) FROM ({pending}{same} LIMIT %(cap)s) AS w)
FROM unnest({arrays}) AS k({", ".join(_key_name(i) for i in range(len(key)))})
"""


@dataclass(frozen=True)
class KeyUse:
    """One key of a kind in one community: ``held`` slots of ``limit``; ``waiters`` its waiting
    rows when it is at its limit (None below it), capped at :data:`WAITERS_CAP`."""

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


def _value(value: Any) -> Any:
    return bytes(value) if isinstance(value, memoryview) else value


def _part_text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.hex()
    return "" if value is None else str(value)


def _key_text(kind: str, value: Any) -> str:
    if kind == "target":
        return bytes(value).hex()
    return _part_text(value)


def load_concurrency_use(source: SlotTable = DELIVERIES) -> ConcurrencyUse:
    """Read each declared kind's use, per community (see the module's docstring)."""
    declared = source.declared()
    kinds = {kind: KindUse(kind, cap) for kind, cap in declared.items()}
    if not declared:
        return ConcurrencyUse([], 0, False)
    with connection.cursor() as cursor:
        walk = communities_holding_slots(list(declared), source)
        cursor.execute(walk, {"after": uuid.UUID(int=0), "page": COMMUNITIES + 1})
        found = cursor.fetchall()
        for community_id, name in found[:COMMUNITIES]:
            for kind, cap in declared.items():
                params: dict[str, Any] = {"community_id": community_id, "rows": KEYS_PER_COMMUNITY, "cap": WAITERS_CAP}
                cursor.execute(held_by_key(kind, source), params)
                held = [(tuple(_value(v) for v in row[:-1]), row[-1]) for row in cursor.fetchall()]
                full = [key for key, n in held if n >= cap]
                width = len(source.waiter_keys[kind])
                waiting: dict[Any, int] = {}
                if full and not width:
                    cursor.execute(waiters_of(kind, source), params)
                    waiting[()] = cursor.fetchone()[0]
                elif full:
                    arrays = {_key_param(i): [key[i] for key in full] for i in range(width)}
                    cursor.execute(waiters_of(kind, source), {**params, **arrays})
                    waiting = {tuple(_value(v) for v in row[:-1]): row[-1] for row in cursor.fetchall()}
                for key, n in held:
                    kinds[kind].keys.append(
                        KeyUse(
                            community_id=community_id,
                            community_name=name,
                            key=" / ".join(_key_text(kind, v) for v in key) if key else "(the community)",
                            held=n,
                            limit=cap,
                            waiters=waiting.get(key, 0) if n >= cap else None,
                        )
                    )
    for use in kinds.values():
        use.keys.sort(key=lambda k: (-k.held, str(k.community_id), k.key))
    return ConcurrencyUse(list(kinds.values()), min(len(found), COMMUNITIES), len(found) > COMMUNITIES)


class ConcurrencyPageMixin:
    """A ModelAdmin's ``concurrency/`` page over :attr:`concurrency_source` (the view permission
    on the model, like the list), linked from its list (``concurrency_url`` in the context)."""

    concurrency_source: SlotTable
    admin_site: admin.AdminSite
    opts: Any

    def _concurrency_url_name(self, view: str) -> str:
        return f"{self.opts.app_label}_{self.opts.model_name}_{view}"

    def get_urls(self) -> list[Any]:
        page = path(
            "concurrency/",
            self.admin_site.admin_view(self.concurrency_view),
            name=self._concurrency_url_name("concurrency"),
        )
        return [page, *super().get_urls()]  # type: ignore[misc]

    def concurrency_view(self, request: HttpRequest) -> HttpResponse:
        """GET: each declared limit of the source's setting, the slots held per key and the
        waiters of the keys at their limit (:func:`load_concurrency_use`). Read-only."""
        if not self.has_view_permission(request):  # type: ignore[attr-defined]
            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Concurrency limits",
            "use": load_concurrency_use(self.concurrency_source),
            "page": self.concurrency_source,
            "changelist_url": reverse(f"admin:{self._concurrency_url_name('changelist')}"),
        }
        return TemplateResponse(request, "admin/buzz_delivery/concurrency.html", context)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        extra = {
            "concurrency_url": reverse(f"admin:{self._concurrency_url_name('concurrency')}"),
            **(extra_context or {}),
        }
        return super().changelist_view(request, extra)  # type: ignore[misc]
