"""Every statement of the engine that changes step, run or approval state, named for its guard.

All times come from the database clock (``buzz_delivery_now()``); no CASE/COALESCE holds a
clock or interval expression and no SET applies a STABLE function to a column (SPEC 15):
intervals come from bind parameters. Every UPDATE names ``community_id`` in its own WHERE and
checks the community is ``active`` inside the statement.

The lease statements of a step (claim, complete, fail, retry, park, the approval's resume) and
the maintenance's (``services.maintenance``) append one entry to its ``history`` in their own
SET list (:func:`buzz_delivery.services.sql.history_entry`), as the core's do for deliveries;
a renew only counts (``renewals``).
"""

from __future__ import annotations

from buzz_delivery.services import flow
from buzz_delivery.services.sql import DB_NOW, WORKFLOW_RUN, history_entry
from buzz_delivery.workflows.models import MAX_DEPTH, Run, Step

STEP = "buzz_workflows_step"
RUN = "buzz_workflows_run"
APPROVAL = "buzz_workflows_approval"
SENT_EVENT = "buzz_workflows_sent_event"
COMMUNITY = "buzz_delivery_community"


def step_entry(event: str, generation: str, actor: str, *, status: str, **extra: str) -> str:
    """The SET assignment appending one entry to a step's history (alias ``s``)."""
    return history_entry(event, generation, actor, status=status, alias="s", **extra)


ACTIVE = f"EXISTS (SELECT 1 FROM {COMMUNITY} c WHERE c.id = %(community_id)s AND c.deletion_state = 'active')"
LEASE_END = f"{DB_NOW} + make_interval(secs => %(lease_seconds)s)"
CLEAR_LEASE = "lease_until = NULL, claimed_at = NULL"
CURRENT_STEP_LEASE = f"""
    s.community_id = %(community_id)s
    AND s.id = %(step_id)s
    AND s.lease_generation = %(lease_generation)s
    AND s.state = 'running'
    AND s.lease_until >= {DB_NOW}
    AND {ACTIVE}
"""

LOCK_RUN = f"SELECT 1 FROM {RUN} WHERE community_id = %(community_id)s AND run_id = %(run_id)s FOR NO KEY UPDATE"


# Lock order with the core's multi-run batch settle (``buzz_delivery.services.sql.
# LOCK_RUNS_OF_DELIVERIES``): it locks its runs' core rows (``buzz_delivery_workflow_run``, the
# engine run's id) in run id order, then its fan-in locks their engine rows in the order it meets
# its deliveries. A transaction of the engine that locks more than one engine run (LOCK_RUNS, a
# cancel's walk of a run tree) first locks their core rows in run id order too, as the agents'
# batches do (``agents.services.sql.sources_of``): the second of the two waits at its first core
# row in common, holding no engine row. Engine rows alone, in another order, met such a settle:
# each held an engine run row the other waited for ("deadlock detected"). One run takes no core
# row (a one-run settle takes none either), unless its transaction locks other runs in other
# statements (``send_event``'s pages: ``LOCK_RUNS_AND_CORE``).
def core_runs_of(run_ids: str, *, when_many: bool = True) -> str:
    """The core rows of the runs of ``run_ids`` (an expression of ``uuid[]`` without duplicates),
    locked in run id order when there is more than one of them (``when_many``), else always."""
    many = f" AND cardinality({run_ids}) > 1" if when_many else ""
    return f"""SELECT w.id FROM {WORKFLOW_RUN} AS w
    WHERE w.community_id = %(community_id)s AND w.id = ANY({run_ids}){many}
    ORDER BY w.id
    FOR NO KEY UPDATE OF w"""


# Many runs of one community, in run id order (the maintenance's batch, the left deliveries'
# expiry, send_event), after their core rows (``core``, read by an InitPlan: evaluated before any
# engine row is locked).
_LOCK_RUNS = f"""
WITH core AS MATERIALIZED ({{core}})
SELECT 1 FROM {RUN} AS r WHERE r.community_id = %(community_id)s AND r.run_id = ANY(%(run_ids)s::uuid[])
  AND (SELECT count(*) FROM core) >= 0
ORDER BY r.run_id FOR NO KEY UPDATE OF r"""
LOCK_RUNS = _LOCK_RUNS.format(core=core_runs_of("%(run_ids)s::uuid[]"))
# The same, the core row taken for one run too: a transaction that locks runs in more than one
# LOCK_RUNS (``send_event``'s pages, in run id order) holds the core row of every engine row it
# locks, whatever each statement's count. A page of one run locked its engine row alone: the send
# held it, then waited for a later page's run held by a multi-run settle, which held both core
# rows and waited for the first run's engine row (tests/test_settle_vs_engine_lock_runs_order.py).
LOCK_RUNS_AND_CORE = _LOCK_RUNS.format(core=core_runs_of("%(run_ids)s::uuid[]", when_many=False))


# The core rows, in run id order, of the run trees that the runs of ``start`` (a condition on alias
# ``b``) are in, from their roots: the CTEs of a ``WITH RECURSIVE``, ``core`` last. The engine rows
# an end of those runs locks: a run that fails, is canceled, or passes its deadline, cancels its
# running children in ``buzz_workflows_end_run``'s walk (a ``sub_workflow`` step whose wait timed
# out has its child run canceled, ``END_RUN_IF_ACTIVE``, and the child's children with it), and a
# run's end locks its parent's engine row, for the parent's step, which fails with it (a canceled
# child too: ``child_run_canceled``): under ``on_error: fail_run`` the parent ends too, so its own
# parent's engine row is locked and its other children are canceled, and so on up to the root.
# Those engine rows locked one after another, no core row first, met a multi-run settle of
# deliveries of the same runs, which held their core rows and locked their engine rows in the order
# it met its deliveries: deadlock detected (tests/test_settle_vs_engine_lock_runs_order.py, one
# level and two levels up, the maintenance and cancel_run). ``up`` walks from each run to its root
# by the primary key (a run's ancestors, whatever their state: an ended one's engine row is still
# locked by its child's end; at most ``models.MAX_DEPTH`` hops, the bound of ``depth``), ``tree``
# down from all of those over their running descendants by the parent index (a sub-workflow's run
# is in its parent's community, ``runs.create_run``: router form, each reading names the
# community). A tree's running runs all take their core rows, though an end reaches only what its
# steps' ``on_error`` reach: fewer locks would need the definitions, and a settle meets it at its
# first core row in common, holding no engine row. One builder makes both statements below, so the
# maintenance and cancel_run cannot drift apart.
def core_runs_of_trees(start: str) -> str:
    """The CTEs locking the core rows of the whole run trees of the runs ``start`` selects (a
    condition on ``b``, a run of the community), in run id order when more than one."""
    return f"""up(run_id, parent_run_id, hops) AS (
    SELECT b.run_id, b.parent_run_id, 0 FROM {RUN} AS b
    WHERE b.community_id = %(community_id)s AND {start}
    UNION ALL
    SELECT p.run_id, p.parent_run_id, up.hops + 1 FROM {RUN} AS p JOIN up ON p.run_id = up.parent_run_id
    WHERE p.community_id = %(community_id)s AND up.hops < {MAX_DEPTH}
), tree(run_id) AS (
    SELECT up.run_id FROM up
    UNION
    SELECT r.run_id FROM {RUN} AS r JOIN tree ON r.parent_run_id = tree.run_id
    WHERE r.community_id = %(community_id)s AND r.state = 'running'
), ids AS MATERIALIZED (
    SELECT ARRAY(SELECT tree.run_id FROM tree) AS run_ids
), core AS MATERIALIZED ({core_runs_of("(SELECT ids.run_ids FROM ids)::uuid[]")})"""


# The maintenance's batch (``services.maintenance``): LOCK_RUNS over the batch's runs, after the
# core rows of every run the batch may end or lock, the trees its runs are in (``core``, read by
# an InitPlan: evaluated before any engine row is locked).
LOCK_RUNS_AND_TREES = f"""
WITH RECURSIVE {core_runs_of_trees("b.run_id = ANY(%(run_ids)s::uuid[])")}
SELECT 1 FROM {RUN} AS r WHERE r.community_id = %(community_id)s AND r.run_id = ANY(%(run_ids)s::uuid[])
  AND (SELECT count(*) FROM core) >= 0
ORDER BY r.run_id FOR NO KEY UPDATE OF r"""
# cancel_run: the core rows of the canceled run's whole tree, from its root, before its walk locks
# any engine row (the run, its running descendants; its parent, for the parent's step, and up from
# there under ``on_error: fail_run``, with the other children of each run that fails). Its tree
# and its parent's alone left the rest: a cancel of a child two levels down failed its parent and
# grandparent and canceled the side runs, their engine rows locked with no core row first, while a
# multi-run settle held their core rows (deadlock detected).
LOCK_CORE_RUNS_OF_TREE = f"""
WITH RECURSIVE {core_runs_of_trees("b.run_id = %(run_id)s")}
SELECT count(*) FROM core"""
# A batch completion takes the runs that are free now, in id order, and never waits for one:
# a run locked by a cancel, a fan-in or another batch is completed on its own afterwards.
LOCK_FREE_RUNS = f"""SELECT run_id FROM {RUN} WHERE community_id = %(community_id)s AND run_id = ANY(%(run_ids)s)
ORDER BY run_id FOR NO KEY UPDATE SKIP LOCKED"""


# The claim returns whole step rows (built into model instances without a second query) and
# the run's pinned definition id (definitions are immutable: cached per process).
_CLAIM_STEP_SET = f"""state = 'running',
    lease_generation = s.lease_generation + 1,
    attempts = s.attempts + 1,
    claimed_at = {DB_NOW},
    started_at = {DB_NOW},
    lease_until = {LEASE_END},
    next_attempt_at = NULL,
    claimed_by = %(holder)s,
    renewals = 0,
    {step_entry("'claim'", "s.lease_generation + 1", "%(holder)s::text", status="'running'", attempt="s.attempts + 1")}"""  # noqa: E501

# Without a concurrency limit the claimed steps hold no slot (a step once claimed under a limit
# and back to ready keeps its old numbers, which must not follow it into ``running``).
_CLAIM_READY_STEPS = f"""
WITH candidate AS MATERIALIZED (
    SELECT s.id FROM {STEP} AS s
    WHERE s.community_id = %(community_id)s
      AND s.state = 'ready'{{kind_filter}}
      AND (s.next_attempt_at IS NULL OR s.next_attempt_at <= {DB_NOW})
      AND {ACTIVE}
    ORDER BY s.priority DESC, s.ready_at, s.id
    LIMIT %(limit)s
    FOR UPDATE OF s SKIP LOCKED
)
UPDATE {STEP} AS s
SET {_CLAIM_STEP_SET},
    slot_community = NULL, slot_workflow = NULL, slot_step = NULL
FROM candidate, unnest(ARRAY(SELECT candidate.id FROM candidate)) AS listed(id)
-- Through the primary key, joined with both the candidates and their ids as an array: a generic
-- plan (the plan-cached function's, a prepared statement's) then probes the key from whichever it
-- estimates smaller, the CTE (a tenth of the claimable steps it estimates for the community) or
-- the array (ten). Either alone lost to a read of the whole community: the array whenever the
-- statistics gave a community fewer than ten rows (a fleet of small communities), the CTE in a
-- community with a large backlog (a hash join over its steps): test_engine_claim_plan_fleet_stats.
-- With no state test: the candidates were locked
-- FOR UPDATE after their latest version was re-checked (still ready), and a state test would
-- let a plan reach them through the ready index or a scan of every ready step of the community;
-- the run's definition by its key, row by row (a join let the plan-cached function's generic
-- plan scan the community's runs: tests/test_wf_cached_statements.py).
WHERE s.community_id = %(community_id)s AND s.id = candidate.id AND s.id = listed.id
RETURNING {{step_columns}},
    (SELECT r.definition_id FROM {RUN} AS r WHERE r.community_id = %(community_id)s AND r.run_id = s.run_id)
"""

# Under the operator's STEP_CONCURRENCY_LIMITS (services/flow.py; ``cap_community``,
# ``cap_workflow``, ``cap_step``: the maximum per key, NULL = no limit of that kind): the same
# candidates but those of a workflow (or a workflow's step key) at its limit, each taking the
# free slot of its rank in every limited kind; one without stays ready. The step records its
# run's workflow (``slot_workflow_id``), which the workflow and step keys' indexes name. Run
# under the community's claim lock (flow.claim_holding_slots).
_RUNNING = "h.state = 'running'"
_STEP_SLOT_KINDS = {
    "community": ("slot_community", ()),
    "workflow": ("slot_workflow", ("workflow_id",)),
    "step": ("slot_step", ("workflow_id", "key")),
}
_CLAIM_READY_STEPS_UNDER_LIMITS = f"""
WITH {flow.full_keys("community", STEP, _RUNNING, "slot_community", ())},
{flow.full_keys("workflow", STEP, _RUNNING, "slot_workflow", ("slot_workflow_id",))},
{flow.full_keys("step", STEP, _RUNNING, "slot_step", ("slot_workflow_id", "key"))},
candidate AS MATERIALIZED (
    SELECT s.id, s.key, s.priority, s.ready_at, w.workflow_id FROM {STEP} AS s
    JOIN {RUN} AS w ON w.community_id = s.community_id AND w.run_id = s.run_id
    WHERE s.community_id = %(community_id)s
      AND s.state = 'ready'
      AND (s.next_attempt_at IS NULL OR s.next_attempt_at <= {DB_NOW})
      AND {ACTIVE}
      AND NOT EXISTS (SELECT 1 FROM full_community)
      AND NOT EXISTS (SELECT 1 FROM full_workflow AS f WHERE f.slot_workflow_id = w.workflow_id)
      AND NOT EXISTS (SELECT 1 FROM full_step AS f WHERE f.slot_workflow_id = w.workflow_id AND f.key = s.key)
    ORDER BY s.priority DESC, s.ready_at, s.id
    LIMIT LEAST(%(limit)s, %(cap_community)s::integer)
    FOR UPDATE OF s SKIP LOCKED
),
{flow.free_slots("community", STEP, _RUNNING, "slot_community", ())},
{flow.free_slots("workflow", STEP, _RUNNING, "slot_workflow", (("workflow_id", "slot_workflow_id"),))},
{flow.free_slots("step", STEP, _RUNNING, "slot_step", (("workflow_id", "slot_workflow_id"), ("key", "key")))},
{flow.admitted(_STEP_SLOT_KINDS, "c.priority DESC, c.ready_at, c.id")}
UPDATE {STEP} AS s
SET {_CLAIM_STEP_SET},
    slot_community = admitted.slot_community, slot_workflow = admitted.slot_workflow,
    slot_step = admitted.slot_step, slot_workflow_id = admitted.workflow_id
FROM candidate, admitted, unnest(ARRAY(SELECT admitted.id FROM admitted)) AS listed(id), {RUN} AS r
-- Through the primary key, driven by the candidates or the admitted ids as an array, whichever
-- the plan estimates smaller (as CLAIM_READY_STEPS; the admitted's own estimate is no help).
-- The candidates were locked FOR UPDATE after
-- their latest version was re-checked, so no state test here (it would let the ready index win
-- the join and read every ready step of the community).
WHERE s.community_id = %(community_id)s AND s.id = candidate.id AND s.id = admitted.id AND s.id = listed.id
  AND r.community_id = s.community_id AND r.run_id = s.run_id
RETURNING {{step_columns}}, r.definition_id
"""

# Everything but the history (deferred: read on the detail page only).
_CLAIM_FIELDS = [f for f in Step._meta.concrete_fields if f.name != "history"]
STEP_ATTNAMES = [f.attname for f in _CLAIM_FIELDS]
# (``replace``, not ``format``: the history entry holds braces of its own.)
_STEP_COLUMNS = ", ".join(f"s.{f.column}" for f in _CLAIM_FIELDS)
CLAIM_READY_STEPS = _CLAIM_READY_STEPS.replace("{step_columns}", _STEP_COLUMNS).replace("{kind_filter}", "")
# The claim of ready ``send_message`` steps only (issue 31: an orchestrator whose step threads
# are all busy still claims the sends, which take no thread: its completer sends them in bulk).
CLAIM_READY_SENDS = _CLAIM_READY_STEPS.replace("{step_columns}", _STEP_COLUMNS).replace(
    "{kind_filter}", " AND s.kind = 'send_message'"
)
CLAIM_READY_STEPS_UNDER_LIMITS = _CLAIM_READY_STEPS_UNDER_LIMITS.replace("{step_columns}", _STEP_COLUMNS)

# What a send_message step reads of its run (the executor): the fields its deliveries bind to,
# not the run's input, output and tags, which the ORM's ``step.run`` read in full for every send.
RUN_FOR_SEND_FIELDS = (
    "workflow_id",
    "definition_id",
    "cause_kind",
    "cause_event_id",
    "cause_scheduled_for",
    "cause_webhook_invocation_id",
    "trace_context",
    "priority",
)
RUN_FOR_SEND = f"""
SELECT r.community_id, r.run_id, {", ".join(f"r.{name}" for name in RUN_FOR_SEND_FIELDS)} FROM {RUN} AS r
WHERE r.community_id = %(community_id)s AND r.run_id = %(run_id)s
"""

# In round-robin order: the communities after %(after)s first, then from the first again
# (%(after)s NULL: from the first), so that past the limit every community gets its turn.
RUNS_FOR_SEND = RUN_FOR_SEND.replace("r.run_id = %(run_id)s", "r.run_id = ANY(%(run_ids)s::uuid[])")

COMMUNITIES_WITH_READY_STEPS = f"""
SELECT s.community_id FROM {STEP} AS s
WHERE s.state = 'ready' AND (s.next_attempt_at IS NULL OR s.next_attempt_at <= {DB_NOW})
GROUP BY s.community_id
ORDER BY s.community_id <= %(after)s::uuid, s.community_id
LIMIT %(limit)s
"""

# How many steps of one community (at most %(limit)s) have been claimable for %(seconds)s or
# more (since they became ready, or since their backoff ended): a following orchestrator claims
# only that many (issue 31, ``buzz_delivery.workflows.orchestrator``). A plain read; a
# community that is not active has none (its claim takes nothing).
STEPS_LEFT_WAITING = f"""
SELECT count(*) FROM (
    SELECT 1 FROM {STEP} AS s
    WHERE s.community_id = %(community_id)s AND s.state = 'ready'
      AND COALESCE(s.next_attempt_at, s.ready_at) <= {DB_NOW} - make_interval(secs => %(seconds)s)
      AND {ACTIVE}
    LIMIT %(limit)s
) AS waited
"""

RENEW_IF_CURRENT_GENERATION = f"""
UPDATE {STEP} AS s SET lease_until = {LEASE_END}, renewals = s.renewals + 1
WHERE {CURRENT_STEP_LEASE}
RETURNING s.lease_until
"""

# The renewal of many leases of one community in one statement (an orchestrator's renewal round),
# each row fenced as RENEW_IF_CURRENT_GENERATION fences its one: a row not returned lost its lease.
RENEW_MANY_IF_CURRENT_GENERATION = f"""
UPDATE {STEP} AS s SET lease_until = {LEASE_END}, renewals = s.renewals + 1
FROM unnest(%(step_ids)s::uuid[], %(lease_generations)s::bigint[]) AS u(id, generation)
WHERE s.community_id = %(community_id)s
  AND s.id = u.id
  AND s.lease_generation = u.generation
  AND s.state = 'running'
  AND s.lease_until >= {DB_NOW}
  AND {ACTIVE}
RETURNING s.id, s.lease_generation, s.lease_until
"""

# A claim its holder never started, handed back: ``ready`` again in its place (ready_at kept),
# the attempt it took given back, the generation bumped (the old lease is fenced).
RELEASE_MANY_IF_CURRENT_GENERATION = f"""
UPDATE {STEP} AS s
SET state = 'ready', attempts = s.attempts - 1, lease_generation = s.lease_generation + 1, {CLEAR_LEASE},
    next_attempt_at = NULL,
    {step_entry("'release'", "s.lease_generation + 1", "s.claimed_by", status="'ready'", renewals="s.renewals")}
FROM unnest(%(step_ids)s::uuid[], %(lease_generations)s::bigint[]) AS u(id, generation)
WHERE s.community_id = %(community_id)s AND s.id = u.id AND s.lease_generation = u.generation
  AND s.state = 'running' AND s.lease_until >= {DB_NOW} AND {ACTIVE}
RETURNING s.id
"""

COMPLETE_IF_CURRENT_GENERATION = f"""
UPDATE {STEP} AS s
SET state = 'succeeded', output = %(output)s::jsonb, failure_code = NULL, failure_message = NULL,
    {CLEAR_LEASE}, finished_at = {DB_NOW},
    {step_entry("'settle'", "s.lease_generation", "s.claimed_by", status="'succeeded'", renewals="s.renewals")}
WHERE {CURRENT_STEP_LEASE}
RETURNING s.state
"""

# Many completions of one community in one statement, each row fenced by its own step id and
# generation; the Advance trigger runs per row, in the same statement.
COMPLETE_MANY_IF_CURRENT_GENERATION = f"""
UPDATE {STEP} AS s
SET state = 'succeeded', output = u.output, failure_code = NULL, failure_message = NULL,
    {CLEAR_LEASE}, finished_at = {DB_NOW},
    {step_entry("'settle'", "s.lease_generation", "s.claimed_by", status="'succeeded'", renewals="s.renewals")}
FROM unnest(%(step_ids)s::uuid[], %(lease_generations)s::bigint[], %(outputs)s::jsonb[]) AS u(id, generation, output)
WHERE s.community_id = %(community_id)s
  AND s.id = u.id
  AND s.lease_generation = u.generation
  AND s.state = 'running'
  AND s.lease_until >= {DB_NOW}
  AND {ACTIVE}
RETURNING s.id
"""

# SET LOCAL statements, not set_config(..., true): Citus carries the statement to the shards, where
# the release trigger reads the setting (with set_config a completer's claimed releases still woke
# every orchestrator on the cluster, once the listeners heard the shards).
DEFER_NOTIFY = "SET LOCAL buzz_workflows.notify_deferred = 'on'"
UNDEFER_NOTIFY = "SET LOCAL buzz_workflows.notify_deferred = ''"

# After a completing transaction claimed what it could: wake the others when ready steps are left.
NOTIFY_IF_READY_LEFT = f"""
SELECT pg_notify('buzz_workflows', %(community_id)s::text)
WHERE EXISTS (
    SELECT 1 FROM {STEP} AS s
    WHERE s.community_id = %(community_id)s AND s.state = 'ready'
      AND (s.next_attempt_at IS NULL OR s.next_attempt_at <= {DB_NOW})
)
"""

FAIL_IF_CURRENT_GENERATION = f"""
UPDATE {STEP} AS s
SET state = 'failed', failure_code = %(failure_code)s, failure_message = %(failure_message)s,
    {CLEAR_LEASE}, finished_at = {DB_NOW},
    {step_entry("'settle'", "s.lease_generation", "s.claimed_by", status="'failed'", renewals="s.renewals")}
WHERE {CURRENT_STEP_LEASE}
RETURNING s.state
"""

RETRY_IF_CURRENT_GENERATION = f"""
UPDATE {STEP} AS s
SET state = 'ready', failure_code = %(failure_code)s, failure_message = %(failure_message)s,
    {CLEAR_LEASE}, ready_at = {DB_NOW}, next_attempt_at = {DB_NOW} + make_interval(secs => %(delay_seconds)s),
    {step_entry("'retry'", "s.lease_generation", "s.claimed_by", status="'ready'", renewals="s.renewals")}
WHERE {CURRENT_STEP_LEASE} AND s.attempts = %(attempts)s AND s.attempts < s.max_attempts
RETURNING s.state
"""

PARK_IF_CURRENT_GENERATION = f"""
UPDATE {STEP} AS s
SET state = 'waiting', {CLEAR_LEASE}, waiting_since = {DB_NOW},
    wait_deadline = {DB_NOW} + make_interval(secs => %(wait_seconds)s),
    expected = %(expected)s, child_run_id = %(child_run_id)s,
    {step_entry("'park'", "s.lease_generation", "s.claimed_by", status="'waiting'", renewals="s.renewals")}
WHERE {CURRENT_STEP_LEASE}
RETURNING s.state, s.wait_deadline
"""

# Many failed attempts of one community (fail_steps), each row fenced by its own lease as the
# single statements above fence theirs: the retries (each with its own delay, jitter included,
# computed from the policy read at its generation) and the final failures, one statement each.
# The park of many send_message steps of one community (a batch of sends, issue 31), each row
# fenced as PARK_IF_CURRENT_GENERATION fences its one (a row not returned is not parked, and
# the batch writes nothing for it): the step rows are locked first in id order (two batches,
# or a batch and a single park, never take two steps in opposite orders).
PARK_SENDS_IF_CURRENT_GENERATION = f"""
WITH locked AS MATERIALIZED (
    SELECT s.id FROM {STEP} AS s
    WHERE s.community_id = %(community_id)s AND s.id = ANY(%(step_ids)s::uuid[])
    ORDER BY s.id
    FOR NO KEY UPDATE
)
UPDATE {STEP} AS s
SET state = 'waiting', {CLEAR_LEASE}, waiting_since = {DB_NOW},
    wait_deadline = buzz_delivery_plus_seconds({DB_NOW}, u.wait_seconds),
    expected = u.expected, child_run_id = NULL,
    {step_entry("'park'", "s.lease_generation", "s.claimed_by", status="'waiting'", renewals="s.renewals")}
FROM unnest(%(step_ids)s::uuid[], %(lease_generations)s::bigint[], %(expected)s::integer[],
            %(wait_seconds)s::double precision[]) AS u(id, generation, expected, wait_seconds)
WHERE s.community_id = %(community_id)s
  AND s.id = u.id
  AND s.id IN (SELECT l.id FROM locked AS l)
  AND s.lease_generation = u.generation
  AND s.state = 'running'
  AND s.lease_until >= {DB_NOW}
  AND {ACTIVE}
RETURNING s.id
"""

STEP_RETRY_POLICIES = f"""
SELECT s.id, s.max_attempts, s.backoff_base_seconds, s.backoff_cap_seconds FROM {STEP} AS s
JOIN unnest(%(step_ids)s::uuid[], %(lease_generations)s::bigint[]) AS u(id, generation)
  ON s.id = u.id AND s.lease_generation = u.generation
WHERE s.community_id = %(community_id)s
"""

RETRY_MANY_IF_CURRENT_GENERATION = f"""
UPDATE {STEP} AS s
SET state = 'ready', failure_code = u.failure_code, failure_message = u.failure_message,
    {CLEAR_LEASE}, ready_at = {DB_NOW}, next_attempt_at = buzz_delivery_plus_seconds({DB_NOW}, u.delay),
    {step_entry("'retry'", "s.lease_generation", "s.claimed_by", status="'ready'", renewals="s.renewals")}
FROM unnest(%(step_ids)s::uuid[], %(lease_generations)s::bigint[], %(attempt_numbers)s::integer[],
            %(failure_codes)s::text[], %(failure_messages)s::text[], %(delays)s::double precision[])
     AS u(id, generation, attempts, failure_code, failure_message, delay)
WHERE s.community_id = %(community_id)s
  AND s.id = u.id
  AND s.lease_generation = u.generation
  AND s.state = 'running'
  AND s.lease_until >= {DB_NOW}
  AND {ACTIVE}
  AND s.attempts = u.attempts AND s.attempts < s.max_attempts
RETURNING s.id
"""

FAIL_MANY_IF_CURRENT_GENERATION = f"""
UPDATE {STEP} AS s
SET state = 'failed', failure_code = u.failure_code, failure_message = u.failure_message,
    {CLEAR_LEASE}, finished_at = {DB_NOW},
    {step_entry("'settle'", "s.lease_generation", "s.claimed_by", status="'failed'", renewals="s.renewals")}
FROM unnest(%(step_ids)s::uuid[], %(lease_generations)s::bigint[], %(failure_codes)s::text[],
            %(failure_messages)s::text[]) AS u(id, generation, failure_code, failure_message)
WHERE s.community_id = %(community_id)s
  AND s.id = u.id
  AND s.lease_generation = u.generation
  AND s.state = 'running'
  AND s.lease_until >= {DB_NOW}
  AND {ACTIVE}
RETURNING s.id
"""

STEP_AT_GENERATION = f"""
SELECT s.state FROM {STEP} AS s
WHERE s.community_id = %(community_id)s AND s.id = %(step_id)s AND s.lease_generation = %(lease_generation)s
"""

STEP_RETRY_POLICY = f"""
SELECT s.attempts, s.max_attempts, s.backoff_base_seconds, s.backoff_cap_seconds FROM {STEP} AS s
WHERE s.community_id = %(community_id)s AND s.id = %(step_id)s AND s.lease_generation = %(lease_generation)s
"""

# --- run creation (one statement: the core run, the engine run and its steps) -------------------

LATEST_VERSION = """
SELECT d.id FROM buzz_workflows_definition AS d
WHERE d.community_id = %(community_id)s AND d.workflow_id = %(workflow_id)s
ORDER BY d.version DESC LIMIT 1
"""

# The same check inside the plan-cached start (the prelude of ``cached.CREATE_RUN``, PL/pgSQL):
# with ``p_latest`` the run is of the workflow's latest version and ``p_definition_id`` the
# latest its caller's process last saw; when another version is latest the start writes nothing
# and returns no row (the caller reads the latest and starts on it). A statement of its own
# before the start's, so that the start stays ``INSERT ... VALUES`` (router form on Citus: an
# ``INSERT ... SELECT`` was planned through the coordinator there, and a duplicate key then
# failed the connection rather than raising unique_violation). Issue 31: the read was a statement
# and an autocommit transaction of its own on every start.
LATEST_VERSION_CHECK_IN_FUNCTION = """    IF p_latest AND p_definition_id IS DISTINCT FROM (
        SELECT d.id FROM buzz_workflows_definition AS d
        WHERE d.community_id = p_community_id AND d.workflow_id = p_workflow_id
        ORDER BY d.version DESC LIMIT 1) THEN
        RETURN;  -- another version is the latest: nothing written, no row
    END IF;
"""

PINNED_VERSION = """
SELECT d.id FROM buzz_workflows_definition AS d
WHERE d.community_id = %(community_id)s AND d.workflow_id = %(workflow_id)s AND d.version = %(version)s
"""

_RUN_INSERT_COLUMNS = (
    "run_id, community_id, workflow_id, definition_id, state, input, cause_kind, cause_event_id, "
    "cause_scheduled_for, cause_webhook_invocation_id, idempotency_key, parent_run_id, parent_step_key, "
    "depth, restart_of_id, steps_total, steps_left, deadline_at, deliveries_to_expire, tags, trace_context, "
    "priority"
)
_STEP_SHAPE = (
    "id uuid, key text, kind text, state text, position integer, depends_on text[], dependents text[], "
    "deps_total integer, on_error text, when_cond jsonb, max_attempts integer, timeout_seconds integer, "
    "backoff_base_seconds double precision, backoff_cap_seconds double precision, tolerate_failures integer"
)
_STEP_INSERT = f"""
    INSERT INTO {STEP} (id, community_id, run_id, key, kind, state, position, depends_on, dependents,
        deps_total, deps_done, deps_blocked, on_error, when_cond, max_attempts, attempts, timeout_seconds,
        backoff_base_seconds, backoff_cap_seconds, lease_generation, ready_at, delivered_terminal,
        delivered_failed, tolerate_failures, priority)
    SELECT x.id, %(community_id)s, %(run_id)s, x.key, x.kind, x.state, x.position, x.depends_on, x.dependents,
        x.deps_total, 0, 0, x.on_error, x.when_cond, x.max_attempts, 0, x.timeout_seconds,
        x.backoff_base_seconds, x.backoff_cap_seconds, 0, {{ready_at}}, 0, 0, x.tolerate_failures, %(priority)s
    FROM jsonb_to_recordset(%(steps)s::jsonb) AS x({_STEP_SHAPE})
    WHERE x.state = {{state}}
"""

# The root steps without a `when` are inserted ``ready`` (what buzz_workflows_release would
# make of them), the rest ``pending``; orchestrators are woken at commit. Every row passes
# the write fence, and the foreign keys are checked at the end of the statement.
CREATE_RUN = f"""
WITH core AS (
    INSERT INTO buzz_delivery_workflow_run (id, community_id, workflow_id)
    VALUES (%(run_id)s, %(community_id)s, %(workflow_id)s)
), run AS (
    INSERT INTO {RUN} ({_RUN_INSERT_COLUMNS})
    VALUES (%(run_id)s, %(community_id)s, %(workflow_id)s, %(definition_id)s, 'running', %(input)s::jsonb,
            %(cause_kind)s, %(cause_event_id)s, %(cause_scheduled_for)s, %(cause_webhook_invocation_id)s,
            %(idempotency_key)s, %(parent_run_id)s, %(parent_step_key)s, %(depth)s, %(restart_of_id)s,
            %(steps_total)s, %(steps_total)s, {DB_NOW} + make_interval(secs => %(deadline_seconds)s), false,
            %(tags)s::varchar(100)[], %(trace_context)s::jsonb, %(priority)s)
    RETURNING {{run_columns}}
), ready AS ({_STEP_INSERT.format(ready_at=DB_NOW, state="'ready'")}
), pending AS ({_STEP_INSERT.format(ready_at="NULL::timestamptz", state="'pending'")}
)
SELECT {{run_columns}}, pg_notify('buzz_workflows', %(community_id)s::text) FROM run
"""
RUN_ATTNAMES = [f.attname for f in Run._meta.concrete_fields]
CREATE_RUN = CREATE_RUN.format(run_columns=", ".join(str(f.column) for f in Run._meta.concrete_fields))

# Calls of the engine's functions name the community first and stand alone (``SELECT f(...)``,
# never once per row of a query): on Citus such a call is delegated whole to the community's
# worker (migration 0019, docs/scale-out.md).
RELEASE_ROOT_STEPS = "SELECT buzz_workflows_release_roots(%(community_id)s::uuid, %(run_id)s::uuid)"

KEEP_SUCCEEDED_STEP = f"""
UPDATE {STEP} AS s
SET state = 'succeeded', output = %(output)s::jsonb, finished_at = {DB_NOW}
WHERE s.community_id = %(community_id)s AND s.run_id = %(run_id)s AND s.key = %(key)s AND s.state = 'ready'
RETURNING s.id
"""

# True: ended; False: already terminal; NULL: the community is not active (nothing done).
END_RUN_IF_ACTIVE = """
SELECT buzz_workflows_end_run_if_active(%(community_id)s::uuid, %(run_id)s::uuid, %(state)s::text,
                                        %(failure_code)s::text, %(failure_message)s::text)
"""

SET_RUN_DEADLINE = f"""
UPDATE {RUN} AS r SET deadline_at = {DB_NOW} + make_interval(secs => %(deadline_seconds)s)
WHERE r.community_id = %(community_id)s AND r.run_id = %(run_id)s
RETURNING r.deadline_at
"""

ENDED_RUNS = f"""
SELECT r.run_id FROM {RUN} AS r
WHERE r.community_id = %(community_id)s AND r.run_id = ANY(%(run_ids)s) AND r.deliveries_to_expire
"""

RUNS_WITH_DELIVERIES_TO_EXPIRE = f"""
SELECT r.run_id FROM {RUN} AS r
WHERE r.community_id = %(community_id)s AND r.deliveries_to_expire
ORDER BY r.run_id LIMIT %(limit)s
"""

COMMUNITIES_WITH_DELIVERIES_TO_EXPIRE = f"""
SELECT DISTINCT r.community_id FROM {RUN} AS r
JOIN {COMMUNITY} AS c ON c.id = r.community_id AND c.deletion_state = 'active'
WHERE r.deliveries_to_expire
LIMIT %(limit)s
"""

DELIVERIES_EXPIRED = f"""
UPDATE {RUN} AS r SET deliveries_to_expire = false
WHERE r.community_id = %(community_id)s AND r.run_id = ANY(%(run_ids)s) AND r.deliveries_to_expire AND {ACTIVE}
"""

RUN_AND_DESCENDANTS = f"""
WITH RECURSIVE tree(run_id) AS (
    SELECT %(run_id)s::uuid
    UNION ALL
    SELECT r.run_id FROM {RUN} AS r JOIN tree ON r.parent_run_id = tree.run_id
    WHERE r.community_id = %(community_id)s
)
SELECT run_id FROM tree
"""

# --- send_message ---------------------------------------------------------------

# A send_message step's message event (its id derived from the run and the step), written once:
# a repeat finds the one that exists (no row returned) and reads it.
INSERT_MESSAGE_EVENT = f"""
INSERT INTO buzz_delivery_event AS e (community_id, event_id, created_at, kind, pubkey, content, tags)
VALUES (%(community_id)s, %(event_id)s, {DB_NOW}, %(kind)s, %(pubkey)s, %(content)s, %(tags)s::jsonb)
ON CONFLICT (community_id, event_id) DO NOTHING
RETURNING e.id, e.created_at
"""

# --- approvals -----------------------------------------------------------------

# The message events of many send_message steps of one community in one statement (each its
# stable id: an event an earlier attempt posted is kept as it is).
INSERT_MESSAGE_EVENTS = f"""
INSERT INTO buzz_delivery_event AS e (community_id, event_id, created_at, kind, pubkey, content, tags)
SELECT %(community_id)s, m.event_id, {DB_NOW}, %(kind)s, %(pubkey)s, m.content, m.tags
FROM unnest(%(event_ids)s::bytea[], %(contents)s::text[], %(tags)s::jsonb[]) AS m(event_id, content, tags)
ORDER BY m.event_id
ON CONFLICT (community_id, event_id) DO NOTHING
"""

INSERT_APPROVAL = f"""
INSERT INTO {APPROVAL} (id, community_id, run_id, step_id, step_generation, state, prompt,
                        requested_at, deadline_at)
VALUES (%(id)s, %(community_id)s, %(run_id)s, %(step_id)s, %(lease_generation)s, 'pending', %(prompt)s,
        {DB_NOW}, %(wait_deadline)s)
"""

APPROVAL_RUN = f"SELECT run_id FROM {APPROVAL} WHERE community_id = %(community_id)s AND id = %(approval_id)s"

DECIDE_IF_PENDING = f"""
UPDATE {APPROVAL} AS a
SET state = %(decision)s, decided_by = %(decided_by)s, closed_at = {DB_NOW}
WHERE a.community_id = %(community_id)s AND a.id = %(approval_id)s AND a.state = 'pending'
  AND a.deadline_at >= {DB_NOW} AND {ACTIVE}
RETURNING a.step_id, a.step_generation, a.closed_at
"""

RESUME_STEP_APPROVED = f"""
UPDATE {STEP} AS s
SET state = 'succeeded', output = %(output)s::jsonb, wait_deadline = NULL, finished_at = {DB_NOW},
    {step_entry("'approval'", "s.lease_generation", "%(decided_by)s::text", status="'succeeded'")}
WHERE s.community_id = %(community_id)s AND s.id = %(step_id)s AND s.state = 'waiting'
  AND s.lease_generation = %(step_generation)s
RETURNING s.id
"""

RESUME_STEP_REJECTED = f"""
UPDATE {STEP} AS s
SET state = 'failed', output = %(output)s::jsonb, failure_code = 'approval_rejected',
    failure_message = %(failure_message)s, wait_deadline = NULL, finished_at = {DB_NOW},
    {step_entry("'approval'", "s.lease_generation", "%(decided_by)s::text", status="'failed'")}
WHERE s.community_id = %(community_id)s AND s.id = %(step_id)s AND s.state = 'waiting'
  AND s.lease_generation = %(step_generation)s
RETURNING s.id
"""

APPROVAL_STATE = f"""
SELECT a.state, a.decided_by, a.closed_at, a.deadline_at FROM {APPROVAL} AS a
WHERE a.community_id = %(community_id)s AND a.id = %(approval_id)s
"""
