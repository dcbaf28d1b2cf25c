"""The agent runs' cron maintenance (SPEC 12 "States", "Approvals"): lapsed run leases
reclaimed (an attempt counted: ``pending`` after an exponential backoff, ``RETRY_DELAY_SECONDS``
* 2**attempts capped at ``RETRY_DELAY_MAX_SECONDS``, or ``failed`` with ``attempts_exhausted``),
``timeout_at`` passed (``timeout``), agent approvals past their deadline (``expired``: the run
unwinds, then ends ``failed``/``approval_expired``). A run that times out or exhausts its
attempts with compensations outstanding is not ended at once: it goes back to ``pending``
unwinding, a worker undoes its calls in reverse order, and ``fail_run`` ends it ``timeout`` or
``failed``/``attempts_exhausted``; an unwinding run whose lease lapses is reclaimed whatever its
attempts, so its compensations still run.

Fleet-wide but walking communities (SPEC 15), like the engine's: one read picks candidate
communities (active ones), then per community one short transaction: the community's fence lock
is tried (never waited on), at most ``batch_size`` candidate runs are read (their workflow
runs' core rows locked, in run id order, when of more than one: the settles' lock order), and one
fenced UPDATE per kind re-checks the whole condition on the database clock with ``community_id``
in its own WHERE. Every path bumps the generation, so the old holder is fenced; the way back to a waiting
workflow step runs in the same transaction (migration 0002 triggers).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from django.db import transaction

from buzz_delivery.agents.conf import NOTIFY_CHANNEL, get_settings
from buzz_delivery.agents.services.sql import (
    ACTIVE,
    AFTER_SOURCES,
    APPROVAL,
    CLOSE_PENDING_CALLS_OF_ENDED_RUNS,
    COMMUNITY,
    NOTIFY_CLAIMABLE,
    OUTSTANDING,
    OUTSTANDING_OF_ROW,
    RUN,
    TERMINAL,
    run_entry,
    sources_of,
)
from buzz_delivery.conf import get_settings as core_settings
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import bound_lock_waits, fetch_all, translated_errors
from buzz_delivery.services.sql import DB_NOW, TRY_WRITE_FENCE
from buzz_delivery.services.tenancy import fleet_scoped
from buzz_delivery.workflows.services.maintenance import add_bounded_batch

LAPSED = f"r.state IN ('running', 'waiting_tool') AND r.lease_until < {DB_NOW}"
# Past timeout_at, unless the run is already unwinding with compensations left: it ends once
# they are undone (a timeout would only fence its compensating holder). A run unwinding for an
# expired approval (this very pass may have expired it) still times out, once, to end ``timeout``.
_OVERDUE = (
    f"r.state NOT IN {TERMINAL} AND r.timeout_at < {DB_NOW}"
    " AND NOT (r.unwinding AND r.failure_code IS DISTINCT FROM 'approval_expired' AND {outstanding})"
)
OVERDUE = _OVERDUE.format(outstanding=OUTSTANDING)
OVERDUE_OF_ROW = _OVERDUE.format(outstanding=OUTSTANDING_OF_ROW)  # the walk over communities
# Exponential backoff of a reclaimed run: RETRY_DELAY_SECONDS * 2**attempts (the attempts
# before this one), capped at RETRY_DELAY_MAX_SECONDS; the exponent is clamped first.
# Equal jitter (issue 29, buzz_delivery.backoff): times a factor within [0.5, 1] drawn per run
# from a hash of its id and a seed the caller draws per batch (hashtext is IMMUTABLE over the
# column, as Citus wants in an UPDATE's SET list), so runs reclaimed together spread out.
JITTER = "(0.5 + 0.5 * ((hashtext(r.id::text || %(jitter_seed)s) & 65535)::double precision / 65535))"
BACKOFF_SECONDS = f"LEAST(%(delay_seconds)s * power(2, LEAST(r.attempts, 62)), %(max_delay_seconds)s) * {JITTER}"
NEXT_ATTEMPT_AT = f"buzz_delivery_plus_seconds({DB_NOW}, {BACKOFF_SECONDS})"
APPROVAL_OVER = f"a.state = 'pending' AND a.step_id IS NULL AND a.deadline_at < {DB_NOW}"

CANDIDATE_COMMUNITIES = f"""
SELECT c.id FROM {COMMUNITY} AS c
WHERE c.deletion_state = 'active' AND (
    EXISTS (SELECT 1 FROM {RUN} AS r WHERE r.community_id = c.id AND {LAPSED})
    OR EXISTS (SELECT 1 FROM {RUN} AS r WHERE r.community_id = c.id AND {OVERDUE_OF_ROW})
    OR EXISTS (SELECT 1 FROM {APPROVAL} AS a WHERE a.community_id = c.id AND {APPROVAL_OVER})
)
ORDER BY c.id
LIMIT %(limit)s
"""
# The candidates' workflow runs' core rows are locked first, in run id order, when of more than
# one workflow run (sql.SOURCES, as a multi-run batch settle and the agents' batches): the pass
# ends runs (TIME_OUT_OVERDUE_RUNS, then EXHAUST_LAPSED_RUNS) and each end counts in its workflow
# step under the engine's run row (``buzz_agents_run_ended``), in the order the statements end
# them, while a settle's fan-in locks those engine rows in delivery id order: a deadlock. Taken
# here, before any other row of the pass (the approvals the expiry closes, the runs it moves),
# the second of the two waits at its first run in common holding none of the other's rows. The
# wait is bounded by the pass's lock_timeout (a settle holds them for its statement).
CANDIDATE_RUNS = f"""
WITH candidate AS MATERIALIZED (
    SELECT r.id FROM {RUN} AS r
    WHERE r.community_id = %(community_id)s AND (({LAPSED}) OR ({OVERDUE}))
    ORDER BY r.id LIMIT %(limit)s
), {sources_of("ARRAY(SELECT c.id FROM candidate AS c)")}
SELECT c.id FROM candidate AS c WHERE true {AFTER_SOURCES}
ORDER BY c.id
"""
# The candidates are locked before they are judged (after their approvals are expired: approval
# then run, the order of decide_approval, so the two cannot deadlock): a holder's result
# committed meanwhile is seen by the next statements (fresh snapshots), so a timeout never
# misses a compensation; a row being written right now is skipped until the next pass. So is
# a run still waiting_approval: its approval was requested after the expiry read the run (that
# statement moved every run whose approval it expired), so ending it now would leave that
# approval pending for a run that no longer waits. The next pass expires it first.
LOCK_CANDIDATE_RUNS = f"""
SELECT r.id FROM {RUN} AS r
WHERE r.community_id = %(community_id)s AND r.id = ANY(%(ids)s) AND r.state <> 'waiting_approval'
ORDER BY r.id
FOR NO KEY UPDATE OF r SKIP LOCKED
"""
_FENCE = "lease_generation = r.lease_generation + 1, lease_until = NULL, claimed_at = NULL"
EXPIRE_APPROVALS_OF_OVERDUE_RUNS = f"""
UPDATE {APPROVAL} AS a SET state = 'expired', closed_at = {DB_NOW}
WHERE a.community_id = %(community_id)s AND a.state = 'pending' AND a.step_id IS NULL AND {ACTIVE}
  AND a.id IN (SELECT r.approval_id FROM {RUN} AS r WHERE r.community_id = %(community_id)s
               AND r.id = ANY(%(ids)s) AND r.state = 'waiting_approval' AND r.timeout_at < {DB_NOW})
RETURNING a.id
"""
# Overdue with compensations outstanding (and not unwinding already, unless for an expired
# approval, which this pass may just have expired): fenced and back to pending unwinding, so a
# worker undoes the calls and fail_run ends the run ``timeout``.
TIME_OUT_TO_UNWIND = f"""
UPDATE {RUN} AS r SET state = 'pending', {_FENCE}, unwinding = true, next_attempt_at = NULL,
    failure_code = 'timeout', failure_message = 'the run passed its timeout_at'
WHERE r.community_id = %(community_id)s AND r.id = ANY(%(ids)s) AND {OVERDUE} AND {ACTIVE}
  AND {OUTSTANDING} AND (NOT r.unwinding OR r.failure_code = 'approval_expired')
RETURNING r.id
"""
TIME_OUT_OVERDUE_RUNS = f"""
UPDATE {RUN} AS r SET state = 'timeout', {_FENCE}, unwinding = false, failure_code = 'timeout',
    failure_message = 'the run passed its timeout_at', finished_at = {DB_NOW},
    {run_entry("'timeout'", "r.lease_generation + 1", "'reaper'", status="'timeout'", renewals="r.renewals")}
WHERE r.community_id = %(community_id)s AND r.id = ANY(%(ids)s) AND {OVERDUE} AND {ACTIVE}
  AND NOT ({OUTSTANDING})
RETURNING r.id
"""
# A lapsed run with attempts left, or one that was unwinding (its compensations must still run:
# it is reclaimed whatever its attempts, attempts staying within max_attempts), goes back to
# pending after an exponential backoff.
RECLAIM_LAPSED_RUNS = f"""
UPDATE {RUN} AS r SET state = 'pending', {_FENCE}, attempts = LEAST(r.attempts + 1, r.max_attempts),
    next_attempt_at = {NEXT_ATTEMPT_AT},
    {run_entry("'reap'", "r.lease_generation + 1", "'reaper'", status="'pending'", renewals="r.renewals")}
WHERE r.community_id = %(community_id)s AND r.id = ANY(%(ids)s) AND {LAPSED}
  AND (r.attempts + 1 < r.max_attempts OR r.unwinding) AND {ACTIVE}
RETURNING r.id
"""
# The last attempt lapsed with compensations outstanding: back to pending unwinding (at once),
# a worker undoes the calls and fail_run ends the run failed / attempts_exhausted.
EXHAUST_TO_UNWIND = f"""
UPDATE {RUN} AS r SET state = 'pending', {_FENCE}, attempts = r.max_attempts, unwinding = true,
    next_attempt_at = NULL, failure_code = 'attempts_exhausted', failure_message = 'the last attempt''s lease lapsed'
WHERE r.community_id = %(community_id)s AND r.id = ANY(%(ids)s) AND {LAPSED}
  AND r.attempts + 1 >= r.max_attempts AND NOT r.unwinding AND {OUTSTANDING} AND {ACTIVE}
RETURNING r.id
"""
EXHAUST_LAPSED_RUNS = f"""
UPDATE {RUN} AS r SET state = 'failed', {_FENCE}, attempts = r.max_attempts, unwinding = false,
    failure_code = 'attempts_exhausted', failure_message = 'the last attempt''s lease lapsed', finished_at = {DB_NOW},
    {run_entry("'reap'", "r.lease_generation + 1", "'reaper'", status="'failed'", renewals="r.renewals")}
WHERE r.community_id = %(community_id)s AND r.id = ANY(%(ids)s) AND {LAPSED}
  AND r.attempts + 1 >= r.max_attempts AND NOT r.unwinding AND NOT ({OUTSTANDING}) AND {ACTIVE}
RETURNING r.id
"""
EXPIRE_OVERDUE_AGENT_APPROVALS = f"""
WITH candidate AS (
    SELECT a.id FROM {APPROVAL} AS a WHERE a.community_id = %(community_id)s AND {APPROVAL_OVER}
    ORDER BY a.id LIMIT %(limit)s
)
UPDATE {APPROVAL} AS a SET state = 'expired', closed_at = {DB_NOW}
FROM candidate
WHERE a.community_id = %(community_id)s AND a.id = candidate.id AND {APPROVAL_OVER} AND {ACTIVE}
RETURNING a.id
"""


@dataclass
class AgentReapResult:
    """What one maintenance pass did: runs ``reclaimed``, ``exhausted``, ``timed_out``,
    ``unwinding`` (timed out or exhausted with compensations outstanding: sent to compensate);
    ``approvals_expired``; ``communities`` visited; ``skipped_busy`` (fence lock taken);
    ``batches`` (per-community transactions)."""

    reclaimed: int = 0
    exhausted: int = 0
    timed_out: int = 0
    unwinding: int = 0
    approvals_expired: int = 0
    skipped_busy: int = 0
    communities: int = 0
    batches: int = 0
    dry_run: bool = False

    @property
    def total(self) -> int:
        return self.reclaimed + self.exhausted + self.timed_out + self.unwinding + self.approvals_expired


def _one_community(community: object, limit: int, result: AgentReapResult) -> bool:
    """One bounded batch of one community; False when its fence lock was busy, or a row lock
    was held past the maintenance's ``lock_timeout`` (nothing of the batch kept or counted)."""
    counts = ("reclaimed", "exhausted", "timed_out", "unwinding", "approvals_expired")
    return add_bounded_batch(community, result, lambda r: _one_community_batch(community, limit, r), counts)


def _one_community_batch(community: object, limit: int, result: AgentReapResult) -> bool:
    params: dict[str, object] = {
        "community_id": community,
        "limit": limit,
        "delay_seconds": get_settings().retry_delay_seconds,
        "max_delay_seconds": get_settings().retry_delay_max_seconds,
        "jitter_seed": secrets.token_hex(8),
    }
    with transaction.atomic(), translated_errors():
        bound_lock_waits()
        if not fetch_all(TRY_WRITE_FENCE, params)[0][0]:
            return False
        params["ids"] = [row[0] for row in fetch_all(CANDIDATE_RUNS, params)]
        if params["ids"]:
            result.approvals_expired += len(fetch_all(EXPIRE_APPROVALS_OF_OVERDUE_RUNS, params))
            params["ids"] = [row[0] for row in fetch_all(LOCK_CANDIDATE_RUNS, params)]
            unwinding = len(fetch_all(TIME_OUT_TO_UNWIND, params))
            ended = [row[0] for row in fetch_all(TIME_OUT_OVERDUE_RUNS, params)]
            result.timed_out += len(ended)
            result.reclaimed += len(fetch_all(RECLAIM_LAPSED_RUNS, params))
            unwinding += len(fetch_all(EXHAUST_TO_UNWIND, params))
            exhausted = [row[0] for row in fetch_all(EXHAUST_LAPSED_RUNS, params)]
            result.exhausted += len(exhausted)
            if ended or exhausted:  # a pending call without a compensation ends with its run
                fetch_all(CLOSE_PENDING_CALLS_OF_ENDED_RUNS, {**params, "ended": ended + exhausted})
            if unwinding:  # claimable at once: wake the workers (on commit)
                fetch_all(NOTIFY_CLAIMABLE, {"channel": NOTIFY_CHANNEL, "community_id": community})
            result.unwinding += unwinding
        result.approvals_expired += len(fetch_all(EXPIRE_OVERDUE_AGENT_APPROVALS, params))
    return True


@fleet_scoped
def reap_agent_runs(
    *, batch_size: int | None = None, max_batches: int | None = None, dry_run: bool = False
) -> AgentReapResult:
    """One maintenance pass over every active community with work (see the module docstring).

    ``batch_size``: runs per community transaction (1..100,000; default the core's
    ``BATCH_SIZE``); ``max_batches``: stop after that many transactions (None = until done);
    ``dry_run``: count candidate communities only. Returns an :class:`AgentReapResult`. Raises
    ``ValidationError`` keyed ``batch_size``/``max_batches``. SPEC 12, 15."""
    size = v.int_in_range(
        batch_size if batch_size is not None else core_settings().batch_size, "batch_size", 1, 100_000
    )
    if max_batches is not None:
        max_batches = v.int_in_range(max_batches, "max_batches", 1, 10**9)
    result = AgentReapResult(dry_run=dry_run)
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
                done.add(community)
    return result
