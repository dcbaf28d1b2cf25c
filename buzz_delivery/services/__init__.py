"""The services layer: the one place where deliveries change state (SPEC sections 4-6, 9).

Every lease comparison uses the database clock (PostgreSQL ``now()``). Bad arguments raise
:class:`django.core.exceptions.ValidationError` keyed by the argument name before any SQL
runs; an expected race (a lost lease, a miss) is a typed outcome, not an exception.
"""

from buzz_delivery.services.leases import (
    claim_deliveries,
    claim_delivery,
    finish_delivery,
    get_delivery,
    renew_delivery,
)
from buzz_delivery.services.lifecycle import PurgeResult, advance_community, purge_community
from buzz_delivery.services.operator import OperatorOutcome, force_fail_delivery, requeue_delivery
from buzz_delivery.services.producer import commit_deliveries, lock_delivery_identity
from buzz_delivery.services.reaper import reap, reap_expired_deliveries
from buzz_delivery.services.types import (
    AlreadyTerminal,
    Binding,
    Cause,
    Claim,
    Lease,
    LeaseLost,
    ReapResult,
    Renewed,
    Settled,
)

__all__ = [
    "AlreadyTerminal",
    "Binding",
    "Cause",
    "Claim",
    "Lease",
    "LeaseLost",
    "OperatorOutcome",
    "PurgeResult",
    "ReapResult",
    "Renewed",
    "Settled",
    "advance_community",
    "claim_deliveries",
    "claim_delivery",
    "commit_deliveries",
    "finish_delivery",
    "force_fail_delivery",
    "get_delivery",
    "lock_delivery_identity",
    "purge_community",
    "reap",
    "reap_expired_deliveries",
    "renew_delivery",
    "requeue_delivery",
]
