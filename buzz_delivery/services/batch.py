"""Batch settle and renewal (SPEC sections 4.4, 4.5 and 9): many leases of one community at once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from buzz_delivery import backoff, tracing
from buzz_delivery.conf import get_settings
from buzz_delivery.services import cached, sql
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import bytea_array, int_array, retry_deadlocks, uuid_array
from buzz_delivery.services.leases import MAX_CLAIM_BATCH, _fenced_as_nothing, checked_settle, finish_delivery
from buzz_delivery.services.tenancy import tenant_scoped
from buzz_delivery.services.types import FinishOutcome, Lease, LeaseLost, Renewed, RenewOutcome, Settle, Settled

BATCH_OUTCOMES = ("finished", "failed")


def _checked_leases(leases: Sequence[Any], name: str = "leases", kind: type = Lease) -> None:
    """A non-empty list of at most 1,000 :class:`Lease` (or :class:`Settle`: ``kind``) of one
    community, no delivery twice; a ``ValidationError`` keyed by the argument
    (``leases[2].community_id``, ``settles[2].lease.delivery_id``...) otherwise."""
    what = kind.__name__
    if isinstance(leases, str | bytes) or not isinstance(leases, Sequence):
        raise v.invalid(name, f"must be a list of {what}, not {type(leases).__name__}")
    if not leases:
        raise v.invalid(name, f"must hold at least one {what}")
    if len(leases) > MAX_CLAIM_BATCH:
        raise v.invalid(name, f"must hold at most {MAX_CLAIM_BATCH} leases, got {len(leases)}")
    # Keyed by the id's 128-bit int (hashed in C; a UUID hashes through a Python method): one
    # hash a lease, the set's size telling a repeat.
    seen: set[int] = set()
    add = seen.add
    inner = "" if kind is Lease else ".lease"
    community_id = None
    for i, item in enumerate(leases):
        if not isinstance(item, kind):
            raise v.invalid(f"{name}[{i}]", f"must be a {what}, not {type(item).__name__}")
        lease = item if kind is Lease else cast(Settle, item).lease
        if not isinstance(lease, Lease):
            raise v.invalid(f"{name}[{i}]{inner}", f"must be a Lease, not {type(lease).__name__}")
        community = lease.community_id
        if i == 0:
            community_id = community
        elif community is not community_id and community != community_id:  # one claim's share one UUID
            raise v.invalid(f"{name}[{i}]{inner}.community_id", f"differs from {name}[0]: one community per batch")
        add(lease.delivery_id.int)
        if len(seen) == i:
            raise v.invalid(f"{name}[{i}]{inner}.delivery_id", "appears twice in the batch")


def _by_id(lease: Lease) -> int:
    return lease.delivery_id.int


def _fence_params(leases: Sequence[Lease]) -> dict[str, Any]:
    """The fence's arrays of ``leases``, which the caller puts in delivery id order
    (:func:`_by_id`): each statement reaches its rows by a primary key probe per array element
    (``sql.CLAIMED_BY_KEY``), so it locks them in the arrays' order. A renewal round and a settle
    of the same leases (a remote worker renews a lease until its settle is answered: the two
    overlap by design) taking them in their own lists' orders each held a row the other waited
    for ("deadlock detected": a 503). A uuid's ``int`` orders as PostgreSQL orders the uuid.
    On a small table the planner may scan it instead (its rows in their physical order, which
    a concurrent update changes): the three batch services run again as a deadlock's victim
    (``retry_deadlocks``: each row is fenced, a rolled-back batch wrote nothing)."""
    return {
        "community_id": leases[0].community_id,
        # As array text built here: psycopg's array dumper quotes every element (db.uuid_array).
        "delivery_ids": uuid_array([lease.delivery_id for lease in leases]),
        "lease_generations": int_array([lease.lease_generation for lease in leases]),
        "target_pubkeys": bytea_array([lease.target_pubkey for lease in leases]),
    }


@retry_deadlocks
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
    params = _fence_params(sorted(leases, key=_by_id))
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
@retry_deadlocks
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
    for every row); settle a ``retry``, or rows of their own outcomes and texts, with
    :func:`settle_deliveries`.

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
    params = {
        **_fence_params(sorted(leases, key=_by_id)),
        "status": outcome,
        "failure_code": code,
        "failure_message": message,
    }
    rows = _fenced_as_nothing(cached.FINISH_MANY.call, params)
    if len(rows) == len(leases) and {status for _, status in rows} == {outcome}:
        # Every lease settled (the statement returns each of the batch's distinct rows at most
        # once), each to ``outcome``: one outcome for all (a frozen value), no per-row lookup.
        return [Settled(status=outcome)] * len(leases)
    settled = {row_id.int: status for row_id, status in rows}
    get = settled.get
    return [
        Settled(status=status)
        if (status := get(lease.delivery_id.int)) is not None
        else finish_delivery(lease, outcome, failure_code=code, failure_message=message)
        for lease in leases
    ]


@tracing.traced("buzz.settle")
@retry_deadlocks
@tenant_scoped
def settle_deliveries(settles: Sequence[Settle]) -> list[FinishOutcome]:
    """Settle up to 1,000 leases of one community, each with its own outcome, in one statement
    (a remote worker's flush of finished, failed and retried results; issue 29).

    ``settles``: a non-empty list of :class:`Settle`, their leases as for
    :func:`finish_deliveries` (one community, no delivery twice), each with the arguments
    :func:`finish_delivery` takes: ``outcome`` ``finished``, ``failed`` or ``retry``, and
    ``failure_code`` / ``failure_message`` / ``retry_after`` where that outcome takes them.

    Returns one outcome per row, in row order, each exactly what :func:`finish_delivery` would
    have returned for it: the same guard per row (community, id, target and generation match,
    ``claimed``, ``lease_until >= now()``, community active), the same writes (a retry backs off
    with its own jitter, not before its ``retry_after``, and ends ``failed`` /
    ``attempts_exhausted`` on the last allowed attempt; one history entry per row), so a stale
    row is refused while the others settle. Rows the statement did not settle are passed to
    :func:`finish_delivery` (its fenced read tells :class:`AlreadyTerminal`, a repeated retry's
    ``Settled("pending")`` and :class:`LeaseLost` apart). Both forms are plan-cached functions
    that first lock the rows' runs in run id order when they are of more than one run (issue
    31): one outcome and one text for every row and no retry takes :func:`finish_deliveries`'s
    (``cached.FINISH_MANY``), any other batch ``cached.SETTLE_MANY``. Raises
    ``ValidationError`` keyed by row (``settles[2].failure_code``...) before any SQL.
    """
    _checked_leases(settles, "settles", Settle)
    rows = [
        (x, *checked_settle(x.outcome, x.failure_code, x.failure_message, x.retry_after, f"settles[{i}]."))
        for i, x in enumerate(settles)
    ]
    ordered = sorted(rows, key=lambda row: row[0].lease.delivery_id.int)  # (see _fence_params)
    params = _fence_params([x.lease for x, _, _, _ in ordered])
    kinds = {(x.outcome, code, message) for x, code, message, _ in rows}
    if len(kinds) == 1 and settles[0].outcome != "retry":
        outcome, code, message = kinds.pop()
        params.update(status=outcome, failure_code=code, failure_message=message)
        settled = dict(_fenced_as_nothing(cached.FINISH_MANY.call, params))
    else:
        conf = get_settings()
        params.update(
            outcomes=[x.outcome for x, _, _, _ in ordered],
            failure_codes=[code for _, code, _, _ in ordered],
            failure_messages=[message for _, _, message, _ in ordered],
            jitters=[backoff.jitter() if x.outcome == "retry" else 1.0 for x, _, _, _ in ordered],
            retry_afters=[after or 0.0 for _, _, _, after in ordered],
            backoff_base=float(conf.retry_backoff_base_seconds),
            backoff_cap=float(conf.retry_backoff_cap_seconds),
        )
        settled = dict(_fenced_as_nothing(cached.SETTLE_MANY.call, params))
    return [
        Settled(status=settled[x.lease.delivery_id])
        if x.lease.delivery_id in settled
        else finish_delivery(x.lease, x.outcome, failure_code=code, failure_message=message, retry_after=after)
        for x, code, message, after in rows
    ]
