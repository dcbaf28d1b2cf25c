"""``map`` steps (SPEC 16 "Engine waits"): one element step per item of a runtime list.

A map step runs twice. Claimed the first time, its holder resolves the list and, in one
transaction under the step's lease (:func:`expand_map`): the run row locked, the map step moved
back to ``pending`` with one dependency per item (lease released, attempts reset, ``expected``
= the number of items), one element step per item inserted ``ready`` (key ``<map>[<i>]``, its
own resolved spec, the map step as its only dependent, ``on_error: continue``), and the run's
step counters raised by as many. Each element is an ordinary step of its kind (``function``,
``send_message``, ``sub_workflow``): whatever path ends it, the Advance trigger counts it in the
map step (``deps_done``), as fan-in is counted for every step, and releases the map step once
all are in. Claimed again (``expected`` set), the holder reads the elements
(:func:`map_elements`) and completes the map step with their outputs, in order, or fails it
(``map_items_failed``) when more failed than it tolerates. An empty list completes it at once
(output ``[]``).
"""

from __future__ import annotations

import json
from typing import Any

from django.db import transaction

from buzz_delivery.services import Settled
from buzz_delivery.services.db import fetch_all, translated_errors
from buzz_delivery.services.sql import DB_NOW
from buzz_delivery.services.tenancy import tenant_scoped
from buzz_delivery.workflows.conf import NOTIFY_CHANNEL, get_settings
from buzz_delivery.workflows.services import sql
from buzz_delivery.workflows.services.sql import ACTIVE, CURRENT_STEP_LEASE, RUN, STEP, step_entry
from buzz_delivery.workflows.services.steps import _lease, _missed, _params
from buzz_delivery.workflows.services.types import StepLease, StepOutcome

EXPAND_IF_CURRENT_GENERATION = f"""
UPDATE {STEP} AS s
SET state = 'pending', lease_until = NULL, claimed_at = NULL, deps_total = %(n)s, deps_done = 0,
    deps_blocked = 0, expected = %(n)s, attempts = 0, ready_at = NULL, next_attempt_at = NULL,
    {step_entry("'expand'", "s.lease_generation", "s.claimed_by", status="'pending'", items="%(n)s")}
WHERE {CURRENT_STEP_LEASE} AND s.kind = 'map' AND s.expected IS NULL
RETURNING s.state, s.position
"""

INSERT_ELEMENTS = f"""
INSERT INTO {STEP} (id, community_id, run_id, key, kind, state, position, depends_on, dependents,
    deps_total, deps_done, deps_blocked, on_error, max_attempts, attempts, timeout_seconds,
    backoff_base_seconds, backoff_cap_seconds, lease_generation, ready_at, delivered_terminal,
    delivered_failed, tolerate_failures, map_key, item_index, spec, priority)
SELECT x.id, %(community_id)s, %(run_id)s, x.key, x.kind, 'ready', %(position)s, '{{}}', ARRAY[%(map_key)s]::text[],
    0, 0, 0, 'continue', x.max_attempts, 0, x.timeout_seconds,
    x.backoff_base_seconds, x.backoff_cap_seconds, 0, {DB_NOW}, 0,
    0, x.tolerate_failures, %(map_key)s, x.item_index, x.spec,
    (SELECT r.priority FROM {RUN} AS r WHERE r.community_id = %(community_id)s AND r.run_id = %(run_id)s)
FROM jsonb_to_recordset(%(elements)s::jsonb) AS x(id uuid, key text, kind text, max_attempts integer,
    timeout_seconds integer, backoff_base_seconds double precision, backoff_cap_seconds double precision,
    tolerate_failures integer, item_index integer, spec jsonb)
"""

COUNT_ELEMENTS_IN_RUN = f"""
UPDATE {RUN} AS r SET steps_total = r.steps_total + %(n)s, steps_left = r.steps_left + %(n)s
WHERE r.community_id = %(community_id)s AND r.run_id = %(run_id)s AND r.state = 'running' AND {ACTIVE}
RETURNING r.run_id
"""

WAKE_ORCHESTRATORS = f"SELECT pg_notify('{NOTIFY_CHANNEL}', %(community_id)s::text)"

ELEMENTS_OF_MAP = f"""
SELECT s.item_index, s.state, s.output, s.failure_code FROM {STEP} AS s
WHERE s.community_id = %(community_id)s AND s.run_id = %(run_id)s AND s.map_key = %(map_key)s
ORDER BY s.item_index
"""


def element_row(map_key: str, index: int, spec: dict[str, Any], new_id: str) -> dict[str, Any]:
    """The step row of item ``index`` of map ``map_key``; ``spec`` is its resolved spec."""
    settings = get_settings()
    retry = spec.get("retry", {})
    return {
        "id": new_id,
        "key": f"{map_key}[{index}]",
        "kind": spec["kind"],
        "max_attempts": retry.get("max_attempts", settings.max_attempts),
        "timeout_seconds": spec.get("timeout_seconds"),
        "backoff_base_seconds": retry.get("base_seconds", settings.backoff_base_seconds),
        "backoff_cap_seconds": retry.get("cap_seconds", settings.backoff_cap_seconds),
        "tolerate_failures": spec.get("tolerate_failures", 0),
        "item_index": index,
        "spec": {**spec, "key": f"{map_key}[{index}]", "depends_on": [], "on_error": "continue"},
    }


@tenant_scoped
def expand_map(lease: StepLease, map_key: str, elements: list[dict[str, Any]]) -> StepOutcome:
    """Under the map step's lease, in one transaction: the step back to ``pending`` on
    ``len(elements)`` element steps (rows of :func:`element_row`), inserted ``ready``, and the
    run's step counters raised by as many; the orchestrators are woken at commit. Returns
    ``Settled("pending")``, ``AlreadyTerminal`` or ``LeaseLost`` (nothing is inserted then).
    Internal to the executor (an empty list completes the step instead)."""
    lease = _lease(lease)
    params = _params(lease, n=len(elements), map_key=map_key, elements=json.dumps(elements))
    with transaction.atomic(), translated_errors():
        fetch_all(sql.LOCK_RUN, params)
        rows = fetch_all(EXPAND_IF_CURRENT_GENERATION, params)
        if not rows:
            return _missed(params, still_fine="pending")
        fetch_all(INSERT_ELEMENTS, {**params, "position": rows[0][1]})
        fetch_all(COUNT_ELEMENTS_IN_RUN, params)
        fetch_all(WAKE_ORCHESTRATORS, params)
    return Settled("pending")


@tenant_scoped
def map_elements(lease: StepLease, map_key: str) -> list[tuple[int, str, Any, str | None]]:
    """(index, state, output, failure code) of each element of the map step, in order."""
    rows = fetch_all(ELEMENTS_OF_MAP, {"community_id": lease.community_id, "run_id": lease.run_id, "map_key": map_key})
    return [(i, state, json.loads(out) if isinstance(out, str) else out, code) for i, state, out, code in rows]
