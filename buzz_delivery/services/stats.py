"""Read-only figures for operators: what a stopping worker leaves waiting (SPEC section 7).

Nothing here changes state; every statement is a bounded index read."""

from __future__ import annotations

import uuid

from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all
from buzz_delivery.services.sql import DB_NOW, DELIVERY

# The pending rows of one community and target (delivery_pending_poll_idx) whose retry backoff
# has not passed yet.
COUNT_PENDING_RETRY = f"""
SELECT count(*) FROM {DELIVERY} AS d
WHERE d.community_id = %(community_id)s AND d.target_pubkey = %(target_pubkey)s
  AND d.status = 'pending' AND d.next_attempt_at > {DB_NOW}
"""


def count_pending_retry(community_id: uuid.UUID, target_pubkey: bytes) -> int:
    """How many deliveries of ``community_id`` and ``target_pubkey`` are ``pending`` and still
    waiting out a retry backoff (``next_attempt_at`` in the future, database clock)."""
    params = {
        "community_id": v.uuid_value(community_id, "community_id"),
        "target_pubkey": v.bytes32(target_pubkey, "target_pubkey"),
    }
    return int(fetch_all(COUNT_PENDING_RETRY, params)[0][0])
