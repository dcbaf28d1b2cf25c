"""Every statement of the agent runs that changes state, named for its guard (SPEC 12, 15).

All times come from the database clock (``buzz_delivery_now()``); no CASE/COALESCE holds a clock
or interval expression and no SET applies a STABLE function to a column: intervals come from
bind parameters. Every UPDATE names ``community_id`` in its own WHERE, and every holder
transition checks the whole fence inside the statement: generation, holder (``worker_id``),
a leased state, ``lease_until >= now`` and the community ``active``.

The run's lease transitions (claim, complete, fail, park for approval, cancel, and the
maintenance's timeout and reaps) append one entry to its ``history`` in their own SET list
(:func:`buzz_delivery.services.sql.history_entry`), as the core's do for deliveries; a heartbeat
only counts (``renewals``). Tool calls are not repeated there: the journal records them.
"""

from __future__ import annotations

from buzz_delivery.services import flow
from buzz_delivery.services.sql import DB_NOW, WORKFLOW_RUN, history_entry

RUN = "buzz_agents_run"
JOURNAL = "buzz_agents_journal"
OUTPUT = "buzz_agents_output"
INTAKE = "buzz_agents_intake_key"
APPROVAL = "buzz_workflows_approval"
COMMUNITY = "buzz_delivery_community"
RECORD = "buzz_delivery_delivery_record"  # the delivery table, read inside the INSERT of a run
EVENT = "buzz_delivery_event"

ACTIVE = f"EXISTS (SELECT 1 FROM {COMMUNITY} c WHERE c.id = %(community_id)s AND c.deletion_state = 'active')"
# A run lease's end: what the holder asked for, never beyond the run's lease cap (the operator's
# policy when the run was created, issue 27). IMMUTABLE arithmetic over the column (SPEC 15).
RUN_LEASE_END = (
    f"buzz_delivery_plus_seconds({DB_NOW}, least(%(lease_seconds)s, coalesce(r.max_lease_seconds, %(lease_seconds)s)))"
)
TERMINAL = "('completed', 'failed', 'cancelled', 'timeout')"
CURRENT_RUN_LEASE = f"""
    r.community_id = %(community_id)s
    AND r.id = %(run_id)s
    AND r.lease_generation = %(lease_generation)s
    AND r.worker_id = %(worker_id)s
    AND r.state IN ('running', 'waiting_tool')
    AND r.lease_until >= {DB_NOW}
    AND {ACTIVE}
"""


def run_entry(event: str, generation: str, actor: str, *, status: str, **extra: str) -> str:
    """The SET assignment appending one entry to an agent run's history (alias ``r``)."""
    return history_entry(event, generation, actor, status=status, alias="r", **extra)


COMPENSABLE = "j.compensation IS NOT NULL AND (j.status = 'succeeded' OR (j.status = 'failed' AND j.uncertain))"
# A call still pending (its holder was fenced, or its handler gave up, mid-call) may have had its
# effect: a run with one is never ended as if there were nothing to undo (issue 28). It is marked
# failed and uncertain by the next fail_run, then compensated like a succeeded one, in seq order.
PENDING_WITH_COMPENSATION = "j.compensation IS NOT NULL AND j.status = 'pending' AND j.kind = 'tool'"

INSERT_RUN_FROM_DELIVERY = f"""
INSERT INTO {RUN} (id, community_id, agent_pubkey, state, unwinding, shadow, input, input_hash,
                   delivery_id, source_run_id, source_step_key, lease_generation, attempts, max_attempts,
                   timeout_at, max_tool_calls, tool_calls_used, max_cost, cost_used, max_lease_seconds,
                   trace_context, priority)
SELECT %(id)s, d.community_id, d.target_pubkey, 'pending', false, %(shadow)s,
       jsonb_build_object('content', e.content, 'delivery_id', d.id::text, 'step_id', d.step_id,
                          'workflow_run_id', d.run_id::text, 'message_event_id', encode(d.message_event_id, 'hex'))
           || %(input)s::jsonb,
       %(input_hash)s, d.id, d.run_id, d.step_id, 0, 0, %(max_attempts)s,
       {DB_NOW} + make_interval(secs => %(timeout_seconds)s), %(max_tool_calls)s, 0, %(max_cost)s, 0,
       %(max_lease_seconds)s, COALESCE(%(trace_context)s::jsonb, d.trigger_context -> 'trace'), d.priority
FROM {RECORD} AS d
LEFT JOIN {EVENT} AS e ON e.community_id = d.community_id AND e.event_id = d.message_event_id
WHERE d.community_id = %(community_id)s AND d.id = %(delivery_id)s
ON CONFLICT (community_id, delivery_id) WHERE delivery_id IS NOT NULL DO NOTHING
RETURNING id
"""

RUN_OF_DELIVERY = f"SELECT id FROM {RUN} WHERE community_id = %(community_id)s AND delivery_id = %(delivery_id)s"

# intake_event in one round trip (agents migration 0021): the key first (ON CONFLICT DO NOTHING,
# judged by the row it returns), and only for its winner the policy's two rows, the run and the wake
# hint; a loser gets the key that won (created false). One statement, atomic on its own; on Citus
# delegated whole to the community's worker (AgentsConfig.buzz_delegated_functions). The casts pick
# the function whatever the client binds.
INTAKE_EVENT = """
SELECT i.out_run_id, i.out_payload_hash, i.out_created
FROM buzz_agents_intake(%(community_id)s::uuid, %(channel_type)s::text, %(provider_event_id)s::text,
                        %(agent_pubkey)s::bytea, %(input)s::jsonb, %(payload_hash)s::bytea, %(input_hash)s::bytea,
                        %(id)s::uuid, %(key_id)s::uuid, %(shadow)s::boolean, %(max_tool_calls)s::integer,
                        %(max_cost)s::bigint, %(max_attempts)s::integer, %(timeout_seconds)s::integer,
                        %(default_shadow)s::boolean, %(default_max_tool_calls)s::integer,
                        %(default_max_cost)s::bigint, %(default_max_attempts)s::integer,
                        %(default_max_timeout_seconds)s::bigint,
                        %(default_max_lease_seconds)s::double precision, %(notify)s::boolean) AS i
"""

# What a claim returns: the lease (id, generation, lease end) then every column of the claimed
# run but its history, as the row stands after the claim, so the claim is one statement and the
# worker builds each run from its row (runs.claim_agent_runs) instead of reading the runs again.
CLAIMED_RUN_COLUMNS = (
    "community_id", "id", "agent_pubkey", "state", "unwinding", "shadow", "input", "input_hash", "output",
    "output_hash", "failure_code", "failure_message", "delivery_id", "source_run_id", "source_step_key",
    "approval_id", "lease_generation", "lease_until", "claimed_at", "heartbeat_at", "worker_id", "attempts",
    "max_attempts", "next_attempt_at", "timeout_at", "max_tool_calls", "tool_calls_used", "max_cost", "cost_used",
    "max_lease_seconds", "trace_context", "priority", "slot_community", "slot_agent", "created_at", "finished_at",
    "renewals", "output_chunks", "output_bytes",
)  # fmt: skip
_CLAIM_RETURNING = "RETURNING r.id, r.lease_generation, r.lease_until, " + ", ".join(
    f"r.{column}" for column in CLAIMED_RUN_COLUMNS
)

_CLAIM_RUN_SET = f"""state = 'running', lease_generation = r.lease_generation + 1, lease_until = {RUN_LEASE_END},
    claimed_at = {DB_NOW}, heartbeat_at = {DB_NOW}, worker_id = %(worker_id)s, next_attempt_at = NULL,
    renewals = 0,
    {run_entry("'claim'", "r.lease_generation + 1", "%(worker_id)s::varchar", status="'running'")}"""

# Without a concurrency limit: the claimed runs hold no slot (a run once claimed under a limit
# and back to pending keeps its old numbers, which must not follow it into the leased states).
CLAIM_PENDING_RUNS = f"""
WITH candidate AS MATERIALIZED (
    SELECT r.id FROM {RUN} AS r
    WHERE r.community_id = %(community_id)s
      AND r.agent_pubkey = ANY(%(agents)s)
      AND r.state = 'pending'
      AND (r.next_attempt_at IS NULL OR r.next_attempt_at <= {DB_NOW})
      AND {ACTIVE}
    ORDER BY r.priority DESC, r.created_at, r.id
    LIMIT %(limit)s
    FOR UPDATE OF r SKIP LOCKED
)
UPDATE {RUN} AS r
SET {_CLAIM_RUN_SET},
    slot_community = NULL, slot_agent = NULL
FROM candidate, unnest(ARRAY(SELECT candidate.id FROM candidate)) AS listed(id)
-- Through the primary key, joined with both the candidates and their ids as an array: a generic
-- plan (a prepared statement's) probes the key from whichever it estimates smaller (as the step
-- claim, workflows/services/sql.py: alone, the CTE's estimate let a hash join read all of a large
-- community's runs, the array's lost to the community's rows when the statistics gave it few:
-- test_engine_claim_plan_fleet_stats). With no state test: the candidates were locked FOR UPDATE
-- after their latest version was re-checked (still pending), and a state test would let the
-- pending index win and read every pending run of the community.
WHERE r.community_id = %(community_id)s AND r.id = candidate.id AND r.id = listed.id
{_CLAIM_RETURNING}
"""

# Under the operator's AGENT_CONCURRENCY_LIMITS (services/flow.py; ``cap_agent``,
# ``cap_community``: the maximum per key, NULL = no limit of that kind): the same candidates but
# those of an agent at its limit, each taking the free slot of its rank in every limited kind;
# one without stays pending. Run under the community's claim lock (flow.claim_holding_slots).
_LEASED = "h.state IN ('running', 'waiting_tool')"
_RUN_SLOT_KINDS = {"community": ("slot_community", ()), "agent": ("slot_agent", ("agent_pubkey",))}
CLAIM_PENDING_RUNS_UNDER_LIMITS = f"""
WITH {flow.full_keys("community", RUN, _LEASED, "slot_community", ())},
{flow.full_keys("agent", RUN, _LEASED, "slot_agent", ("agent_pubkey",))},
candidate AS MATERIALIZED (
    SELECT r.id, r.agent_pubkey, r.priority, r.created_at FROM {RUN} AS r
    WHERE r.community_id = %(community_id)s
      AND r.agent_pubkey = ANY(%(agents)s)
      AND r.state = 'pending'
      AND (r.next_attempt_at IS NULL OR r.next_attempt_at <= {DB_NOW})
      AND {ACTIVE}
      AND NOT EXISTS (SELECT 1 FROM full_community)
      AND NOT EXISTS (SELECT 1 FROM full_agent AS f WHERE f.agent_pubkey = r.agent_pubkey)
    ORDER BY r.priority DESC, r.created_at, r.id
    LIMIT LEAST(%(limit)s, %(cap_community)s::integer)
    FOR UPDATE OF r SKIP LOCKED
),
{flow.free_slots("community", RUN, _LEASED, "slot_community", ())},
{flow.free_slots("agent", RUN, _LEASED, "slot_agent", (("agent_pubkey", "agent_pubkey"),))},
{flow.admitted(_RUN_SLOT_KINDS, "c.priority DESC, c.created_at, c.id")}
UPDATE {RUN} AS r
SET {_CLAIM_RUN_SET},
    slot_community = admitted.slot_community, slot_agent = admitted.slot_agent
FROM candidate, admitted, unnest(ARRAY(SELECT admitted.id FROM admitted)) AS listed(id)
-- Through the primary key, driven by the candidates or the admitted ids as an array, whichever
-- the plan estimates smaller (as CLAIM_PENDING_RUNS: the admitted's own estimate is no help).
-- The candidates were locked FOR UPDATE after
-- their latest version was re-checked, so no state test here (it would let the pending index
-- win the join and read every pending run of the community).
WHERE r.community_id = %(community_id)s AND r.id = candidate.id AND r.id = admitted.id AND r.id = listed.id
{_CLAIM_RETURNING}
"""

HEARTBEAT_IF_CURRENT = f"""
UPDATE {RUN} AS r SET lease_until = {RUN_LEASE_END}, heartbeat_at = {DB_NOW}, renewals = r.renewals + 1
WHERE {CURRENT_RUN_LEASE}
RETURNING r.lease_until
"""

RUN_AT = f"""
SELECT r.state, r.lease_generation, r.worker_id, r.tool_calls_used, r.max_tool_calls, r.cost_used, r.max_cost,
       r.unwinding, (r.lease_until >= {DB_NOW}) AS lease_current, {ACTIVE} AS active
FROM {RUN} AS r WHERE r.community_id = %(community_id)s AND r.id = %(run_id)s
"""

# One fenced statement spends one journal slot (and the call's cost) within the budgets. A run
# already ``waiting_tool`` may journal another call: threads of one holder call tools at once.
SPEND_CALL_IF_CURRENT_AND_WITHIN_BUDGET = f"""
UPDATE {RUN} AS r
SET tool_calls_used = r.tool_calls_used + 1, cost_used = r.cost_used + %(cost)s,
    state = CASE WHEN r.shadow AND %(destructive)s THEN r.state ELSE 'waiting_tool' END
WHERE {CURRENT_RUN_LEASE} AND NOT r.unwinding
  AND r.tool_calls_used < r.max_tool_calls AND r.cost_used + %(cost)s <= r.max_cost
RETURNING r.tool_calls_used, r.shadow
"""

_INSERT_JOURNAL_ENTRY = """
INSERT INTO {JOURNAL} (id, community_id, run_id, seq, scope, scope_index, kind, tool_name, idempotency_key,
                       input_hash, args, cost, destructive, compensation, status, uncertain, blocked_reason, error,
                       finished_at, approval_id, generation)
VALUES (%(entry_id)s, %(community_id)s, %(run_id)s, %(seq)s, %(scope)s, %(scope_index)s, %(kind)s, %(tool_name)s,
        %(idempotency_key)s, %(input_hash)s, %(args)s::jsonb, %(cost)s, %(destructive)s, %(compensation)s::jsonb,
        %(status)s, false, %(blocked_reason)s, %(error)s, {finished_at}, %(approval_id)s, %(lease_generation)s)
"""
INSERT_PENDING_JOURNAL_ENTRY = _INSERT_JOURNAL_ENTRY.format(JOURNAL=JOURNAL, finished_at="NULL")
INSERT_ANSWERED_JOURNAL_ENTRY = _INSERT_JOURNAL_ENTRY.format(JOURNAL=JOURNAL, finished_at=DB_NOW)

RECORD_RESULT_IF_CURRENT = f"""
WITH fenced AS (
    UPDATE {RUN} AS r SET state = 'running'
    WHERE {CURRENT_RUN_LEASE}
    RETURNING r.id, r.lease_generation
)
UPDATE {JOURNAL} AS j
SET status = %(status)s, uncertain = %(uncertain)s, output = %(output)s::jsonb, output_hash = %(output_hash)s,
    error = %(error)s, latency_ms = %(latency_ms)s, result_generation = fenced.lease_generation,
    finished_at = {DB_NOW}
FROM fenced
WHERE j.community_id = %(community_id)s AND j.run_id = fenced.id AND j.seq = %(seq)s AND j.status = 'pending'
  AND j.kind = 'tool'
RETURNING j.status
"""

ENTRY_STATUS = f"""
SELECT j.status, j.compensation_status FROM {JOURNAL} AS j
WHERE j.community_id = %(community_id)s AND j.run_id = %(run_id)s AND j.seq = %(seq)s
"""

# A completion judges the holder's calls in flight (NOT EXISTS) on its statement's snapshot, and
# takes no lock first: a call journaled after that snapshot sets the run 'waiting_tool', which the
# statement re-checks on the row's latest version once it holds the row (EvalPlanQual). A call's
# result recorded after that sets it 'running' again, and the entry journaled meanwhile, pending,
# is not in the snapshot. So the completion also asks its snapshot to hold the run's last entry:
# the highest seq it sees must be the latest row's tool_calls_used (each entry's seq is the count
# its journaling bumped, migration 0002's trigger), or a call was journaled since, and the run is
# judged again on a fresh read (CALLS_IN_FLIGHT). One index probe of the journal's key, no lock.
SNAPSHOT_HOLDS_EVERY_CALL = """r.tool_calls_used = (SELECT coalesce(max(k.seq), 0) FROM {journal} AS k
                          WHERE k.community_id = %(community_id)s AND k.run_id = {run})"""
COMPLETE_IF_CURRENT = f"""
UPDATE {RUN} AS r
SET state = 'completed', output = %(output)s::jsonb, output_hash = %(output_hash)s, lease_until = NULL,
    claimed_at = NULL, finished_at = {DB_NOW},
    {run_entry("'settle'", "r.lease_generation", "r.worker_id", status="'completed'", renewals="r.renewals")}
WHERE {CURRENT_RUN_LEASE} AND r.state = 'running' AND NOT r.unwinding
  AND NOT EXISTS (SELECT 1 FROM {JOURNAL} AS j WHERE j.community_id = %(community_id)s AND j.run_id = %(run_id)s
                  AND j.kind = 'tool' AND j.status = 'pending' AND j.generation = %(lease_generation)s)
  AND {SNAPSHOT_HOLDS_EVERY_CALL.format(journal=JOURNAL, run="%(run_id)s")}
RETURNING r.state
"""

# Outstanding compensations of the run: compensable entries not yet compensated, unless one
# already failed (a failed compensation stops the chain).
# Named by the statement's own %(community_id)s, not by the run row's column: Citus prunes a
# subquery's shards by its own conditions, so ``j.community_id = r.community_id`` sent the whole
# UPDATE to every shard (with the community's EXISTS pulled to the coordinator first), and a
# transaction that also NOTIFYs on a shard (a fan-in advancing a workflow) cannot commit in two
# phases ("cannot PREPARE a transaction that has executed ... NOTIFY"). OUTSTANDING_OF_ROW is the
# form for a walk over communities (no single community to name).
_OUTSTANDING = """
    EXISTS (SELECT 1 FROM {journal} AS j WHERE j.community_id = {community} AND j.run_id = r.id
            AND (({compensable}) OR ({pending}))
            AND j.compensation_status IS DISTINCT FROM 'compensated')
    AND NOT EXISTS (SELECT 1 FROM {journal} AS j WHERE j.community_id = {community} AND j.run_id = r.id
                    AND j.compensation_status = 'compensation_failed')
"""
OUTSTANDING = _OUTSTANDING.format(
    journal=JOURNAL, community="%(community_id)s", compensable=COMPENSABLE, pending=PENDING_WITH_COMPENSATION
)
OUTSTANDING_OF_ROW = _OUTSTANDING.format(
    journal=JOURNAL, community="r.community_id", compensable=COMPENSABLE, pending=PENDING_WITH_COMPENSATION
)

# The failure codes of a run unwinding for a cancel: the operator's (``cancel_agent_run``) and its
# workflow run's (the trigger ``buzz_agents_workflow_canceled``, agents migration 0017).
CANCEL_CODES = "('cancelled', 'workflow_canceled')"

# A run that unwinds because it was cancelled or timed out ends in that state once undone
# (the system writes those failure codes only with ``unwinding``); any other ends failed.
END_STATE_OF_UNWOUND = (
    f"CASE WHEN r.unwinding AND r.failure_code IN {CANCEL_CODES} THEN 'cancelled'"
    " WHEN r.unwinding AND r.failure_code = 'timeout' THEN 'timeout' ELSE 'failed' END"
)

FAIL_IF_CURRENT_AND_NOTHING_TO_UNDO = f"""
UPDATE {RUN} AS r
SET state = {END_STATE_OF_UNWOUND}, failure_code = coalesce(r.failure_code, %(failure_code)s),
    failure_message = coalesce(r.failure_message, %(failure_message)s), lease_until = NULL, claimed_at = NULL,
    finished_at = {DB_NOW},
    {run_entry("'settle'", "r.lease_generation", "r.worker_id", status="'failed'", renewals="r.renewals")}
WHERE {CURRENT_RUN_LEASE} AND NOT ({OUTSTANDING})
RETURNING r.state
"""

# A failing run (its handler gave up, or it unwinds after a cancel, a timeout or exhausted
# attempts: its handler is not run again) cannot end with a call still pending: the call's
# outcome is unknown, so it is uncertain and, with a compensation, undone like a succeeded one
# (before the calls under it: reverse order). Fenced by the current lease.
MARK_PENDING_UNCERTAIN = f"""
WITH fenced AS (
    SELECT r.id, r.lease_generation FROM {RUN} AS r
    WHERE {CURRENT_RUN_LEASE}
    FOR NO KEY UPDATE
)
UPDATE {JOURNAL} AS j
SET status = 'failed', uncertain = true, error = 'uncertain: the run failed while the call was pending',
    result_generation = fenced.lease_generation, finished_at = {DB_NOW}
FROM fenced
WHERE j.community_id = %(community_id)s AND j.run_id = fenced.id AND j.status = 'pending' AND j.kind = 'tool'
RETURNING j.seq
"""

# A run ended by a cancel or the maintenance with nothing to undo may still hold a pending call
# without a compensation: it is closed (failed, uncertain) with the run, never left pending.
CLOSE_PENDING_CALLS_OF_ENDED_RUNS = f"""
UPDATE {JOURNAL} AS j
SET status = 'failed', uncertain = true, error = 'uncertain: the run ended while the call was pending',
    result_generation = r.lease_generation, finished_at = {DB_NOW}
FROM {RUN} AS r
WHERE j.community_id = %(community_id)s AND j.run_id = ANY(%(ended)s) AND j.status = 'pending' AND j.kind = 'tool'
  AND r.community_id = %(community_id)s AND r.id = j.run_id AND r.state IN {TERMINAL}
RETURNING j.seq
"""

MARK_UNWINDING_IF_CURRENT = f"""
UPDATE {RUN} AS r
SET unwinding = true, state = 'running', failure_code = coalesce(r.failure_code, %(failure_code)s),
    failure_message = coalesce(r.failure_message, %(failure_message)s)
WHERE {CURRENT_RUN_LEASE}
RETURNING r.id
"""

OUTSTANDING_SEQS = f"""
SELECT j.seq FROM {JOURNAL} AS j
WHERE j.community_id = %(community_id)s AND j.run_id = %(run_id)s AND {COMPENSABLE}
  AND j.compensation_status IS DISTINCT FROM 'compensated'
ORDER BY j.seq DESC
"""

# Reverse order in the statement: only the highest compensable entry not yet compensated.
BEGIN_COMPENSATION_IF_CURRENT_AND_LAST = f"""
WITH fenced AS (
    SELECT r.id, r.lease_generation FROM {RUN} AS r
    WHERE {CURRENT_RUN_LEASE} AND r.unwinding
    FOR NO KEY UPDATE
)
UPDATE {JOURNAL} AS j
SET compensation_status = 'compensating', compensation_generation = fenced.lease_generation
FROM fenced
WHERE j.community_id = %(community_id)s AND j.run_id = fenced.id AND j.seq = %(seq)s AND {COMPENSABLE}
  AND (j.compensation_status IS NULL OR j.compensation_status = 'compensating')
  AND NOT EXISTS (SELECT 1 FROM {JOURNAL} AS k WHERE k.community_id = %(community_id)s AND k.run_id = fenced.id
                  AND k.seq > j.seq AND k.compensation IS NOT NULL
                  AND (k.status = 'succeeded' OR (k.status = 'failed' AND k.uncertain))
                  AND k.compensation_status IS DISTINCT FROM 'compensated')
RETURNING j.compensation, j.args, j.output, j.idempotency_key
"""

FINISH_COMPENSATION_IF_CURRENT = f"""
WITH fenced AS (
    SELECT r.id, r.lease_generation FROM {RUN} AS r
    WHERE {CURRENT_RUN_LEASE} AND r.unwinding
    FOR NO KEY UPDATE
)
UPDATE {JOURNAL} AS j
SET compensation_status = %(compensation_status)s, compensation_error = %(error)s,
    compensation_generation = fenced.lease_generation, compensated_at = {DB_NOW}
FROM fenced
WHERE j.community_id = %(community_id)s AND j.run_id = fenced.id AND j.seq = %(seq)s
  AND j.compensation_status = 'compensating'
RETURNING j.compensation_status
"""

PARK_FOR_APPROVAL_IF_CURRENT = f"""
UPDATE {RUN} AS r
SET state = 'waiting_approval', approval_id = %(approval_id)s, tool_calls_used = r.tool_calls_used + 1,
    lease_until = NULL, claimed_at = NULL,
    {run_entry("'park'", "r.lease_generation", "r.worker_id", status="'waiting_approval'", renewals="r.renewals")}
WHERE {CURRENT_RUN_LEASE} AND r.state IN ('running', 'waiting_tool') AND NOT r.unwinding
  AND r.tool_calls_used < r.max_tool_calls
  AND NOT EXISTS (SELECT 1 FROM {JOURNAL} AS j WHERE j.community_id = %(community_id)s AND j.run_id = %(run_id)s
                  AND j.kind = 'tool' AND j.status = 'pending' AND j.generation = %(lease_generation)s)
RETURNING r.tool_calls_used
"""

# The holder's own calls in flight: journaled under its generation, not yet recorded. Pending
# entries of an earlier generation are a crashed holder's, answered when the handler replays them.
# Read again once PARK_FOR_APPROVAL_IF_CURRENT holds the run row: its subquery saw the statement's
# snapshot, and a call journaled by a transaction that committed meanwhile is seen only now
# (journaling one takes the run row first, so none can commit after this read).
CALLS_IN_FLIGHT = f"""
SELECT j.seq FROM {JOURNAL} AS j
WHERE j.community_id = %(community_id)s AND j.run_id = %(run_id)s AND j.kind = 'tool' AND j.status = 'pending'
  AND j.generation = %(lease_generation)s
ORDER BY j.seq
"""

INSERT_AGENT_APPROVAL = f"""
INSERT INTO {APPROVAL} (id, community_id, run_id, step_id, step_generation, state, prompt, requested_at, deadline_at)
VALUES (%(approval_id)s, %(community_id)s, NULL, NULL, NULL, 'pending', %(prompt)s, {DB_NOW},
        {DB_NOW} + make_interval(secs => %(deadline_seconds)s))
"""

EXPIRE_APPROVAL_OF_RUN = f"""
UPDATE {APPROVAL} AS a SET state = 'expired', closed_at = {DB_NOW}
WHERE a.community_id = %(community_id)s AND a.state = 'pending' AND a.step_id IS NULL AND {ACTIVE}
  AND a.id = (SELECT r.approval_id FROM {RUN} AS r WHERE r.community_id = %(community_id)s AND r.id = %(run_id)s
              AND r.state = 'waiting_approval')
RETURNING a.id
"""

# The run's approval, still pending, that EXPIRE_APPROVAL_OF_RUN did not see: requested by a
# transaction that held the run row when the expiry read it, committed before the run was locked.
PENDING_APPROVAL_OF_RUN = f"""
SELECT a.id FROM {APPROVAL} AS a
WHERE a.community_id = %(community_id)s AND a.state = 'pending' AND a.step_id IS NULL
  AND a.id = (SELECT r.approval_id FROM {RUN} AS r WHERE r.community_id = %(community_id)s AND r.id = %(run_id)s
              AND r.state = 'waiting_approval')
"""

# A run unwinding for a cancel already (the operator's, or its workflow run's): a second cancel
# changes nothing (it would only fence the compensating holder again), and the holder the cancel
# fenced learns ``LeaseLost("cancelled")``.
UNWINDING_FOR_CANCEL = f"r.unwinding AND r.failure_code IN {CANCEL_CODES}"

CANCEL_IF_NOT_TERMINAL = f"""
UPDATE {RUN} AS r
SET state = 'cancelled', lease_generation = r.lease_generation + 1, lease_until = NULL, claimed_at = NULL,
    unwinding = false, failure_code = 'cancelled', failure_message = %(reason)s, finished_at = {DB_NOW},
    {run_entry("'cancel'", "r.lease_generation + 1", "%(actor)s::text", status="'cancelled'", renewals="r.renewals")}
WHERE r.community_id = %(community_id)s AND r.id = %(run_id)s AND r.state NOT IN {TERMINAL} AND {ACTIVE}
  AND NOT ({OUTSTANDING})
RETURNING r.id
"""

# A cancel with compensations outstanding: the holder is fenced (generation + 1, lease
# released) and the run goes back to ``pending`` unwinding, so a worker claims it, undoes its
# calls in reverse order and ``fail_run`` ends it ``cancelled`` (END_STATE_OF_UNWOUND).
CANCEL_TO_UNWIND_IF_OUTSTANDING = f"""
UPDATE {RUN} AS r
SET state = 'pending', unwinding = true, lease_generation = r.lease_generation + 1, lease_until = NULL,
    claimed_at = NULL, next_attempt_at = NULL, failure_code = 'cancelled', failure_message = %(reason)s
WHERE r.community_id = %(community_id)s AND r.id = %(run_id)s AND r.state NOT IN {TERMINAL} AND {ACTIVE}
  AND {OUTSTANDING} AND NOT ({UNWINDING_FOR_CANCEL})
RETURNING r.id
"""

RUN_UNWINDING_FOR_CANCEL = f"""
SELECT r.id FROM {RUN} AS r
WHERE r.community_id = %(community_id)s AND r.id = %(run_id)s AND r.state NOT IN {TERMINAL} AND {UNWINDING_FOR_CANCEL}
  AND {ACTIVE}
"""

# Taken before a cancel judges the journal: a holder's result committed meanwhile is then seen
# by the cancel's next statements (each reads a fresh snapshot), never missed.
LOCK_RUN = (
    f"SELECT r.id FROM {RUN} AS r WHERE r.community_id = %(community_id)s AND r.id = %(run_id)s FOR NO KEY UPDATE"
)


# Lock order with the core's batch settles: a batch that ends agent runs started from deliveries
# of more than one workflow run first locks those runs' core rows (``buzz_delivery_workflow_run``),
# in run id order, as a multi-run batch settle does (``sql.LOCK_RUNS_OF_DELIVERIES``). Ending each
# run counts it in its workflow step (``buzz_agents_run_ended``), under the engine's run row, in
# the order the statement ends them (agent run id order), while the settle's fan-in locks the same
# engine rows in delivery id order: two orders, a deadlock. Both now take the core rows of their
# runs first, in one order, so the second waits at its first run in common holding none of the
# first's engine rows. A batch of one workflow run's agent runs takes no such lock (it can hold at
# most that run's engine row, as a one-run settle): K workers completing one run's fan-out are
# not serialized on its core row. ``sources`` is read by the statement's first lock
# (``AFTER_SOURCES``, an InitPlan evaluated before any row is locked). Agent runs of no workflow
# run (an inbox event's) have no source run. The maintenance pass takes them too, over its
# candidate runs (``sources_of``: an array expression of agent run ids, of the community).
def sources_of(run_ids: str) -> str:
    """The CTE ``sources``: the core rows of the workflow runs of ``run_ids`` (an expression of
    ``uuid[]``), locked in run id order when there is more than one of them."""
    return f"""sources AS MATERIALIZED (
    SELECT w.id FROM {WORKFLOW_RUN} AS w
    WHERE w.community_id = %(community_id)s
      AND w.id IN (SELECT s.source_run_id FROM {RUN} AS s
                   WHERE s.community_id = %(community_id)s AND s.id = ANY({run_ids}))
      AND (SELECT count(DISTINCT s.source_run_id) FROM {RUN} AS s
           WHERE s.community_id = %(community_id)s AND s.id = ANY({run_ids})) > 1
    ORDER BY w.id
    FOR NO KEY UPDATE OF w
)"""


SOURCES = sources_of("%(run_ids)s::uuid[]")
AFTER_SOURCES = "AND (SELECT count(*) FROM sources) >= 0"

# LOCK_RUN of many runs of one community, in id order (fail_runs: as fail_run takes its one),
# after their workflow runs' core rows (SOURCES).
LOCK_RUNS = f"""
WITH {SOURCES}
SELECT r.id FROM {RUN} AS r WHERE r.community_id = %(community_id)s AND r.id = ANY(%(run_ids)s::uuid[])
  {AFTER_SOURCES}
ORDER BY r.id FOR NO KEY UPDATE OF r
"""

# A wake hint for run_agent_worker (SPEC 7's pattern): transactional, so it is delivered only if
# the run it announces was committed; it carries the community id and grants nothing.
NOTIFY_CLAIMABLE = "SELECT pg_notify(%(channel)s, %(community_id)s::text)"

# accept_delivery: the workflow run of the delivery, locked as a cancel or a completion locks
# it (run first: the engine's lock order), so a cancel either ends the run before the agent run
# exists (then the delivery is refused) or after (then the cancel sees the agent run).
LOCK_WORKFLOW_RUN_OF_DELIVERY = """
SELECT r.state FROM buzz_workflows_run AS r
JOIN buzz_delivery_delivery_record AS d ON d.community_id = r.community_id AND d.run_id = r.run_id
WHERE d.community_id = %(community_id)s AND d.id = %(delivery_id)s AND r.community_id = %(community_id)s
FOR NO KEY UPDATE OF r
"""

# -- Batched forms (the event-loop worker, agents/loop_worker.py): one statement for many runs of
# ONE community (Citus router form: ``community_id = %(community_id)s`` in every WHERE), each row
# fenced as its single form above is: its own run id and generation, the holder, a leased state,
# ``lease_until >= now`` and the community active. Every row the statement returns is that run's
# success; a run it did not return is judged on its own, exactly as the single form judges a miss
# (services/batch.py). A run appears at most once per statement.
BATCH_LEASES = "unnest(%(run_ids)s::uuid[], %(generations)s::bigint[])"
# ``r.id = ANY(run_ids)`` as well as the join: the runs are found by their key (community_id, id)
# whatever the planner thinks of the unnest, never by a scan of the community's runs.
CURRENT_RUN_LEASE_OF_ROW = f"""
    r.community_id = %(community_id)s
    AND r.id = ANY(%(run_ids)s::uuid[])
    AND r.id = u.run_id
    AND r.lease_generation = u.generation
    AND r.worker_id = %(worker_id)s
    AND r.state IN ('running', 'waiting_tool')
    AND r.lease_until >= {DB_NOW}
    AND {ACTIVE}
"""


# Lock order (review of issue 29): a batch's runs are locked in id order, whatever the plan, as
# LOCK_RUNS and a workflow cancel lock them. The worker sends a run's heartbeat, journal, result,
# completion, failure and compensation steps on different connections at once (the gateway's
# batch routes too), so two batches may hold the same runs; an ``UPDATE ... FROM unnest`` takes
# its rows in its plan's order (the array's, the heap's), and two such orders deadlock (a
# ``deadlock_timeout`` stall, then a retry or a replay). So each batched write first locks its
# fenced runs in a CTE, ``ORDER BY r.id ... FOR NO KEY UPDATE OF r`` (the lock re-checks the fence
# on the row's latest version, as an UPDATE does), and then writes only the rows it locked, found
# by their key. ``u``: the batch's rows; ``extra``: the write's own conditions; ``columns``: what
# the write takes from ``u``.
def locked_in_id_order(*, extra: str = "", columns: str = "") -> str:
    """The CTE ``locked(id, lease_generation{columns})``: the runs of ``u`` whose row holds their
    row's lease (and ``extra``), locked in id order."""
    return f"""locked AS MATERIALIZED (
    SELECT r.id, r.lease_generation{columns} FROM {RUN} AS r, u
    WHERE {CURRENT_RUN_LEASE_OF_ROW} {extra}
    ORDER BY r.id
    FOR NO KEY UPDATE OF r
)"""


# The row of a run ``locked`` holds (its key: one probe, the community for Citus's router).
LOCKED_RUN = "r.community_id = %(community_id)s AND r.id = locked.id"

HEARTBEAT_MANY_IF_CURRENT = f"""
WITH u AS MATERIALIZED (
    SELECT * FROM {BATCH_LEASES} AS u(run_id, generation)
), {locked_in_id_order()}
UPDATE {RUN} AS r SET lease_until = {RUN_LEASE_END}, heartbeat_at = {DB_NOW}, renewals = r.renewals + 1
FROM locked
WHERE {LOCKED_RUN}
RETURNING r.id, r.lease_until
"""

# journal_call for many runs: spend one slot each (within its budgets), then insert each entry
# ``pending`` with seq = the run's new tool_calls_used. A shadow run's destructive call is never
# batched (it is journaled ``failed`` by journal_call itself): such a row matches nothing here.
# A run with calls in flight (``waiting_tool``: parallel calls, each in its replay scope) journals
# another, as the one-run form does (the lease's states are judged by CURRENT_RUN_LEASE_OF_ROW).
_WITHIN_BUDGET = """AND NOT r.unwinding AND NOT (r.shadow AND u.destructive)
      AND r.tool_calls_used < r.max_tool_calls AND r.cost_used + u.cost <= r.max_cost"""
JOURNAL_MANY_IF_CURRENT_AND_WITHIN_BUDGET = f"""
WITH u AS MATERIALIZED (
    SELECT * FROM unnest(%(run_ids)s::uuid[], %(generations)s::bigint[], %(entry_ids)s::uuid[],
                         %(tool_names)s::text[], %(input_hashes)s::bytea[], %(args)s::jsonb[], %(costs)s::bigint[],
                         %(destructives)s::boolean[], %(compensations)s::jsonb[], %(scopes)s::text[],
                         %(scope_indexes)s::integer[])
        AS u(run_id, generation, entry_id, tool_name, input_hash, args, cost, destructive, compensation, scope,
             scope_index)
), {locked_in_id_order(extra=_WITHIN_BUDGET, columns=", u.cost")}, spent AS (
    UPDATE {RUN} AS r
    SET tool_calls_used = r.tool_calls_used + 1, cost_used = r.cost_used + locked.cost, state = 'waiting_tool'
    FROM locked
    WHERE {LOCKED_RUN}
    RETURNING r.id, r.tool_calls_used, r.lease_generation
)
INSERT INTO {JOURNAL} (id, community_id, run_id, seq, scope, scope_index, kind, tool_name, idempotency_key,
                       input_hash, args, cost, destructive, compensation, status, uncertain, blocked_reason, error,
                       finished_at, approval_id, generation)
SELECT u.entry_id, %(community_id)s, spent.id, spent.tool_calls_used, u.scope, u.scope_index, 'tool', u.tool_name,
       spent.id::text || ':' || spent.tool_calls_used::text, u.input_hash, u.args, u.cost, u.destructive,
       u.compensation, 'pending', false, NULL, NULL, NULL, NULL, spent.lease_generation
FROM spent JOIN u ON u.run_id = spent.id
RETURNING run_id, seq, idempotency_key
"""

# Each entry is found by its unique key (community_id, idempotency_key = "<run id>:<seq>"), one
# index probe per row whatever the planner thinks of the CTEs.
RECORD_MANY_IF_CURRENT = f"""
WITH u AS MATERIALIZED (
    SELECT * FROM unnest(%(run_ids)s::uuid[], %(generations)s::bigint[], %(seqs)s::integer[], %(statuses)s::text[],
                         %(uncertains)s::boolean[], %(outputs)s::jsonb[], %(output_hashes)s::bytea[],
                         %(errors)s::text[], %(latencies)s::integer[], %(keys)s::text[])
        AS u(run_id, generation, seq, status, uncertain, output, output_hash, error, latency_ms, key)
), {locked_in_id_order()}, fenced AS (
    UPDATE {RUN} AS r SET state = 'running'
    FROM locked
    WHERE {LOCKED_RUN}
    RETURNING r.id, r.lease_generation
)
UPDATE {JOURNAL} AS j
SET status = u.status, uncertain = u.uncertain, output = u.output, output_hash = u.output_hash,
    error = u.error, latency_ms = u.latency_ms, result_generation = fenced.lease_generation,
    finished_at = {DB_NOW}
FROM fenced JOIN u ON u.run_id = fenced.id
WHERE j.community_id = %(community_id)s AND j.idempotency_key = u.key AND j.run_id = fenced.id AND j.seq = u.seq
  AND j.status = 'pending' AND j.kind = 'tool'
RETURNING j.run_id, j.status
"""

# COMPLETE_IF_CURRENT's conditions for a row of ``u``: none of the holder's calls in flight, every
# call in the snapshot (re-checked when FOR NO KEY UPDATE finds a newer version of the row).
_COMPLETABLE = f"""AND r.state = 'running' AND NOT r.unwinding
      AND NOT EXISTS (SELECT 1 FROM {JOURNAL} AS j WHERE j.community_id = %(community_id)s AND j.run_id = r.id
                      AND j.kind = 'tool' AND j.status = 'pending' AND j.generation = u.generation)
      AND {SNAPSHOT_HOLDS_EVERY_CALL.format(journal=JOURNAL, run="r.id")}"""
COMPLETE_MANY_IF_CURRENT = f"""
WITH {SOURCES}, u AS MATERIALIZED (
    SELECT * FROM unnest(%(run_ids)s::uuid[], %(generations)s::bigint[], %(outputs)s::jsonb[],
                         %(output_hashes)s::bytea[])
        AS u(run_id, generation, output, output_hash)
), {locked_in_id_order(extra=f"{_COMPLETABLE} {AFTER_SOURCES}", columns=", u.output, u.output_hash")}
UPDATE {RUN} AS r
SET state = 'completed', output = locked.output, output_hash = locked.output_hash, lease_until = NULL,
    claimed_at = NULL, finished_at = {DB_NOW},
    {run_entry("'settle'", "r.lease_generation", "r.worker_id", status="'completed'", renewals="r.renewals")}
FROM locked
WHERE {LOCKED_RUN}
RETURNING r.id
"""

# fail_run for many runs (issue 29), one statement: each run fenced and locked as
# MARK_PENDING_UNCERTAIN fences its one; its pending calls closed failed and uncertain; then the
# run either ends (nothing to undo: FAIL_IF_CURRENT_AND_NOTHING_TO_UNDO's assignments) or is marked
# unwinding (MARK_UNWINDING_IF_CURRENT's), each with its own failure code and message. OUTSTANDING
# is read on the statement's snapshot, before the pending calls are closed: it counts a pending
# call with a compensation as outstanding already (PENDING_WITH_COMPENSATION), so it judges each
# run as the single form's second statement does after its first. The two run updates take
# disjoint rows (outstanding or not); a run not returned is judged on its own (``missed``).
FAIL_MANY_IF_CURRENT = f"""
WITH u AS MATERIALIZED (
    SELECT * FROM unnest(%(run_ids)s::uuid[], %(generations)s::bigint[], %(failure_codes)s::text[],
                         %(failure_messages)s::text[])
        AS u(run_id, generation, failure_code, failure_message)
), fenced AS MATERIALIZED (
    SELECT r.id, r.lease_generation, u.failure_code, u.failure_message, ({OUTSTANDING}) AS outstanding
    FROM {RUN} AS r, u
    WHERE {CURRENT_RUN_LEASE_OF_ROW}
    ORDER BY r.id
    FOR NO KEY UPDATE OF r
), marked AS (
    UPDATE {JOURNAL} AS j
    SET status = 'failed', uncertain = true, error = 'uncertain: the run failed while the call was pending',
        result_generation = fenced.lease_generation, finished_at = {DB_NOW}
    FROM fenced
    WHERE j.community_id = %(community_id)s AND j.run_id = fenced.id AND j.status = 'pending' AND j.kind = 'tool'
    RETURNING j.run_id
), ended AS (
    UPDATE {RUN} AS r
    SET state = {END_STATE_OF_UNWOUND}, failure_code = coalesce(r.failure_code, fenced.failure_code),
        failure_message = coalesce(r.failure_message, fenced.failure_message), lease_until = NULL, claimed_at = NULL,
        finished_at = {DB_NOW},
        {run_entry("'settle'", "r.lease_generation", "r.worker_id", status="'failed'", renewals="r.renewals")}
    FROM fenced
    WHERE r.community_id = %(community_id)s AND r.id = fenced.id AND NOT fenced.outstanding
    RETURNING r.id, r.state
), unwound AS (
    UPDATE {RUN} AS r
    SET unwinding = true, state = 'running', failure_code = coalesce(r.failure_code, fenced.failure_code),
        failure_message = coalesce(r.failure_message, fenced.failure_message)
    FROM fenced
    WHERE r.community_id = %(community_id)s AND r.id = fenced.id AND fenced.outstanding
    RETURNING r.id
)
SELECT ended.id, ended.state FROM ended
UNION ALL
SELECT unwound.id, 'unwinding' FROM unwound
"""

# begin_compensation / finish_compensation of many unwinding runs of one community (issue 29), one
# entry each: each run fenced and locked as the single forms' ``fenced`` does (its own lease,
# unwinding), each entry found by (run, seq) and moved under the single form's conditions (for a
# begin: the highest compensable entry not yet compensated, in the statement). A run not
# returned is judged on its own, as the single form judges a miss.
_FENCED_UNWINDING_MANY = f"""fenced AS MATERIALIZED (
    SELECT r.id, r.lease_generation, u.seq{{extra}} FROM {RUN} AS r, u
    WHERE {CURRENT_RUN_LEASE_OF_ROW} AND r.unwinding
    ORDER BY r.id
    FOR NO KEY UPDATE OF r
)"""
BEGIN_COMPENSATIONS_IF_CURRENT_AND_LAST = f"""
WITH u AS MATERIALIZED (
    SELECT * FROM unnest(%(run_ids)s::uuid[], %(generations)s::bigint[], %(seqs)s::integer[])
        AS u(run_id, generation, seq)
), {_FENCED_UNWINDING_MANY.format(extra="")}
UPDATE {JOURNAL} AS j
SET compensation_status = 'compensating', compensation_generation = fenced.lease_generation
FROM fenced
WHERE j.community_id = %(community_id)s AND j.run_id = fenced.id AND j.seq = fenced.seq AND {COMPENSABLE}
  AND (j.compensation_status IS NULL OR j.compensation_status = 'compensating')
  AND NOT EXISTS (SELECT 1 FROM {JOURNAL} AS k WHERE k.community_id = %(community_id)s AND k.run_id = fenced.id
                  AND k.seq > j.seq AND k.compensation IS NOT NULL
                  AND (k.status = 'succeeded' OR (k.status = 'failed' AND k.uncertain))
                  AND k.compensation_status IS DISTINCT FROM 'compensated')
RETURNING j.run_id, j.compensation, j.args, j.output
"""
FINISH_COMPENSATIONS_IF_CURRENT = f"""
WITH u AS MATERIALIZED (
    SELECT * FROM unnest(%(run_ids)s::uuid[], %(generations)s::bigint[], %(seqs)s::integer[],
                         %(compensation_statuses)s::text[], %(errors)s::text[])
        AS u(run_id, generation, seq, compensation_status, error)
), {_FENCED_UNWINDING_MANY.format(extra=", u.compensation_status, u.error")}
UPDATE {JOURNAL} AS j
SET compensation_status = fenced.compensation_status, compensation_error = fenced.error,
    compensation_generation = fenced.lease_generation, compensated_at = {DB_NOW}
FROM fenced
WHERE j.community_id = %(community_id)s AND j.run_id = fenced.id AND j.seq = fenced.seq
  AND j.compensation_status = 'compensating'
RETURNING j.run_id, j.compensation_status
"""

# OUTSTANDING_SEQS of many runs of one community (the runs FAIL_MANY_IF_CURRENT marked unwinding).
OUTSTANDING_SEQS_MANY = f"""
SELECT j.run_id, j.seq FROM {JOURNAL} AS j
WHERE j.community_id = %(community_id)s AND j.run_id = ANY(%(run_ids)s::uuid[]) AND {COMPENSABLE}
  AND j.compensation_status IS DISTINCT FROM 'compensated'
ORDER BY j.run_id, j.seq DESC
"""

# -- Streamed output (issue 29, agents/services/output.py). One fenced statement, one shard on
# Citus (issue 30): the chunk is inserted from the holder's run row, locked as an UPDATE locks it
# (concurrent emits of one run take turns, and a waiter re-reads the fence, the bound and the
# counter on the row its predecessor left), so no row comes from a stale, cancelled or lapsed
# holder and none past the run's byte bound; the chunk's insert trigger (agents migration 0020)
# moves the run's counters, checking that the seq is their next. (The target's alias is for
# Citus 13, which sends an unqualified RETURNING as the table's name, not its shard's.)
EMIT_IF_CURRENT_AND_WITHIN_BOUND = f"""
INSERT INTO {OUTPUT} AS o (id, community_id, run_id, seq, chunk, generation)
SELECT %(chunk_id)s, r.community_id, r.id, r.output_chunks + 1, %(chunk)s, r.lease_generation
FROM {RUN} AS r
WHERE {CURRENT_RUN_LEASE} AND r.output_bytes + %(size)s <= %(max_stream_bytes)s
FOR NO KEY UPDATE OF r
RETURNING o.seq
"""

OUTPUT_USED = f"""
SELECT r.output_bytes FROM {RUN} AS r WHERE r.community_id = %(community_id)s AND r.id = %(run_id)s
"""

# A reader's page: the run's state first (a separate statement, read before the chunks: when it
# is terminal, every chunk it will ever have is committed and the read after it sees them all).
RUN_STATE = f"SELECT r.state FROM {RUN} AS r WHERE r.community_id = %(community_id)s AND r.id = %(run_id)s"
OUTPUT_AFTER = f"""
SELECT o.seq, o.chunk FROM {OUTPUT} AS o
WHERE o.community_id = %(community_id)s AND o.run_id = %(run_id)s AND o.seq > %(after)s
ORDER BY o.seq
LIMIT %(limit)s
"""
