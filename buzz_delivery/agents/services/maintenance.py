"""The agent runs' cron maintenance (SPEC 12 "States", "Approvals"): lapsed run leases
reclaimed (an attempt counted: ``pending`` after ``RETRY_DELAY_SECONDS``, or ``failed`` with
``attempts_exhausted``), ``timeout_at`` passed (``timeout``), agent approvals past their
deadline (``expired``: the run unwinds, then ends ``failed``/``approval_expired``).

Fleet-wide but walking communities (SPEC 15), like the engine's: one read picks candidate
communities (active ones), then per community one short transaction: the community's fence lock
is tried (never waited on), at most ``batch_size`` candidate runs are read, and one fenced UPDATE
per kind re-checks the whole condition on the database clock with ``community_id`` in its own
WHERE. Every path bumps the generation, so the old holder is fenced; the way back to a waiting
workflow step runs in the same transaction (migration 0002 triggers).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction

from buzz_delivery.agents.conf import get_settings
from buzz_delivery.agents.services.sql import ACTIVE, APPROVAL, COMMUNITY, RUN, TERMINAL, run_entry
from buzz_delivery.conf import get_settings as core_settings
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, translated_errors
from buzz_delivery.services.sql import DB_NOW
from buzz_delivery.triggers import FENCE_LOCK_NAMESPACE

LAPSED = f"r.state IN ('running', 'waiting_tool') AND r.lease_until < {DB_NOW}"
OVERDUE = f"r.state NOT IN {TERMINAL} AND r.timeout_at < {DB_NOW}"
APPROVAL_OVER = f"a.state = 'pending' AND a.step_id IS NULL AND a.deadline_at < {DB_NOW}"

CANDIDATE_COMMUNITIES = f"""
SELECT c.id FROM {COMMUNITY} AS c
WHERE c.deletion_state = 'active' AND (
    EXISTS (SELECT 1 FROM {RUN} AS r WHERE r.community_id = c.id AND {LAPSED})
    OR EXISTS (SELECT 1 FROM {RUN} AS r WHERE r.community_id = c.id AND {OVERDUE})
    OR EXISTS (SELECT 1 FROM {APPROVAL} AS a WHERE a.community_id = c.id AND {APPROVAL_OVER})
)
ORDER BY c.id
LIMIT %(limit)s
"""
TRY_FENCE_LOCK = "SELECT pg_try_advisory_xact_lock_shared(%(ns)s, hashtext(%(community_id)s::text))"
CANDIDATE_RUNS = f"""
SELECT r.id FROM {RUN} AS r
WHERE r.community_id = %(community_id)s AND (({LAPSED}) OR ({OVERDUE}))
ORDER BY r.id LIMIT %(limit)s
"""
_FENCE = "lease_generation = r.lease_generation + 1, lease_until = NULL, claimed_at = NULL"
EXPIRE_APPROVALS_OF_OVERDUE_RUNS = f"""
UPDATE {APPROVAL} AS a SET state = 'expired', closed_at = {DB_NOW}
WHERE a.community_id = %(community_id)s AND a.state = 'pending' AND a.step_id IS NULL AND {ACTIVE}
  AND a.id IN (SELECT r.approval_id FROM {RUN} AS r WHERE r.community_id = %(community_id)s
               AND r.id = ANY(%(ids)s) AND r.state = 'waiting_approval' AND r.timeout_at < {DB_NOW})
RETURNING a.id
"""
TIME_OUT_OVERDUE_RUNS = f"""
UPDATE {RUN} AS r SET state = 'timeout', {_FENCE}, unwinding = false, failure_code = 'timeout',
    failure_message = 'the run passed its timeout_at', finished_at = {DB_NOW},
    {run_entry("'timeout'", "r.lease_generation + 1", "'reaper'", status="'timeout'", renewals="r.renewals")}
WHERE r.community_id = %(community_id)s AND r.id = ANY(%(ids)s) AND {OVERDUE} AND {ACTIVE}
RETURNING r.id
"""
RECLAIM_LAPSED_RUNS = f"""
UPDATE {RUN} AS r SET state = 'pending', {_FENCE}, attempts = r.attempts + 1,
    next_attempt_at = {DB_NOW} + make_interval(secs => %(delay_seconds)s),
    {run_entry("'reap'", "r.lease_generation + 1", "'reaper'", status="'pending'", renewals="r.renewals")}
WHERE r.community_id = %(community_id)s AND r.id = ANY(%(ids)s) AND {LAPSED}
  AND r.attempts + 1 < r.max_attempts AND {ACTIVE}
RETURNING r.id
"""
EXHAUST_LAPSED_RUNS = f"""
UPDATE {RUN} AS r SET state = 'failed', {_FENCE}, attempts = r.max_attempts, unwinding = false,
    failure_code = 'attempts_exhausted', failure_message = 'the last attempt''s lease lapsed', finished_at = {DB_NOW},
    {run_entry("'reap'", "r.lease_generation + 1", "'reaper'", status="'failed'", renewals="r.renewals")}
WHERE r.community_id = %(community_id)s AND r.id = ANY(%(ids)s) AND {LAPSED}
  AND r.attempts + 1 >= r.max_attempts AND {ACTIVE}
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
    """What one maintenance pass did: runs ``reclaimed``, ``exhausted``, ``timed_out``;
    ``approvals_expired``; ``communities`` visited; ``skipped_busy`` (fence lock taken);
    ``batches`` (per-community transactions)."""

    reclaimed: int = 0
    exhausted: int = 0
    timed_out: int = 0
    approvals_expired: int = 0
    skipped_busy: int = 0
    communities: int = 0
    batches: int = 0
    dry_run: bool = False

    @property
    def total(self) -> int:
        return self.reclaimed + self.exhausted + self.timed_out + self.approvals_expired


def _one_community(community: object, limit: int, result: AgentReapResult) -> bool:
    params: dict[str, object] = {
        "community_id": community,
        "limit": limit,
        "ns": FENCE_LOCK_NAMESPACE,
        "delay_seconds": get_settings().retry_delay_seconds,
    }
    with transaction.atomic(), translated_errors():
        if not fetch_all(TRY_FENCE_LOCK, params)[0][0]:
            return False
        params["ids"] = [row[0] for row in fetch_all(CANDIDATE_RUNS, params)]
        if params["ids"]:
            result.approvals_expired += len(fetch_all(EXPIRE_APPROVALS_OF_OVERDUE_RUNS, params))
            result.timed_out += len(fetch_all(TIME_OUT_OVERDUE_RUNS, params))
            result.reclaimed += len(fetch_all(RECLAIM_LAPSED_RUNS, params))
            result.exhausted += len(fetch_all(EXHAUST_LAPSED_RUNS, params))
        result.approvals_expired += len(fetch_all(EXPIRE_OVERDUE_AGENT_APPROVALS, params))
    return True


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
