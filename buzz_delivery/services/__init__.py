"""The services layer: the one place where deliveries change state (SPEC sections 4-6, 9).

Every lease comparison uses the database clock (PostgreSQL ``now()``). Bad arguments raise
:class:`django.core.exceptions.ValidationError` keyed by the argument name before any SQL
runs; an expected race (a lost lease, a miss) is a typed outcome, not an exception.
"""

from buzz_delivery.services.batch import finish_deliveries, renew_deliveries, settle_deliveries
from buzz_delivery.services.leases import (
    claim_deliveries,
    claim_delivery,
    finish_delivery,
    get_delivery,
    load_snapshots,
    renew_delivery,
)
from buzz_delivery.services.lifecycle import PurgeResult, advance_community, purge_community
from buzz_delivery.services.operator import OperatorOutcome, force_fail_delivery, requeue_delivery
from buzz_delivery.services.producer import commit_deliveries, lock_delivery_identity
from buzz_delivery.services.pruner import PruneResult, prune_deliveries
from buzz_delivery.services.reaper import reap, reap_expired_deliveries
from buzz_delivery.services.runlock import (
    LeaseBusy,
    RunLease,
    acquire_run_lease,
    release_run_lease,
    renew_run_lease,
    run_lease,
)
from buzz_delivery.services.runs import expire_run_deliveries, run_deliveries_left
from buzz_delivery.services.stats import count_pending_retry
from buzz_delivery.services.types import (
    AlreadyTerminal,
    Binding,
    Cause,
    Claim,
    Lease,
    LeaseLost,
    ReapResult,
    Renewed,
    Settle,
    Settled,
)
from buzz_delivery.services.workers import (
    WorkerIdentity,
    deregister_worker,
    heartbeat_worker,
    missing_communities,
    prune_stale_workers,
    record_maintenance_run,
)

__all__ = [
    "AlreadyTerminal",
    "Binding",
    "Cause",
    "Claim",
    "Lease",
    "LeaseBusy",
    "LeaseLost",
    "OperatorOutcome",
    "PruneResult",
    "PurgeResult",
    "ReapResult",
    "Renewed",
    "RunLease",
    "Settle",
    "Settled",
    "WorkerIdentity",
    "acquire_run_lease",
    "advance_community",
    "claim_deliveries",
    "claim_delivery",
    "commit_deliveries",
    "count_pending_retry",
    "deregister_worker",
    "expire_run_deliveries",
    "finish_deliveries",
    "finish_delivery",
    "force_fail_delivery",
    "get_delivery",
    "heartbeat_worker",
    "load_snapshots",
    "lock_delivery_identity",
    "missing_communities",
    "prune_deliveries",
    "prune_stale_workers",
    "purge_community",
    "reap",
    "reap_expired_deliveries",
    "record_maintenance_run",
    "release_run_lease",
    "renew_deliveries",
    "renew_delivery",
    "renew_run_lease",
    "requeue_delivery",
    "run_deliveries_left",
    "run_lease",
    "settle_deliveries",
]
