"""Concurrency limits by key (issue 32, docs/flow-control.md): at most N deliveries claimed at
once per key, across any number of worker processes and machines.

The operator declares the limits in the server settings, ``BUZZ_DELIVERY["CONCURRENCY_LIMITS"]``
(never anything a producer writes): a dict of key kind to its maximum, for example
``{"community": 50, "target": 4, "workflow": 10}``. The kinds are :data:`KINDS`: a community, one
target agent of a community, one workflow of a community.

The invariant lives in PostgreSQL. A claim under a limit gives each delivery it takes a *slot*
of every declared kind, a number in ``0..N-1`` kept in the delivery's ``slot_<kind>`` column, and
a partial UNIQUE index per kind (``delivery_slot_<kind>_key``, ``WHERE status = 'claimed'``)
lets no two claimed deliveries of one key hold the same slot: N slots, at most N claimed. Any
statement that moves a delivery out of ``claimed`` (a settle, a retry, the reaper taking back a
lapsed lease, an operator's force-fail) takes it out of that index in the same statement, so
its slot is free when that statement commits; nothing else has to release it. A lapsed lease
holds its slot until the reaper moves it.

The claim picks free slots in the same statement as the claim (:func:`claim_with_limits`); the
claims of one community take a transaction-scoped advisory lock first, so that each one reads
the slots its predecessors took and two claimers do not pick one slot (which the index would
refuse: the losing claim gets nothing and is tried again by :mod:`~buzz_delivery.services.leases`).
With no limit declared the claim is the plan-cached fast path, unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from buzz_delivery.conf import raw_settings
from buzz_delivery.services import sql

# The kinds of key a limit may name: (column of the delivery that holds the slot, the columns
# beside community_id that make the key).
KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "community": ("slot_community", ()),
    "target": ("slot_target", ("target_pubkey",)),
    "workflow": ("slot_workflow", ("workflow_id",)),
}
MAX_LIMIT = 1000  # slots are smallints 0..999 (CHECKed)
SETTING = "CONCURRENCY_LIMITS"
# Advisory-lock namespace of the claims under limits (one lock per community, transaction-scoped).
LIMITED_CLAIM_LOCK_NAMESPACE = 0x62756C31  # "bul1"
LOCK_COMMUNITY_CLAIMS = "SELECT pg_advisory_xact_lock(%(namespace)s, hashtext(%(community_id)s::text))"
# The same lock as the first statement of the plan-cached claim under limits (a PL/pgSQL body).
LOCK_IN_FUNCTION = (
    f"    PERFORM pg_advisory_xact_lock({LIMITED_CLAIM_LOCK_NAMESPACE}, hashtext(p_community_id::text));\n"
)


def parse_limits(value: Any) -> dict[str, int]:
    """The declared limits, validated: raises ``ImproperlyConfigured`` naming the field
    (``CONCURRENCY_LIMITS['target']``) for anything else than a dict of known kinds to ints in
    1..1000. ``None`` or ``{}``: no limit."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ImproperlyConfigured(f"BUZZ_DELIVERY[{SETTING!r}] must be a dict of key kind to a maximum")
    limits: dict[str, int] = {}
    for kind, cap in value.items():
        field = f"BUZZ_DELIVERY[{SETTING!r}][{kind!r}]"
        if kind not in KINDS:
            raise ImproperlyConfigured(f"{field}: unknown key kind; known: {', '.join(KINDS)}")
        if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= MAX_LIMIT:
            raise ImproperlyConfigured(f"{field} must be an int within 1..{MAX_LIMIT}, got {cap!r}")
        limits[kind] = int(cap)
    return dict(sorted(limits.items()))


def _free_slots(kind: str) -> str:
    """The free slots of ``kind``'s key(s) among the candidates, numbered from 1 per key."""
    column, key = KINDS[kind]
    keys = ", ".join(f"k.{c}" for c in key)
    same = "".join(f" AND h.{c} = k.{c}" for c in key)
    source = f"(SELECT DISTINCT {', '.join(key)} FROM candidate) AS k, " if key else ""
    partition = f"PARTITION BY {keys} " if key else ""
    return f"""{kind}_free AS MATERIALIZED (
    SELECT {keys + ", " if key else ""}g.slot, row_number() OVER ({partition}ORDER BY g.slot) AS rank
    FROM {source}generate_series(0, %(cap_{kind})s - 1) AS g(slot)
    WHERE NOT EXISTS (
        SELECT 1 FROM {sql.DELIVERY} AS h
        WHERE h.community_id = %(community_id)s{same} AND h.status = 'claimed' AND h.{column} = g.slot
    )
)"""


def claim_with_limits(kinds: tuple[str, ...], *, by_id: bool, by_binding: bool) -> str:
    """The claim of :func:`sql.claim_oldest_pending` under the limits of ``kinds``: the same
    candidates (same order, same locks), of which each takes, per kind, the free slot whose
    rank among its key's free slots is its own rank among the candidates of that key; one
    without a free slot in every kind stays pending. A candidate turned away by one kind still
    used its rank in the others, so a claim may take fewer than there is room for when two
    kinds bind at once (never more)."""
    base = sql.claim_oldest_pending(by_id=by_id, by_binding=by_binding)
    head, update = base.split("\nUPDATE ", 1)
    head = head.replace(
        "    SELECT d.id\n", "    SELECT d.id, d.priority, d.created_at, d.target_pubkey, d.workflow_id\n", 1
    )
    order = "ORDER BY c.priority DESC, c.created_at, c.id"
    partitions = {kind: "".join(f"PARTITION BY c.{k} " for k in KINDS[kind][1]) for kind in kinds}
    ranks = ",\n           ".join(f"row_number() OVER ({partitions[kind]}{order}) AS {kind}_rank" for kind in kinds)
    joins = "\n    ".join(
        f"JOIN {kind}_free ON {kind}_free.rank = r.{kind}_rank"
        + "".join(f" AND {kind}_free.{c} = r.{c}" for c in KINDS[kind][1])
        for kind in kinds
    )
    slots = ", ".join(f"{kind}_free.slot AS {KINDS[kind][0]}" for kind in kinds)
    ctes = ",\n".join(_free_slots(kind) for kind in kinds)
    admitted = f""",
ranked AS MATERIALIZED (
    SELECT c.id, c.target_pubkey, c.workflow_id,
           {ranks}
    FROM candidate AS c
),
{ctes},
admitted AS MATERIALIZED (
    SELECT r.id, {slots}
    FROM ranked AS r
    {joins}
)"""
    for kind in kinds:
        column = KINDS[kind][0]
        update = update.replace(f"{column} = NULL,", f"{column} = admitted.{column},", 1)
    body, where = update.split("\n-- Through the primary key only", 1)
    where = where[where.index("WHERE d.community_id") :]
    where = where.replace("d.id = ANY (ARRAY(SELECT candidate.id FROM candidate))", "d.id = admitted.id", 1)
    constant = [f"%(cap_{kind})s" for kind in kinds if not KINDS[kind][1] or kind == "target"]
    if constant:  # one community and one target per claim: more candidates could never be taken
        head = head.replace("LIMIT %(limit)s", f"LIMIT LEAST(%(limit)s, {', '.join(constant)})", 1)
    return f"{head}{admitted}\nUPDATE {body}\nFROM admitted\n{where}"


def declared_limits() -> dict[str, int]:
    """The operator's limits from the settings (read per call, like every setting)."""
    return parse_limits(raw_settings().get(SETTING))


def lost_a_slot(exc: BaseException) -> bool:
    """Whether ``exc`` is a slot index refusing a claim (a concurrent claim took that slot)."""
    from buzz_delivery.services.db import constraint_name  # (db imports the plan-cached statements)

    name = constraint_name(exc) or ""
    return any(name.startswith(f"delivery_{column}_key") for column, _ in KINDS.values())


def claim_under_any_limits() -> str:
    """The claim of :func:`claim_with_limits` for every kind at once, each kind's maximum a
    parameter that may be NULL (no limit of that kind: no slot taken, ``slot_<kind>`` NULL):
    the one text behind the plan-cached function (:data:`~buzz_delivery.services.cached.CLAIM_LIMITED`),
    which takes the community's claim lock before it in the same call."""
    text = claim_with_limits(tuple(KINDS), by_id=False, by_binding=False)
    for kind, (_, key) in KINDS.items():
        join = f"JOIN {kind}_free ON {kind}_free.rank = r.{kind}_rank" + "".join(
            f" AND {kind}_free.{c} = r.{c}" for c in key
        )
        text = text.replace(f"    {join}", f"    LEFT JOIN {kind}_free ON {join.split(' ON ', 1)[1]}", 1)
    conditions = " AND ".join(f"(%(cap_{kind})s IS NULL OR {kind}_free.slot IS NOT NULL)" for kind in KINDS)
    text = text.replace("\n)\nUPDATE ", f"\n    WHERE {conditions}\n)\nUPDATE ", 1)
    return text


def limit_params(limits: Mapping[str, int]) -> dict[str, Any]:
    return {f"cap_{kind}": cap for kind, cap in limits.items()}


_KIND_SETS = [tuple(k for i, k in enumerate(KINDS) if mask & (1 << i)) for mask in range(1, 1 << len(KINDS))]

# Every claim under limits, by (kinds, by_id, by_binding): built once at import.
LIMITED_CLAIMS: dict[tuple[tuple[str, ...], bool, bool], str] = {
    (kinds, i, b): claim_with_limits(kinds, by_id=i, by_binding=b)
    for kinds in _KIND_SETS
    for i in (False, True)
    for b in (False, True)
}
