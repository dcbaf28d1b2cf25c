"""Batch settle and renewal (SPEC sections 4.4, 4.5 and 9): many leases of one community at once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from buzz_delivery import tracing
from buzz_delivery.services import cached, sql
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import bytea_array, int_array, uuid_array
from buzz_delivery.services.leases import MAX_CLAIM_BATCH, _fenced_as_nothing, finish_delivery
from buzz_delivery.services.tenancy import tenant_scoped
from buzz_delivery.services.types import FinishOutcome, Lease, LeaseLost, Renewed, RenewOutcome, Settled

BATCH_OUTCOMES = ("finished", "failed")


def _checked_leases(leases: Sequence[Lease]) -> None:
    """A non-empty list of at most 1,000 :class:`Lease` of one community, no delivery twice;
    a ``ValidationError`` keyed by the argument (``leases[2].community_id``...) otherwise."""
    if isinstance(leases, str | bytes) or not isinstance(leases, Sequence):
        raise v.invalid("leases", f"must be a list of Lease, not {type(leases).__name__}")
    if not leases:
        raise v.invalid("leases", "must hold at least one Lease")
    if len(leases) > MAX_CLAIM_BATCH:
        raise v.invalid("leases", f"must hold at most {MAX_CLAIM_BATCH} leases, got {len(leases)}")
    first = leases[0]
    seen: set[Any] = set()
    for i, lease in enumerate(leases):
        if not isinstance(lease, Lease):
            raise v.invalid(f"leases[{i}]", f"must be a Lease, not {type(lease).__name__}")
        if lease.community_id != first.community_id:
            raise v.invalid(f"leases[{i}].community_id", "differs from leases[0]: one community per batch")
        if lease.delivery_id in seen:
            raise v.invalid(f"leases[{i}].delivery_id", "appears twice in the batch")
        seen.add(lease.delivery_id)


def _fence_params(leases: Sequence[Lease]) -> dict[str, Any]:
    return {
        "community_id": leases[0].community_id,
        # As array text built here: psycopg's array dumper quotes every element (db.uuid_array).
        "delivery_ids": uuid_array([lease.delivery_id for lease in leases]),
        "lease_generations": int_array([lease.lease_generation for lease in leases]),
        "target_pubkeys": bytea_array([lease.target_pubkey for lease in leases]),
    }


@tenant_scoped
def renew_deliveries(leases: Sequence[Lease], lease_seconds: float | None = None) -> list[RenewOutcome]:
    """Extend up to 1,000 current leases of one community to ``now() + lease_seconds`` in one
    statement (a holder's renewal round; SPEC sections 4.4 and 9).

    ``leases``: as for :func:`finish_deliveries` (one community, of one target or several, no
    delivery twice). ``lease_seconds``: as for :func:`~buzz_delivery.services.renew_delivery`
    (None = ``LEASE_SECONDS``), the same for every lease.

    Returns one outcome per lease, in lease order, each exactly what
    :func:`~buzz_delivery.services.renew_delivery` would have returned: each row is fenced by
    its own lease (community, id, target and generation match, ``claimed``, ``lease_until >=
    now()``, community active), never bumps the generation and counts the renewal; a lease the
    statement did not renew is :class:`LeaseLost` (a renewal has nothing else to tell apart).
    Raises ``ValidationError`` keyed by argument before any SQL.
    """
    _checked_leases(leases)
    params = _fence_params(leases)
    params["lease_seconds"] = v.lease_seconds(lease_seconds)
    renewed = dict(_fenced_as_nothing(sql.RENEW_MANY_IF_CURRENT_GENERATION, params))
    return [
        Renewed(
            lease=Lease.from_database(
                lease.community_id,
                lease.delivery_id,
                lease.target_pubkey,
                lease.lease_generation,
                renewed[lease.delivery_id],
            )
        )
        if lease.delivery_id in renewed
        else LeaseLost()
        for lease in leases
    ]


@tracing.traced("buzz.settle")
@tenant_scoped
def finish_deliveries(
    leases: Sequence[Lease],
    outcome: str = "finished",
    *,
    failure_code: str | None = None,
    failure_message: str | None = None,
) -> list[FinishOutcome]:
    """Settle up to 1,000 leases of one community in one statement.

    ``leases``: a non-empty list of :class:`Lease`, all of one community (of one target or of
    several: ``claim_deliveries`` returns one target's), no delivery twice. ``outcome``:
    ``"finished"`` or ``"failed"`` (with ``failure_code`` <= 64 chars and ``failure_message``
    for every row); settle a ``retry`` with :func:`finish_delivery`.

    Returns one outcome per lease, in lease order, each exactly what :func:`finish_delivery`
    would have returned: the guard is the same (community, id, target and generation match,
    ``claimed``, ``lease_until >= now()``, community active). Only the leases the statement did
    not settle pay the fenced read that tells :class:`AlreadyTerminal` from :class:`LeaseLost`.
    Raises ``ValidationError`` keyed by argument (``leases[2].community_id``...) before any SQL.
    """
    _checked_leases(leases)
    if outcome not in BATCH_OUTCOMES:
        raise v.invalid("outcome", f"must be one of {', '.join(BATCH_OUTCOMES)}, got {outcome!r}")
    code = v.optional_text(failure_code, "failure_code", 64)
    message = v.optional_text(failure_message, "failure_message", 10_000)
    if outcome == "finished" and (code is not None or message is not None):
        raise v.invalid("failure_code" if code is not None else "failure_message", "is not recorded with 'finished'")
    params = {**_fence_params(leases), "status": outcome, "failure_code": code, "failure_message": message}
    settled = dict(_fenced_as_nothing(cached.FINISH_MANY.call, params))
    return [
        Settled(status=settled[lease.delivery_id])
        if lease.delivery_id in settled
        else finish_delivery(lease, outcome, failure_code=code, failure_message=message)
        for lease in leases
    ]
