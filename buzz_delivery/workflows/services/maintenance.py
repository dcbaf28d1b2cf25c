"""The engine's cron maintenance (SPEC section 11 "Orchestrator", "Retries and timeouts"):
lapsed step leases reclaimed (an attempt spent: ``ready`` again, or ``failed`` with
``attempts_exhausted``), step timeouts (``step_timeout``), wait timeouts (``wait_timeout``; a
timed-out ``sub_workflow`` step's child run is canceled with it), sleeps woken and
``wait_event`` timeouts under their ``on_timeout`` (:mod:`~buzz_delivery.workflows.services.waits`),
sent events past their keeping window deleted,
approval deadlines (``approval_expired``), run deadlines (``run_deadline``), and the due slots
of cron schedules started (:mod:`~buzz_delivery.workflows.services.schedules`); the pending
deliveries of runs that ended in the batch are expired (core ``expire_run_deliveries``).

Fleet-wide but walking communities (SPEC 15): one read picks candidate communities (active
ones), then per community one short transaction: the community's write-fence lock is tried
(never waited on: a community being fenced is skipped as busy), at most ``batch_size``
candidate steps are read, their runs locked (the engine's lock order: run, then steps; when of
more than one run, their core rows first, as a multi-run settle, with the core rows of every
other run the batch may end or lock: the run trees they are in, from their roots, so their
ancestors, which a run's end fails one after another under ``on_error: fail_run``, and the
running descendants of all of those, the child runs of timed-out ``sub_workflow`` waits among
them: ``sql.LOCK_RUNS_AND_TREES``), and one fenced UPDATE per kind re-checks the whole
condition on the database clock, with ``community_id`` in its own WHERE. Each of those
transactions waits on a row lock at most ``MAINTENANCE_LOCK_TIMEOUT_MS`` (``lock_timeout``): a
run or step row that a stuck transaction holds (a worker's connection left in a transaction)
skips that community for the pass, counted in ``skipped_busy``, and never stops the maintenance
of the others. Every path bumps the generation, so the old holder is fenced; Advance runs in
the same transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from django.db import OperationalError, transaction

from buzz_delivery.conf import get_settings as core_settings
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import (
    bound_lock_waits,
    fetch_all,
    lock_wait_timed_out,
    retry_deadlocks,
    translated_errors,
)
from buzz_delivery.services.sql import DB_NOW, TRY_WRITE_FENCE
from buzz_delivery.services.tenancy import fleet_scoped
from buzz_delivery.workflows.services import sql
from buzz_delivery.workflows.services.runs import expire_deliveries_of_ended_runs
from buzz_delivery.workflows.services.schedules import start_due_schedules
from buzz_delivery.workflows.services.sql import (
    ACTIVE,
    APPROVAL,
    COMMUNITY,
    LOCK_RUNS,
    LOCK_RUNS_AND_TREES,
    RUN,
    SENT_EVENT,
    STEP,
    step_entry,
)
from buzz_delivery.workflows.services.waits import PRUNE_SENT_EVENTS, WAIT_OVER, DueWaits, end_due_waits_in

logger = logging.getLogger("buzz_delivery.workflows")
R = TypeVar("R")

LAPSED = f"s.state = 'running' AND s.lease_until < {DB_NOW}"
OVERRUN = (
    f"s.state = 'running' AND s.timeout_seconds IS NOT NULL"
    # (The IMMUTABLE helper: ``timestamptz + interval`` over a column is STABLE, which Citus
    # refuses in an UPDATE's WHERE as in its SET, SPEC 15.)
    f" AND buzz_delivery_plus_seconds(s.claimed_at, s.timeout_seconds) < {DB_NOW}"
)
# A step's approval (an agent's has no step: the agents' reaper expires those, in its own order).
APPROVAL_OVER = f"a.state = 'pending' AND a.step_id IS NOT NULL AND a.deadline_at < {DB_NOW}"
RUN_OVER = f"r.state = 'running' AND r.deadline_at < {DB_NOW}"

CANDIDATE_COMMUNITIES = f"""
SELECT c.id FROM {COMMUNITY} AS c
WHERE c.deletion_state = 'active' AND (
    EXISTS (SELECT 1 FROM {STEP} AS s WHERE s.community_id = c.id AND (({LAPSED}) OR ({WAIT_OVER})))
    OR EXISTS (SELECT 1 FROM {STEP} AS s WHERE s.community_id = c.id AND {OVERRUN})
    OR EXISTS (SELECT 1 FROM {APPROVAL} AS a WHERE a.community_id = c.id AND {APPROVAL_OVER})
    OR EXISTS (SELECT 1 FROM {RUN} AS r WHERE r.community_id = c.id AND {RUN_OVER})
)
ORDER BY c.id
LIMIT %(limit)s
"""
CANDIDATE_STEPS = f"""
SELECT s.id, s.run_id FROM {STEP} AS s
WHERE s.community_id = %(community_id)s AND (({LAPSED}) OR ({WAIT_OVER}) OR ({OVERRUN}))
ORDER BY s.id LIMIT %(limit)s
"""
CANDIDATE_APPROVALS = f"""
SELECT a.id, a.run_id FROM {APPROVAL} AS a
WHERE a.community_id = %(community_id)s AND {APPROVAL_OVER}
ORDER BY a.id LIMIT %(limit)s
"""
_FENCE = "lease_generation = s.lease_generation + 1, lease_until = NULL, claimed_at = NULL"
CANDIDATE_RUNS = f"""
SELECT r.run_id FROM {RUN} AS r
WHERE r.community_id = %(community_id)s AND {RUN_OVER}
ORDER BY r.run_id LIMIT %(limit)s
"""
# The overdue runs among the candidates, read again once their rows are locked (a deadline
# extended in between is seen); each is then ended by one call (sql.END_RUN_IF_ACTIVE).
OVERDUE_LOCKED_RUNS = f"""
SELECT r.run_id FROM {RUN} AS r
WHERE r.community_id = %(community_id)s AND r.run_id = ANY(%(run_ids)s) AND {RUN_OVER}
ORDER BY r.run_id
"""
RUN_DEADLINE = {"state": "failed", "failure_code": "run_deadline", "failure_message": "the run passed its deadline"}
FAIL_OVERRUN_STEPS = f"""
UPDATE {STEP} AS s SET state = 'failed', failure_code = 'step_timeout',
    failure_message = 'the step ran longer than its timeout_seconds', {_FENCE}, finished_at = {DB_NOW},
    {step_entry("'timeout'", "s.lease_generation + 1", "'reaper'", status="'failed'", renewals="s.renewals")}
WHERE s.community_id = %(community_id)s AND s.id = ANY(%(ids)s) AND {OVERRUN} AND {ACTIVE}
RETURNING s.id
"""
RECLAIM_LAPSED_STEPS = f"""
UPDATE {STEP} AS s SET state = 'ready', failure_code = 'lease_lapsed', failure_message = NULL, {_FENCE},
    ready_at = {DB_NOW}, next_attempt_at = NULL,
    {step_entry("'reap'", "s.lease_generation + 1", "'reaper'", status="'ready'", renewals="s.renewals")}
WHERE s.community_id = %(community_id)s AND s.id = ANY(%(ids)s) AND {LAPSED}
  AND s.attempts < s.max_attempts AND {ACTIVE}
RETURNING s.id
"""
EXHAUST_LAPSED_STEPS = f"""
UPDATE {STEP} AS s SET state = 'failed', failure_code = 'attempts_exhausted',
    failure_message = 'the last attempt''s lease lapsed', {_FENCE}, finished_at = {DB_NOW},
    {step_entry("'reap'", "s.lease_generation + 1", "'reaper'", status="'failed'", renewals="s.renewals")}
WHERE s.community_id = %(community_id)s AND s.id = ANY(%(ids)s) AND {LAPSED}
  AND s.attempts >= s.max_attempts AND {ACTIVE}
RETURNING s.id
"""
EXPIRE_OVERDUE_APPROVALS = f"""
UPDATE {APPROVAL} AS a SET state = 'expired', closed_at = {DB_NOW}
WHERE a.community_id = %(community_id)s AND a.id = ANY(%(ids)s) AND {APPROVAL_OVER} AND {ACTIVE}
RETURNING a.step_id, a.step_generation
"""
FAIL_STEPS_OF_EXPIRED_APPROVALS = f"""
UPDATE {STEP} AS s SET state = 'failed', failure_code = 'approval_expired',
    failure_message = 'no decision before the approval deadline', wait_deadline = NULL, finished_at = {DB_NOW},
    {step_entry("'expire'", "s.lease_generation", "'reaper'", status="'failed'")}
WHERE s.community_id = %(community_id)s AND s.id = ANY(%(ids)s) AND s.state = 'waiting' AND {ACTIVE}
RETURNING s.id
"""
# send_message and sub_workflow waits (sleep and wait_event steps carry on_timeout: services.waits).
FAIL_OVERDUE_WAITS = f"""
UPDATE {STEP} AS s SET state = 'failed', failure_code = 'wait_timeout',
    failure_message = 'the wait ran past its wait_timeout_seconds', wait_deadline = NULL, finished_at = {DB_NOW},
    {step_entry("'expire'", "s.lease_generation", "'reaper'", status="'failed'")}
WHERE s.community_id = %(community_id)s AND s.id = ANY(%(ids)s) AND {WAIT_OVER} AND s.on_timeout IS NULL AND {ACTIVE}
RETURNING s.id, s.child_run_id
"""
COMMUNITIES_WITH_OLD_EVENTS = f"""
SELECT DISTINCT e.community_id FROM {SENT_EVENT} AS e
JOIN {COMMUNITY} AS c ON c.id = e.community_id AND c.deletion_state = 'active'
WHERE e.expires_at IS NULL OR e.expires_at < {DB_NOW}
LIMIT %(limit)s
"""
# A sub_workflow step that gave up waiting cancels its child run (and, recursively, the child's
# children): nothing goes on sending or waiting for approvals under a run that no longer waits
# for it, nor outlives a parent that then succeeds. The child's run row is locked inside end_run,
# after its parent's (the engine's lock order), its core row before both, with the batch's others
# (sql.LOCK_RUNS_AND_TREES: a multi-run settle's order), and its parent step has failed, so the
# child's end moves nothing there. (sql.END_RUN_IF_ACTIVE: a run no longer running is left as it is.)
CANCELED = {"state": "canceled", "failure_code": None, "failure_message": None}


@dataclass
class WorkflowReapResult:
    """What one maintenance pass did (counts of steps/approvals; ``communities`` visited;
    ``skipped_busy``: communities left for a later pass because their fence lock was taken or a
    row lock was held past the maintenance's ``lock_timeout``;
    ``batches``: per-community transactions run)."""

    reclaimed: int = 0
    exhausted: int = 0
    runs_timed_out: int = 0
    runs_scheduled: int = 0
    deliveries_expired: int = 0
    slots_missed: int = 0
    timed_out: int = 0
    wait_timed_out: int = 0
    woken: int = 0
    events_pruned: int = 0
    approvals_expired: int = 0
    skipped_busy: int = 0
    communities: int = 0
    batches: int = 0
    dry_run: bool = False

    @property
    def total(self) -> int:
        return (
            self.reclaimed
            + self.exhausted
            + self.timed_out
            + self.wait_timed_out
            + self.woken
            + self.approvals_expired
            + self.runs_timed_out
        )


def bounded(batch: Callable[[], bool], community: object) -> bool:
    """Run one community's batch (its own transaction, which bounds its lock waits with
    :func:`~buzz_delivery.services.db.bound_lock_waits`); False when a row lock was not free
    within the bound: that community is skipped for this pass, the others go on. SPEC 11."""
    try:
        return retry_deadlocks(batch)()  # a deadlock's victim runs again (a cancel or completion won)
    except OperationalError as exc:
        if not lock_wait_timed_out(exc):
            raise
        logger.warning("maintenance_lock_timeout community=%s: a row lock was held; skipped this pass", community)
        return False


def add_bounded_batch(
    community: object,
    result: R,
    batch: Callable[[R], bool],
    counts: tuple[str, ...],
) -> bool:
    """:func:`bounded` for a batch that counts into a result: each try counts into a fresh
    ``type(result)()`` (a rolled-back try's counts are dropped), and the ``counts`` of the try
    that committed are added to ``result``. False when the batch was skipped."""
    tries: list[R] = []

    def attempt() -> bool:
        tries[:] = [type(result)()]
        return batch(tries[0])

    if not bounded(attempt, community):
        return False
    for name in counts:
        setattr(result, name, getattr(result, name) + getattr(tries[0], name))
    return True


_COUNTS = (
    "reclaimed",
    "exhausted",
    "runs_timed_out",
    "timed_out",
    "wait_timed_out",
    "approvals_expired",
    "deliveries_expired",
    "woken",
)


def _one_community(community: object, limit: int, result: WorkflowReapResult) -> bool:
    """One bounded batch of one community; False when its fence lock was busy, or a row lock
    was held past the maintenance's ``lock_timeout`` (nothing of the batch is kept or counted)."""
    return add_bounded_batch(community, result, lambda r: _one_community_batch(community, limit, r), _COUNTS)


def _one_community_batch(community: object, limit: int, result: WorkflowReapResult) -> bool:
    params: dict[str, object] = {"community_id": community, "limit": limit}
    with transaction.atomic(), translated_errors():
        bound_lock_waits()
        if not fetch_all(TRY_WRITE_FENCE, params)[0][0]:
            return False
        steps = fetch_all(CANDIDATE_STEPS, params)
        approvals = fetch_all(CANDIDATE_APPROVALS, params)
        overdue = [row[0] for row in fetch_all(CANDIDATE_RUNS, params)]
        run_ids = sorted({row[1] for row in steps} | {row[1] for row in approvals} | set(overdue))
        if not run_ids:
            return True
        # The core rows of the run trees of these runs first, from their roots: their ancestors
        # (a run's end fails its parent's step, and a fail_run cascade goes on up) and the live
        # descendants of all of those (the children of timed-out sub_workflow waits, the children
        # a run's end cancels).
        fetch_all(LOCK_RUNS_AND_TREES, {**params, "run_ids": run_ids})
        if overdue:
            for (run_id,) in fetch_all(OVERDUE_LOCKED_RUNS, {**params, "run_ids": overdue}):
                rows = fetch_all(sql.END_RUN_IF_ACTIVE, {**params, **RUN_DEADLINE, "run_id": run_id})
                result.runs_timed_out += sum(1 for row in rows if row[0])
        step_ids = [row[0] for row in steps]
        params["ids"] = step_ids
        result.timed_out += len(fetch_all(FAIL_OVERRUN_STEPS, params))
        result.reclaimed += len(fetch_all(RECLAIM_LAPSED_STEPS, params))
        result.exhausted += len(fetch_all(EXHAUST_LAPSED_STEPS, params))
        expired = fetch_all(EXPIRE_OVERDUE_APPROVALS, {**params, "ids": [row[0] for row in approvals]})
        result.approvals_expired += len(expired)
        if expired:
            fetch_all(FAIL_STEPS_OF_EXPIRED_APPROVALS, {**params, "ids": [row[0] for row in expired]})
        timed_out = fetch_all(FAIL_OVERDUE_WAITS, params)
        result.wait_timed_out += len(timed_out)
        due = DueWaits()  # sleeps woken, wait_event timeouts under their on_timeout
        end_due_waits_in({**params, "actor": "reaper"}, step_ids, due)
        result.woken += due.woken
        result.wait_timed_out += due.timed_out
        children = [row[1] for row in timed_out if row[1] is not None]
        for child in children:
            fetch_all(sql.END_RUN_IF_ACTIVE, {**params, **CANCELED, "run_id": child})
        expire_deliveries_of_ended_runs(community, [*run_ids, *children])  # type: ignore[arg-type]
    return True


def _expire_left_deliveries(limit: int, result: WorkflowReapResult) -> None:
    """Runs that ended failed or canceled where no Python path expired their pending deliveries
    (the fan-in trigger failed them): expire those now, per community, through the core."""
    for (community,) in fetch_all(sql.COMMUNITIES_WITH_DELIVERIES_TO_EXPIRE, {"limit": 100}):
        expired: list[int] = []

        def batch(community: object = community, expired: list[int] = expired) -> bool:
            expired.clear()  # a rolled-back try's count is dropped
            with transaction.atomic(), translated_errors():
                bound_lock_waits()
                params = {"community_id": community, "limit": limit}
                if not fetch_all(TRY_WRITE_FENCE, params)[0][0]:
                    return False
                runs = [row[0] for row in fetch_all(sql.RUNS_WITH_DELIVERIES_TO_EXPIRE, params)]
                fetch_all(LOCK_RUNS, {**params, "run_ids": sorted(runs)})
                expired.append(expire_deliveries_of_ended_runs(community, runs))  # type: ignore[arg-type]
            return True

        if not bounded(batch, community):
            result.skipped_busy += 1
            continue
        result.deliveries_expired += sum(expired)
        result.batches += 1


def _prune_sent_events(limit: int, result: WorkflowReapResult) -> None:
    """Events past their keeping window, and the empty rows waits locked, deleted per community."""
    for (community,) in fetch_all(COMMUNITIES_WITH_OLD_EVENTS, {"limit": 100}):

        def batch(counts: WorkflowReapResult, community: object = community) -> bool:
            with transaction.atomic(), translated_errors():
                bound_lock_waits()
                params = {"community_id": community, "limit": limit}
                if not fetch_all(TRY_WRITE_FENCE, params)[0][0]:
                    return False
                counts.events_pruned += len(fetch_all(PRUNE_SENT_EVENTS, params))
            return True

        if not add_bounded_batch(community, result, batch, ("events_pruned",)):
            result.skipped_busy += 1
            continue
        result.batches += 1


@fleet_scoped
def reap_workflow_steps(
    *, batch_size: int | None = None, max_batches: int | None = None, dry_run: bool = False
) -> WorkflowReapResult:
    """One maintenance pass over every active community with work (see the module docstring).

    ``batch_size``: steps per community transaction (1..100,000; default the core's
    ``BATCH_SIZE``); ``max_batches``: stop after that many transactions (None = until done).
    ``dry_run``: count candidate communities only, write nothing. Returns a
    :class:`WorkflowReapResult`. Raises ``ValidationError`` keyed ``batch_size``/``max_batches``.
    SPEC section 11.
    """
    size = v.int_in_range(
        batch_size if batch_size is not None else core_settings().batch_size, "batch_size", 1, 100_000
    )
    if max_batches is not None:
        max_batches = v.int_in_range(max_batches, "max_batches", 1, 10**9)
    result = WorkflowReapResult(dry_run=dry_run)
    if not dry_run:
        scheduled = start_due_schedules()
        result.runs_scheduled, result.slots_missed = scheduled.started, scheduled.missed
        result.skipped_busy += scheduled.skipped_busy
        _expire_left_deliveries(size, result)
        _prune_sent_events(size, result)
    done: set[object] = set()
    while max_batches is None or result.batches < max_batches:
        communities = [row[0] for row in fetch_all(CANDIDATE_COMMUNITIES, {"limit": 100})]
        todo = [c for c in communities if c not in done]
        if dry_run:
            result.communities = len(communities)
            return result
        if not todo:
            return result
        for community in todo:
            if max_batches is not None and result.batches >= max_batches:
                return result
            before = result.total
            result.batches += 1
            if not _one_community(community, size, result):
                result.skipped_busy += 1
                done.add(community)
                continue
            result.communities += 1
            if result.total - before < size:
                done.add(community)  # a short batch: nothing more there for this pass
    return result
