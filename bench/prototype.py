"""PROTOTYPE, for measurement only (not part of the services): a batched settle, to show what a
``services.finish_deliveries`` would buy the batched figures. Proposed signature::

    def finish_deliveries(
        leases: Sequence[Lease], outcome: str = "finished", *,
        failure_code: str | None = None, failure_message: str | None = None,
    ) -> list[FinishOutcome]:
        '''Settle up to 1,000 leases of one community and target in one statement; outcomes in
        lease order, each exactly what finish_delivery would have returned (SPEC 4.5).'''

One ``UPDATE ... FROM unnest(ids, generations)`` with the same guard as
``FINISH_IF_CURRENT_GENERATION``; only the leases it did not settle pay the fenced read that
tells ``AlreadyTerminal`` from ``LeaseLost``. Runs on Django's connection, like the services.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

FINISH_MANY_IF_CURRENT_GENERATION = """
UPDATE buzz_delivery_delivery AS d
SET status = %(status)s, finished_at = now(), lease_until = NULL, claimed_at = NULL,
    failure_code = NULL, failure_message = NULL
FROM unnest(%(ids)s::uuid[], %(generations)s::bigint[]) AS f(id, generation)
WHERE d.community_id = %(community_id)s AND d.id = f.id AND d.target_pubkey = %(target_pubkey)s
  AND d.lease_generation = f.generation AND d.status = 'claimed' AND d.lease_until >= now()
  AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
RETURNING d.id, d.status
"""


def finish_deliveries(leases: Sequence[Any], outcome: str = "finished") -> list[Any]:
    """Settle ``leases`` (all of one community and target) ``finished``/``failed`` at once."""
    from buzz_delivery.services import Settled, finish_delivery
    from buzz_delivery.services.db import fetch_all, translated_errors

    if not leases:
        return []
    first = leases[0]
    params = {
        "status": outcome,
        "ids": [lease.delivery_id for lease in leases],
        "generations": [lease.lease_generation for lease in leases],
        "community_id": first.community_id,
        "target_pubkey": first.target_pubkey,
    }
    with translated_errors():
        settled = dict(fetch_all(FINISH_MANY_IF_CURRENT_GENERATION, params))
    outcomes: list[Any] = []
    for lease in leases:
        if lease.delivery_id in settled:
            outcomes.append(Settled(status=settled[lease.delivery_id]))
        else:  # the rare miss: the single-row path tells AlreadyTerminal from LeaseLost
            outcomes.append(finish_delivery(lease, outcome))
    return outcomes
