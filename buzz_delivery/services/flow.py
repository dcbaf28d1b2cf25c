"""Concurrency limits by key (issue 32, docs/flow-control.md): at most N deliveries claimed at
once per key, across any number of worker processes and machines.

The operator declares the limits in the server settings, ``BUZZ_DELIVERY["CONCURRENCY_LIMITS"]``
(never anything a producer writes): a dict of key kind to its maximum, for example
``{"community": 50, "target": 4, "workflow": 10}``. The kinds are :data:`KINDS`: a community, one
target agent of a community, one workflow of a community.

The invariant lives in PostgreSQL. A claim under a limit gives each delivery it takes a *slot*
of every declared kind, a number in ``0..N-1`` kept in the ``slot_<kind>`` column of its live
queue row (issue 31, stage 2), and a partial UNIQUE index per kind
(``delivery_queue_slot_<kind>_key``, ``WHERE slot_<kind> IS NOT NULL``) lets no two deliveries
of one key hold the same slot: N slots, at most N claimed. Any statement that moves a delivery
out of ``claimed`` (a settle deletes the queue row; a retry or the reaper taking back a lapsed
lease clears the slots; an operator's force-fail) takes it out of that index in the same
statement, so its slot is free when that statement commits; nothing else has to release it. A
lapsed lease holds its slot until the reaper moves it.

The claim picks free slots in the same statement as the claim (:func:`claim_with_limits`); the
claims of one community take a transaction-scoped advisory lock first, so that each one reads
the slots its predecessors took and two claimers do not pick one slot (which the index would
refuse: the losing claim gets nothing and is tried again by :mod:`~buzz_delivery.services.leases`).
With no limit declared the claim is the plan-cached fast path, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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


def parse_limits(value: Any, setting: str = SETTING, kinds: Iterable[str] = KINDS) -> dict[str, int]:
    """The declared limits, validated: raises ``ImproperlyConfigured`` naming the field
    (``CONCURRENCY_LIMITS['target']``) for anything else than a dict of known kinds to ints in
    1..1000. ``None`` or ``{}``: no limit. ``setting`` and ``kinds``: which setting it is (the
    deliveries' by default; :data:`AGENT_SETTING`, :data:`STEP_SETTING`)."""
    known = tuple(kinds)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ImproperlyConfigured(f"BUZZ_DELIVERY[{setting!r}] must be a dict of key kind to a maximum")
    limits: dict[str, int] = {}
    for kind, cap in value.items():
        field = f"BUZZ_DELIVERY[{setting!r}][{kind!r}]"
        if kind not in known:
            raise ImproperlyConfigured(f"{field}: unknown key kind; known: {', '.join(known)}")
        if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= MAX_LIMIT:
            raise ImproperlyConfigured(f"{field} must be an int within 1..{MAX_LIMIT}, got {cap!r}")
        limits[kind] = int(cap)
    return dict(sorted(limits.items()))


def _free_slots(kind: str) -> str:
    """The free slots of ``kind``'s key(s) among the candidates, numbered from 1 per key. A slot
    is held by the queue row that carries it (every move out of claimed clears the slots, so no
    status is read: the same test as the slot's unique index, ``delivery_queue_<column>_key``)."""
    column, key = KINDS[kind]
    keys = ", ".join(f"k.{c}" for c in key)
    same = "".join(f" AND h.{c} = k.{c}" for c in key)
    source = f"(SELECT DISTINCT {', '.join(key)} FROM candidate) AS k, " if key else ""
    partition = f"PARTITION BY {keys} " if key else ""
    return f"""{kind}_free AS MATERIALIZED (
    SELECT {keys + ", " if key else ""}g.slot, row_number() OVER ({partition}ORDER BY g.slot) AS rank
    FROM {source}generate_series(0, %(cap_{kind})s - 1) AS g(slot)
    WHERE NOT EXISTS (
        SELECT 1 FROM {sql.QUEUE} AS h
        WHERE h.community_id = %(community_id)s{same} AND h.{column} = g.slot
    )
)"""


# The claim under limits' UPDATE joins the candidates, the admitted and the admitted's ids as an
# array, as the engine's claims under limits do (workflows/services/sql.py): the planner probes
# the primary key from whichever side it estimates smaller (``sql.CLAIM_FROM``). The admitted
# alone lost in generic plans: with a fleet's statistics (a community looks small) to another
# index's community prefix, with a large backlog of one target analysed to a hash join over a
# scan of the community, every row of it read on every claim (test_claim_limited_plan). The
# admitted are among the candidates (one row each): the same rows and slots as the join alone.
ADMITTED_FROM = "FROM candidate, admitted, unnest(ARRAY(SELECT admitted.id FROM admitted)) AS listed(id)"

# An expected claim names the binding, which only the record holds: one probe of its key.
_BINDING = f"""AND EXISTS (
          SELECT 1 FROM {sql.RECORD} AS b
          WHERE b.community_id = %(community_id)s AND b.id = d.id
            AND b.workflow_id = %(workflow_id)s AND b.run_id = %(run_id)s AND b.step_id = %(step_id)s
            AND b.definition_event_id = %(definition_event_id)s AND b.message_event_id = %(message_event_id)s
            AND b.cause_kind = %(cause_kind)s
            AND b.cause_event_id IS NOT DISTINCT FROM %(cause_event_id)s::bytea
            AND b.cause_scheduled_for IS NOT DISTINCT FROM %(cause_scheduled_for)s::timestamptz
            AND b.cause_webhook_invocation_id IS NOT DISTINCT FROM %(cause_webhook_invocation_id)s::uuid
      )"""
_CLAIM_ENTRY = sql.history_entry(
    "'claim'", "d.lease_generation + 1", "%(holder)s::text", status="'claimed'", attempt="d.attempt + 1"
)


def claim_with_limits(kinds: tuple[str, ...], *, by_id: bool, by_binding: bool) -> str:
    """The claim of :func:`sql.claim_oldest_pending` under the limits of ``kinds`` (issue 31,
    stage 2: on the live queue): the same candidates (same order, same locks), of which each
    takes, per kind, the free slot whose rank among its key's free slots is its own rank among
    the candidates of that key; one without a free slot in every kind stays pending. A candidate
    turned away by one kind still used its rank in the others, so a claim may take fewer than
    there is room for when two kinds bind at once (never more). The UPDATE writes the queue row
    only (its slots: not a HOT update), as :func:`sql.claim_oldest_pending`'s, and the claimed
    rows are joined to their records by key (:data:`sql.CLAIM_SELECT`); it clears the singleton
    key (a claimed delivery holds none)."""
    extra = []
    if by_id:
        extra.append("AND d.id = %(delivery_id)s")
    if by_binding:
        extra.append(_BINDING)
    limit = "%(limit)s"
    constant = [f"%(cap_{kind})s" for kind in kinds if not KINDS[kind][1] or kind == "target"]
    if constant:  # one community and one target per claim: more candidates could never be taken
        limit = f"LEAST(%(limit)s, {', '.join(constant)})"
    order = "ORDER BY c.priority DESC, c.created_at, c.id"
    partitions = {kind: "".join(f"PARTITION BY c.{k} " for k in KINDS[kind][1]) for kind in kinds}
    ranks = ",\n           ".join(f"row_number() OVER ({partitions[kind]}{order}) AS {kind}_rank" for kind in kinds)
    joins = "\n    ".join(
        f"JOIN {kind}_free ON {kind}_free.rank = r.{kind}_rank"
        + "".join(f" AND {kind}_free.{c} = r.{c}" for c in KINDS[kind][1])
        for kind in kinds
    )
    picked = ", ".join(f"{kind}_free.slot AS {KINDS[kind][0]}" for kind in kinds)
    slots = ",\n    ".join(
        f"{column} = admitted.{column}" if kind in kinds else f"{column} = NULL" for kind, (column, _) in KINDS.items()
    )
    ctes = ",\n".join(_free_slots(kind) for kind in kinds)
    if by_id:  # the hinted claim names its row: the primary key's equality
        joined, admitted_rows = "FROM admitted", "d.id = %(delivery_id)s AND d.id = admitted.id"
    else:  # by key whatever the estimates: see ADMITTED_FROM
        joined, admitted_rows = ADMITTED_FROM, "d.id = candidate.id AND d.id = admitted.id AND d.id = listed.id"
    return f"""
WITH claimed AS (
WITH candidate AS MATERIALIZED (
    SELECT d.id, d.priority, d.created_at, d.target_pubkey, d.workflow_id
    FROM {sql.QUEUE} AS d
    WHERE d.community_id = %(community_id)s
      AND d.target_pubkey = %(target_pubkey)s
      AND d.status = 'pending'
      AND (d.next_attempt_at IS NULL OR d.next_attempt_at <= {sql.DB_NOW})
      AND (d.expires_at IS NULL OR d.expires_at > {sql.DB_NOW})
      AND (d.max_attempts IS NULL OR d.attempt < d.max_attempts)
      {" ".join(extra)}
      AND {sql.ACTIVE_THIS_COMMUNITY}
    ORDER BY d.priority DESC, d.created_at, d.id
    LIMIT {limit}
    FOR UPDATE OF d SKIP LOCKED
),
ranked AS MATERIALIZED (
    SELECT c.id, c.target_pubkey, c.workflow_id,
           {ranks}
    FROM candidate AS c
),
{ctes},
admitted AS MATERIALIZED (
    SELECT r.id, {picked}
    FROM ranked AS r
    {joins}
)
UPDATE {sql.QUEUE} AS d
SET status = 'claimed',
    lease_generation = d.lease_generation + 1,
    attempt = d.attempt + 1,
    claimed_at = {sql.DB_NOW},
    lease_until = {sql.LEASE_END},
    next_attempt_at = NULL,
    claimed_by = %(holder)s,
    renewals = 0,
    {slots},
    singleton_key = NULL,
    {_CLAIM_ENTRY}
{joined}
-- Through the primary key only: no status test here (the CTE locked each candidate FOR UPDATE
-- after re-checking its latest version, so nothing else changed it since).
WHERE d.community_id = %(community_id)s AND {admitted_rows}
RETURNING {sql.CLAIMED_LIVE_COLUMNS}, d.id
)
SELECT {sql.CLAIM_SELECT}
FROM claimed AS q
JOIN {sql.RECORD} AS r ON r.community_id = %(community_id)s AND r.id = q.id
"""


def declared_limits() -> dict[str, int]:
    """The operator's limits from the settings (read per call, like every setting)."""
    return parse_limits(raw_settings().get(SETTING))


# -- Agent runs and workflow steps (issue 32): the same design, their own settings. ------------
#
# ``BUZZ_DELIVERY["AGENT_CONCURRENCY_LIMITS"]``: at most N agent runs leased (``running`` or
# ``waiting_tool``) at once per key: ``agent`` (one agent of a community) and ``community``.
# ``BUZZ_DELIVERY["STEP_CONCURRENCY_LIMITS"]``: at most N workflow steps ``running`` at once per
# key: ``workflow`` (one workflow of a community), ``step`` (one step key of one workflow) and
# ``community``. A slot is a column of the row (``slot_<kind>``) under a partial UNIQUE index over
# the rows in the leased state(s) (agents migration 0019, workflows migration 0022); the claims
# (``claim_agent_runs``, ``claim_steps``) take their slots in the claim statement, under the
# community's claim lock of their own namespace (:func:`claim_holding_slots`). Every statement
# that moves a row out of its leased state(s) frees its slots; a parked run or step holds none.
AGENT_SETTING = "AGENT_CONCURRENCY_LIMITS"
AGENT_KINDS = ("agent", "community")
STEP_SETTING = "STEP_CONCURRENCY_LIMITS"
STEP_KINDS = ("community", "workflow", "step")
AGENT_CLAIM_LOCK_NAMESPACE = 0x62756C32  # "bul2"
STEP_CLAIM_LOCK_NAMESPACE = 0x62756C33  # "bul3"


def declared_agent_limits() -> dict[str, int]:
    """``AGENT_CONCURRENCY_LIMITS``, validated (``ImproperlyConfigured`` naming the field)."""
    return parse_limits(raw_settings().get(AGENT_SETTING), AGENT_SETTING, AGENT_KINDS)


def declared_step_limits() -> dict[str, int]:
    """``STEP_CONCURRENCY_LIMITS``, validated (``ImproperlyConfigured`` naming the field)."""
    return parse_limits(raw_settings().get(STEP_SETTING), STEP_SETTING, STEP_KINDS)


def all_caps(limits: Mapping[str, int], kinds: Iterable[str]) -> dict[str, int | None]:
    """The claim's ``cap_<kind>`` parameters: every kind, NULL where no limit is declared."""
    return {f"cap_{kind}": limits.get(kind) for kind in kinds}


def full_keys(name: str, table: str, leased: str, slot: str, key: tuple[str, ...]) -> str:
    """A CTE ``full_<name>``: the keys (``key`` columns of ``table``) whose every slot of ``slot``
    is held by a row in a ``leased`` state (a condition over alias ``h``); none when the cap is
    NULL. The claim leaves their candidates out, so a key at its limit never uses up the claim's
    ``LIMIT`` and starves the other keys."""
    columns = ", ".join(f"h.{c}" for c in key)
    select = columns or "true AS saturated"
    group = f"\n    GROUP BY {columns}" if key else ""
    return f"""full_{name} AS MATERIALIZED (
    SELECT {select} FROM {table} AS h
    WHERE h.community_id = %(community_id)s AND {leased} AND h.{slot} IS NOT NULL{group}
    HAVING count(*) >= %(cap_{name})s::integer
)"""


def free_slots(name: str, table: str, leased: str, slot: str, key: tuple[tuple[str, str], ...]) -> str:
    """A CTE ``<name>_free``: per key among the candidates (``key``: pairs of the candidate's
    column and the table's column naming it), the slots of ``slot`` no row in a ``leased`` state
    holds, ranked from 1 per key; none when the cap is NULL. Only the slots below ``least(cap,
    held + candidates)`` are looked at (at most ``held`` of them are taken, so every candidate of
    the key finds its rank there when the cap allows): the cost follows the slots in use, not
    the cap. Each probe reads the kind's partial UNIQUE index."""
    picked = ", ".join(f"k.{c}" for c, _ in key)
    same = "".join(f" AND h.{held} = k.{c}" for c, held in key)
    declared = f"%(cap_{name})s::integer IS NOT NULL"  # no limit of this kind: no slot looked for
    held_rows = f"SELECT count(*) FROM {table} AS h WHERE h.community_id = %(community_id)s{same} AND {leased}"
    if key:
        columns = ", ".join(c for c, _ in key)
        source = f"(SELECT {columns}, count(*) AS n FROM candidate WHERE {declared} GROUP BY {columns}) AS k"
        wanted = "k.n"
    else:
        source, wanted = f"(SELECT 1 WHERE {declared}) AS k", "(SELECT count(*) FROM candidate)"
    bound = f"least(%(cap_{name})s::integer, {wanted} + ({held_rows} AND h.{slot} IS NOT NULL))"
    partition = f"PARTITION BY {picked} " if key else ""
    return f"""{name}_free AS MATERIALIZED (
    SELECT {picked + ", " if key else ""}g.slot, row_number() OVER ({partition}ORDER BY g.slot) AS rank
    FROM {source}, generate_series(0, {bound} - 1) AS g(slot)
    WHERE NOT EXISTS (
        SELECT 1 FROM {table} AS h
        WHERE h.community_id = %(community_id)s{same} AND {leased} AND h.{slot} = g.slot
    )
)"""


def admitted(kinds: Mapping[str, tuple[str, tuple[str, ...]]], order: str) -> str:
    """The CTEs ``ranked`` and ``admitted`` over ``candidate`` (which has every key column of
    ``kinds``: kind -> (slot column, the candidate's key columns)): each candidate's rank in its
    key (``order``, over alias ``c``), and the candidates that got a free slot of that rank in
    every kind whose cap is not NULL, with their slots. Needs the ``<kind>_free`` CTEs before."""
    columns = sorted({c for _, key in kinds.values() for c in key})
    partitions = {
        kind: f"PARTITION BY {', '.join(f'c.{k}' for k in key)} " if key else "" for kind, (_, key) in kinds.items()
    }
    ranks = ",\n           ".join(
        f"row_number() OVER ({partitions[kind]}ORDER BY {order}) AS {kind}_rank" for kind in kinds
    )
    joins = "\n    ".join(
        f"LEFT JOIN {kind}_free ON {kind}_free.rank = r.{kind}_rank"
        + "".join(f" AND {kind}_free.{c} = r.{c}" for c in key)
        for kind, (_, key) in kinds.items()
    )
    slots = ", ".join(f"{kind}_free.slot AS {slot}" for kind, (slot, _) in kinds.items())
    wanted = " AND ".join(f"(%(cap_{kind})s::integer IS NULL OR {kind}_free.slot IS NOT NULL)" for kind in kinds)
    return f"""ranked AS MATERIALIZED (
    SELECT c.id{"".join(f", c.{c}" for c in columns)},
           {ranks}
    FROM candidate AS c
),
admitted AS MATERIALIZED (
    SELECT r.id{"".join(f", r.{c}" for c in columns)}, {slots}
    FROM ranked AS r
    {joins}
    WHERE {wanted}
)"""


# Tries of a claim under limits that lost a slot to a concurrent claim (a slot index refused it,
# nothing was written); the community's claim lock makes that rare.
SLOT_TRIES = 3


def claim_holding_slots(statement: str, params: Mapping[str, Any], namespace: int, index_prefix: str) -> list[Any]:
    """Run a claim under limits: the community's claim lock of ``namespace`` (transaction-scoped),
    then ``statement``, in one transaction (a savepoint inside the caller's), so each claim reads
    the slots its predecessors took. A claim refused by a slot index (a constraint named
    ``<index_prefix>...``) wrote nothing and is tried again, at most :data:`SLOT_TRIES` times.
    A transaction of its own honours a lock-wait bound the caller set
    (:func:`~buzz_delivery.services.db.lock_waits_bounded`: a worker serving several communities)."""
    from django.db import IntegrityError

    from buzz_delivery.services.db import atomic_within_bound, constraint_name, fetch_all

    lock = {"namespace": namespace, "community_id": params["community_id"]}
    for _ in range(SLOT_TRIES):
        try:
            with atomic_within_bound():
                fetch_all(LOCK_COMMUNITY_CLAIMS, lock)
                return fetch_all(statement, dict(params))
        except IntegrityError as exc:
            if not (constraint_name(exc) or "").startswith(index_prefix):
                raise
    return []


def lost_a_slot(exc: BaseException) -> bool:
    """Whether ``exc`` is a slot index refusing a claim (a concurrent claim took that slot)."""
    from buzz_delivery.services.db import constraint_name  # (db imports the plan-cached statements)

    name = constraint_name(exc) or ""
    return any(name.startswith(f"delivery_queue_{column}_key") for column, _ in KINDS.values())


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
