"""The delivery table becomes the record behind a one-table view of its old name (issue 31, stage 1;
``bench/results/queue-design-plan.md`` section 4).

``buzz_delivery_delivery`` is renamed ``buzz_delivery_delivery_record``: its rows, indexes,
constraints, foreign keys (``buzz_tasks_result`` references it), row-level security policies and
grants follow it, as do the triggers other apps put on it (the workflows' fan-in, the agents'
delivery-lost), which are bound to the table, not to its name. A view of the old name,
``security_invoker`` (the reader's row-level security on the record applies, not the view
owner's), selects every column of it: the readers (``WorkflowAgentDelivery``, now unmanaged over
the view) are unchanged, and the planner flattens a one-table view, so their plans are too.
Later stages join the live queue and the outcome into it.

Every writer names the record (``buzz_delivery.services.sql.RECORD``). django-pgtrigger's
triggers move from the model of the view to ``DeliveryRecord`` (their database names carry the
model's: dropped, then installed again under the new names, in this one transaction). The
plan-cached functions (``buzz_delivery.services.cached``) are created again naming the record
(frozen copies below): PL/pgSQL resolves a name when it plans a statement, so the old bodies
would have written through the view. Backwards, the old bodies are put back after the rename
back (their ``RETURNS SETOF`` follows the table's row type either way).

On Citus the rename, the view and the trigger DDL propagate from the coordinator
(``citus.enable_unsafe_triggers``, docs/scale-out.md); run ``distribute_tables`` after it as
after every migrate: it delegates the re-created functions again. The view needs nothing: the
coordinator expands it."""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

import buzz_delivery.models
import datetime
from typing import Any
import django.contrib.postgres.functions
import django.db.models.deletion
import django.db.models.functions.datetime
import django.db.models.functions.text
import django.db.models.lookups
from buzz_delivery import isolation
from buzz_delivery.citus_ddl import OneStatementAtATime

COLUMNS = "id, step_id, target_pubkey, definition_event_id, message_event_id, cause_kind, cause_event_id, cause_scheduled_for, cause_webhook_invocation_id, status, lease_generation, lease_until, claimed_at, finished_at, created_at, attempt, max_attempts, next_attempt_at, expires_at, failure_code, failure_message, execution_trace, trigger_context, community_id, workflow_id, run_id, claimed_by, history, renewals, priority, slot_community, slot_target, slot_workflow, singleton_key, requeues"

# One statement each: Citus propagates a DDL statement to the workers with its query text, and a
# text of several commands is refused there ("cannot insert multiple commands into a prepared
# statement").
RENAME_AND_VIEW = [
    "ALTER TABLE buzz_delivery_delivery RENAME TO buzz_delivery_delivery_record",
    "CREATE VIEW buzz_delivery_delivery WITH (security_invoker = true) AS"
    f" SELECT {COLUMNS} FROM buzz_delivery_delivery_record",
]
VIEW_AND_RENAME_BACK = [
    "DROP VIEW buzz_delivery_delivery",
    "ALTER TABLE buzz_delivery_delivery_record RENAME TO buzz_delivery_delivery",
]

# What cached.ALL's create_sql() printed when this migration was written.
FUNCTIONS = r"""
CREATE OR REPLACE FUNCTION buzz_delivery_claim_pending(p_community_id uuid, p_target_pubkey bytea, p_limit bigint, p_lease_seconds float8, p_holder text)
RETURNS SETOF buzz_delivery_delivery_record LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
WITH candidate AS MATERIALIZED (
    SELECT d.id
    FROM buzz_delivery_delivery_record AS d
    WHERE d.community_id = p_community_id
      AND d.target_pubkey = p_target_pubkey
      AND d.status = 'pending'
      AND (d.next_attempt_at IS NULL OR d.next_attempt_at <= buzz_delivery_now())
      AND (d.expires_at IS NULL OR d.expires_at > buzz_delivery_now())
      AND (d.max_attempts IS NULL OR d.attempt < d.max_attempts)
      
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
    ORDER BY d.priority DESC, d.created_at, d.id
    LIMIT p_limit
    FOR UPDATE OF d SKIP LOCKED
)
UPDATE buzz_delivery_delivery_record AS d
SET status = 'claimed',
    lease_generation = d.lease_generation + 1,
    attempt = d.attempt + 1,
    claimed_at = buzz_delivery_now(),
    lease_until = LEAST(buzz_delivery_now() + make_interval(secs => p_lease_seconds), d.expires_at),
    next_attempt_at = NULL,
    claimed_by = p_holder,
    renewals = 0,
    slot_community = NULL,
    slot_target = NULL,
    slot_workflow = NULL,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('claim')::text, 'status', ('claimed')::text, 'actor', (p_holder::text)::text]) || ('{"generation": ' || (d.lease_generation + 1)::text || ', "attempt": ' || (d.attempt + 1)::text || '}')::jsonb)
FROM candidate, unnest(ARRAY(SELECT candidate.id FROM candidate)) AS listed(id)
-- Through the primary key only: no status test here (the CTE locked each candidate FOR UPDATE
-- after re-checking its latest version, so nothing else changed it since), or with stale
-- statistics the pending-only indexes win and every pending row is read (test_claim_plan_stale_stats).
WHERE d.community_id = p_community_id AND d.id = candidate.id AND d.id = listed.id
RETURNING d.*;
END
$fn$;

CREATE OR REPLACE FUNCTION buzz_delivery_finish_lease(p_community_id uuid, p_delivery_id uuid, p_target_pubkey bytea, p_lease_generation bigint, p_status varchar, p_failure_code varchar, p_failure_message text)
RETURNS TABLE(status varchar) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
UPDATE buzz_delivery_delivery_record AS d
SET status = p_status,
    finished_at = buzz_delivery_now(),
    lease_until = NULL,
    claimed_at = NULL,
    failure_code = p_failure_code,
    failure_message = p_failure_message,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('settle')::text, 'status', (p_status::varchar)::text, 'actor', (d.claimed_by)::text]) || ('{"generation": ' || (d.lease_generation)::text || ', "renewals": ' || (d.renewals)::text || '}')::jsonb)
WHERE 
    d.community_id = p_community_id
    AND d.id = p_delivery_id
    AND d.target_pubkey = p_target_pubkey
    AND d.lease_generation = p_lease_generation
    AND d.status = 'claimed'
    AND d.lease_until >= buzz_delivery_now()
    AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')

RETURNING d.status;
END
$fn$;

CREATE OR REPLACE FUNCTION buzz_delivery_finish_leases(p_community_id uuid, p_delivery_ids uuid[], p_lease_generations bigint[], p_target_pubkeys bytea[], p_status varchar, p_failure_code varchar, p_failure_message text)
RETURNS TABLE(id uuid, status varchar) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    IF (SELECT count(DISTINCT x.run_id) FROM buzz_delivery_delivery_record AS x
        WHERE x.community_id = p_community_id AND x.id = ANY (p_delivery_ids)) > 1 THEN
    PERFORM 1 FROM buzz_delivery_workflow_run AS r
    WHERE r.community_id = p_community_id
      AND r.id IN (SELECT x.run_id FROM buzz_delivery_delivery_record AS x
                   WHERE x.community_id = p_community_id AND x.id = ANY (p_delivery_ids))
    ORDER BY r.id
    FOR NO KEY UPDATE OF r;
    END IF;
    RETURN QUERY
UPDATE buzz_delivery_delivery_record AS d
SET status = p_status,
    finished_at = buzz_delivery_now(),
    lease_until = NULL,
    claimed_at = NULL,
    failure_code = p_failure_code,
    failure_message = p_failure_message,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('settle')::text, 'status', (p_status::varchar)::text, 'actor', (d.claimed_by)::text]) || ('{"generation": ' || (d.lease_generation)::text || ', "renewals": ' || (d.renewals)::text || '}')::jsonb)
FROM unnest(p_delivery_ids::uuid[], p_lease_generations::bigint[], p_target_pubkeys::bytea[])
    AS f(id, generation, target)
WHERE d.community_id = p_community_id
  AND d.id = f.id
  AND d.target_pubkey = f.target
  AND d.lease_generation = f.generation
  AND d.status = 'claimed' COLLATE "C"
  AND d.lease_until >= buzz_delivery_now()
  AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
RETURNING d.id, d.status;
END
$fn$;

CREATE OR REPLACE FUNCTION buzz_delivery_claim_limited(p_community_id uuid, p_target_pubkey bytea, p_limit bigint, p_lease_seconds float8, p_holder text, p_cap_community integer, p_cap_target integer, p_cap_workflow integer)
RETURNS SETOF buzz_delivery_delivery_record LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(1651862577, hashtext(p_community_id::text));
    RETURN QUERY
WITH candidate AS MATERIALIZED (
    SELECT d.id, d.priority, d.created_at, d.target_pubkey, d.workflow_id
    FROM buzz_delivery_delivery_record AS d
    WHERE d.community_id = p_community_id
      AND d.target_pubkey = p_target_pubkey
      AND d.status = 'pending'
      AND (d.next_attempt_at IS NULL OR d.next_attempt_at <= buzz_delivery_now())
      AND (d.expires_at IS NULL OR d.expires_at > buzz_delivery_now())
      AND (d.max_attempts IS NULL OR d.attempt < d.max_attempts)
      
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
    ORDER BY d.priority DESC, d.created_at, d.id
    LIMIT LEAST(p_limit, p_cap_community, p_cap_target)
    FOR UPDATE OF d SKIP LOCKED
),
ranked AS MATERIALIZED (
    SELECT c.id, c.target_pubkey, c.workflow_id,
           row_number() OVER (ORDER BY c.priority DESC, c.created_at, c.id) AS community_rank,
           row_number() OVER (PARTITION BY c.target_pubkey ORDER BY c.priority DESC, c.created_at, c.id) AS target_rank,
           row_number() OVER (PARTITION BY c.workflow_id ORDER BY c.priority DESC, c.created_at, c.id) AS workflow_rank
    FROM candidate AS c
),
community_free AS MATERIALIZED (
    SELECT g.slot, row_number() OVER (ORDER BY g.slot) AS rank
    FROM generate_series(0, p_cap_community - 1) AS g(slot)
    WHERE NOT EXISTS (
        SELECT 1 FROM buzz_delivery_delivery_record AS h
        WHERE h.community_id = p_community_id AND h.status = 'claimed' AND h.slot_community = g.slot
    )
),
target_free AS MATERIALIZED (
    SELECT k.target_pubkey, g.slot, row_number() OVER (PARTITION BY k.target_pubkey ORDER BY g.slot) AS rank
    FROM (SELECT DISTINCT target_pubkey FROM candidate) AS k, generate_series(0, p_cap_target - 1) AS g(slot)
    WHERE NOT EXISTS (
        SELECT 1 FROM buzz_delivery_delivery_record AS h
        WHERE h.community_id = p_community_id AND h.target_pubkey = k.target_pubkey AND h.status = 'claimed' AND h.slot_target = g.slot
    )
),
workflow_free AS MATERIALIZED (
    SELECT k.workflow_id, g.slot, row_number() OVER (PARTITION BY k.workflow_id ORDER BY g.slot) AS rank
    FROM (SELECT DISTINCT workflow_id FROM candidate) AS k, generate_series(0, p_cap_workflow - 1) AS g(slot)
    WHERE NOT EXISTS (
        SELECT 1 FROM buzz_delivery_delivery_record AS h
        WHERE h.community_id = p_community_id AND h.workflow_id = k.workflow_id AND h.status = 'claimed' AND h.slot_workflow = g.slot
    )
),
admitted AS MATERIALIZED (
    SELECT r.id, community_free.slot AS slot_community, target_free.slot AS slot_target, workflow_free.slot AS slot_workflow
    FROM ranked AS r
    LEFT JOIN community_free ON community_free.rank = r.community_rank
    LEFT JOIN target_free ON target_free.rank = r.target_rank AND target_free.target_pubkey = r.target_pubkey
    LEFT JOIN workflow_free ON workflow_free.rank = r.workflow_rank AND workflow_free.workflow_id = r.workflow_id
    WHERE (p_cap_community IS NULL OR community_free.slot IS NOT NULL) AND (p_cap_target IS NULL OR target_free.slot IS NOT NULL) AND (p_cap_workflow IS NULL OR workflow_free.slot IS NOT NULL)
)
UPDATE buzz_delivery_delivery_record AS d
SET status = 'claimed',
    lease_generation = d.lease_generation + 1,
    attempt = d.attempt + 1,
    claimed_at = buzz_delivery_now(),
    lease_until = LEAST(buzz_delivery_now() + make_interval(secs => p_lease_seconds), d.expires_at),
    next_attempt_at = NULL,
    claimed_by = p_holder,
    renewals = 0,
    slot_community = admitted.slot_community,
    slot_target = admitted.slot_target,
    slot_workflow = admitted.slot_workflow,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('claim')::text, 'status', ('claimed')::text, 'actor', (p_holder::text)::text]) || ('{"generation": ' || (d.lease_generation + 1)::text || ', "attempt": ' || (d.attempt + 1)::text || '}')::jsonb)
FROM candidate, admitted, unnest(ARRAY(SELECT admitted.id FROM admitted)) AS listed(id)
WHERE d.community_id = p_community_id AND d.id = candidate.id AND d.id = admitted.id AND d.id = listed.id
RETURNING d.*;
END
$fn$;

CREATE OR REPLACE FUNCTION buzz_delivery_claim_hinted(p_community_id uuid, p_target_pubkey bytea, p_delivery_id uuid, p_limit bigint, p_lease_seconds float8, p_holder text)
RETURNS SETOF buzz_delivery_delivery_record LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
WITH candidate AS MATERIALIZED (
    SELECT d.id
    FROM buzz_delivery_delivery_record AS d
    WHERE d.community_id = p_community_id
      AND d.target_pubkey = p_target_pubkey
      AND d.status = 'pending'
      AND (d.next_attempt_at IS NULL OR d.next_attempt_at <= buzz_delivery_now())
      AND (d.expires_at IS NULL OR d.expires_at > buzz_delivery_now())
      AND (d.max_attempts IS NULL OR d.attempt < d.max_attempts)
      AND d.id = p_delivery_id
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
    ORDER BY d.priority DESC, d.created_at, d.id
    LIMIT p_limit
    FOR UPDATE OF d SKIP LOCKED
)
UPDATE buzz_delivery_delivery_record AS d
SET status = 'claimed',
    lease_generation = d.lease_generation + 1,
    attempt = d.attempt + 1,
    claimed_at = buzz_delivery_now(),
    lease_until = LEAST(buzz_delivery_now() + make_interval(secs => p_lease_seconds), d.expires_at),
    next_attempt_at = NULL,
    claimed_by = p_holder,
    renewals = 0,
    slot_community = NULL,
    slot_target = NULL,
    slot_workflow = NULL,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('claim')::text, 'status', ('claimed')::text, 'actor', (p_holder::text)::text]) || ('{"generation": ' || (d.lease_generation + 1)::text || ', "attempt": ' || (d.attempt + 1)::text || '}')::jsonb)
-- Through the primary key only: no status test here (the CTE locked each candidate FOR UPDATE
-- after re-checking its latest version, so nothing else changed it since), or with stale
-- statistics the pending-only indexes win and every pending row is read (test_claim_plan_stale_stats).
WHERE d.community_id = p_community_id AND d.id = p_delivery_id AND d.id IN (SELECT candidate.id FROM candidate)
RETURNING d.*;
END
$fn$;

CREATE OR REPLACE FUNCTION buzz_delivery_settle_leases(p_community_id uuid, p_delivery_ids uuid[], p_lease_generations bigint[], p_target_pubkeys bytea[], p_outcomes varchar[], p_failure_codes varchar[], p_failure_messages text[], p_jitters float8[], p_retry_afters float8[], p_backoff_base float8, p_backoff_cap float8)
RETURNS TABLE(id uuid, status varchar) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    IF (SELECT count(DISTINCT x.run_id) FROM buzz_delivery_delivery_record AS x
        WHERE x.community_id = p_community_id AND x.id = ANY (p_delivery_ids)) > 1 THEN
    PERFORM 1 FROM buzz_delivery_workflow_run AS r
    WHERE r.community_id = p_community_id
      AND r.id IN (SELECT x.run_id FROM buzz_delivery_delivery_record AS x
                   WHERE x.community_id = p_community_id AND x.id = ANY (p_delivery_ids))
    ORDER BY r.id
    FOR NO KEY UPDATE OF r;
    END IF;
    RETURN QUERY
UPDATE buzz_delivery_delivery_record AS d
SET status = CASE WHEN s.outcome = 'retry' THEN CASE WHEN (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts) THEN 'failed' ELSE 'pending' END ELSE s.outcome END,
    finished_at = buzz_delivery_when(NOT s.outcome = 'retry' OR (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts), buzz_delivery_now()),
    failure_code = CASE WHEN s.outcome = 'retry' THEN CASE WHEN (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts) THEN 'attempts_exhausted' END
                        ELSE s.failure_code END,
    failure_message = CASE WHEN s.outcome = 'retry' AND NOT (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts) THEN NULL ELSE s.failure_message END,
    next_attempt_at = buzz_delivery_when(
        s.outcome = 'retry' AND NOT (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts), buzz_delivery_plus_seconds(buzz_delivery_now(), GREATEST(LEAST(p_backoff_base * power(2, LEAST(GREATEST(d.attempt - 1, 0), 62)), p_backoff_cap) * s.jitter, s.retry_after))
    ),
    lease_until = NULL,
    claimed_at = NULL,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', (CASE WHEN s.outcome = 'retry' THEN 'retry' ELSE 'settle' END)::text, 'status', (CASE WHEN s.outcome = 'retry' THEN CASE WHEN (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts) THEN 'failed' ELSE 'pending' END ELSE s.outcome END)::text, 'actor', (d.claimed_by)::text]) || ('{"generation": ' || (d.lease_generation)::text || ', "renewals": ' || (d.renewals)::text || '}')::jsonb)
FROM unnest(
    p_delivery_ids::uuid[], p_lease_generations::bigint[], p_target_pubkeys::bytea[],
    p_outcomes::varchar[], p_failure_codes::varchar[], p_failure_messages::text[],
    p_jitters::float8[], p_retry_afters::float8[]
) AS s(id, generation, target, outcome, failure_code, failure_message, jitter, retry_after)
WHERE d.community_id = p_community_id
  AND d.id = s.id
  AND d.target_pubkey = s.target
  AND d.lease_generation = s.generation
  AND d.status = 'claimed' COLLATE "C"
  AND d.lease_until >= buzz_delivery_now()
  AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
RETURNING d.id, d.status;
END
$fn$;
"""

# The bodies they replace (as of 0033), put back after the rename back.
OLD_FUNCTIONS = r"""
CREATE OR REPLACE FUNCTION public.buzz_delivery_claim_pending(p_community_id uuid, p_target_pubkey bytea, p_limit bigint, p_lease_seconds double precision, p_holder text)
 RETURNS SETOF buzz_delivery_delivery
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
BEGIN
    RETURN QUERY
WITH candidate AS MATERIALIZED (
    SELECT d.id
    FROM buzz_delivery_delivery AS d
    WHERE d.community_id = p_community_id
      AND d.target_pubkey = p_target_pubkey
      AND d.status = 'pending'
      AND (d.next_attempt_at IS NULL OR d.next_attempt_at <= buzz_delivery_now())
      AND (d.expires_at IS NULL OR d.expires_at > buzz_delivery_now())
      AND (d.max_attempts IS NULL OR d.attempt < d.max_attempts)
      
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
    ORDER BY d.priority DESC, d.created_at, d.id
    LIMIT p_limit
    FOR UPDATE OF d SKIP LOCKED
)
UPDATE buzz_delivery_delivery AS d
SET status = 'claimed',
    lease_generation = d.lease_generation + 1,
    attempt = d.attempt + 1,
    claimed_at = buzz_delivery_now(),
    lease_until = LEAST(buzz_delivery_now() + make_interval(secs => p_lease_seconds), d.expires_at),
    next_attempt_at = NULL,
    claimed_by = p_holder,
    renewals = 0,
    slot_community = NULL,
    slot_target = NULL,
    slot_workflow = NULL,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('claim')::text, 'status', ('claimed')::text, 'actor', (p_holder::text)::text]) || ('{"generation": ' || (d.lease_generation + 1)::text || ', "attempt": ' || (d.attempt + 1)::text || '}')::jsonb)
FROM candidate, unnest(ARRAY(SELECT candidate.id FROM candidate)) AS listed(id)
-- Through the primary key only: no status test here (the CTE locked each candidate FOR UPDATE
-- after re-checking its latest version, so nothing else changed it since), or with stale
-- statistics the pending-only indexes win and every pending row is read (test_claim_plan_stale_stats).
WHERE d.community_id = p_community_id AND d.id = candidate.id AND d.id = listed.id
RETURNING d.*;
END
$function$;

CREATE OR REPLACE FUNCTION public.buzz_delivery_finish_lease(p_community_id uuid, p_delivery_id uuid, p_target_pubkey bytea, p_lease_generation bigint, p_status character varying, p_failure_code character varying, p_failure_message text)
 RETURNS TABLE(status character varying)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
BEGIN
    RETURN QUERY
UPDATE buzz_delivery_delivery AS d
SET status = p_status,
    finished_at = buzz_delivery_now(),
    lease_until = NULL,
    claimed_at = NULL,
    failure_code = p_failure_code,
    failure_message = p_failure_message,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('settle')::text, 'status', (p_status::varchar)::text, 'actor', (d.claimed_by)::text]) || ('{"generation": ' || (d.lease_generation)::text || ', "renewals": ' || (d.renewals)::text || '}')::jsonb)
WHERE 
    d.community_id = p_community_id
    AND d.id = p_delivery_id
    AND d.target_pubkey = p_target_pubkey
    AND d.lease_generation = p_lease_generation
    AND d.status = 'claimed'
    AND d.lease_until >= buzz_delivery_now()
    AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')

RETURNING d.status;
END
$function$;

CREATE OR REPLACE FUNCTION public.buzz_delivery_finish_leases(p_community_id uuid, p_delivery_ids uuid[], p_lease_generations bigint[], p_target_pubkeys bytea[], p_status character varying, p_failure_code character varying, p_failure_message text)
 RETURNS TABLE(id uuid, status character varying)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
BEGIN
    IF (SELECT count(DISTINCT x.run_id) FROM buzz_delivery_delivery AS x
        WHERE x.community_id = p_community_id AND x.id = ANY (p_delivery_ids)) > 1 THEN
    PERFORM 1 FROM buzz_delivery_workflow_run AS r
    WHERE r.community_id = p_community_id
      AND r.id IN (SELECT x.run_id FROM buzz_delivery_delivery AS x
                   WHERE x.community_id = p_community_id AND x.id = ANY (p_delivery_ids))
    ORDER BY r.id
    FOR NO KEY UPDATE OF r;
    END IF;
    RETURN QUERY
UPDATE buzz_delivery_delivery AS d
SET status = p_status,
    finished_at = buzz_delivery_now(),
    lease_until = NULL,
    claimed_at = NULL,
    failure_code = p_failure_code,
    failure_message = p_failure_message,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('settle')::text, 'status', (p_status::varchar)::text, 'actor', (d.claimed_by)::text]) || ('{"generation": ' || (d.lease_generation)::text || ', "renewals": ' || (d.renewals)::text || '}')::jsonb)
FROM unnest(p_delivery_ids::uuid[], p_lease_generations::bigint[], p_target_pubkeys::bytea[])
    AS f(id, generation, target)
WHERE d.community_id = p_community_id
  AND d.id = f.id
  AND d.target_pubkey = f.target
  AND d.lease_generation = f.generation
  AND d.status = 'claimed' COLLATE "C"
  AND d.lease_until >= buzz_delivery_now()
  AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
RETURNING d.id, d.status;
END
$function$;

CREATE OR REPLACE FUNCTION public.buzz_delivery_claim_limited(p_community_id uuid, p_target_pubkey bytea, p_limit bigint, p_lease_seconds double precision, p_holder text, p_cap_community integer, p_cap_target integer, p_cap_workflow integer)
 RETURNS SETOF buzz_delivery_delivery
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(1651862577, hashtext(p_community_id::text));
    RETURN QUERY
WITH candidate AS MATERIALIZED (
    SELECT d.id, d.priority, d.created_at, d.target_pubkey, d.workflow_id
    FROM buzz_delivery_delivery AS d
    WHERE d.community_id = p_community_id
      AND d.target_pubkey = p_target_pubkey
      AND d.status = 'pending'
      AND (d.next_attempt_at IS NULL OR d.next_attempt_at <= buzz_delivery_now())
      AND (d.expires_at IS NULL OR d.expires_at > buzz_delivery_now())
      AND (d.max_attempts IS NULL OR d.attempt < d.max_attempts)
      
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
    ORDER BY d.priority DESC, d.created_at, d.id
    LIMIT LEAST(p_limit, p_cap_community, p_cap_target)
    FOR UPDATE OF d SKIP LOCKED
),
ranked AS MATERIALIZED (
    SELECT c.id, c.target_pubkey, c.workflow_id,
           row_number() OVER (ORDER BY c.priority DESC, c.created_at, c.id) AS community_rank,
           row_number() OVER (PARTITION BY c.target_pubkey ORDER BY c.priority DESC, c.created_at, c.id) AS target_rank,
           row_number() OVER (PARTITION BY c.workflow_id ORDER BY c.priority DESC, c.created_at, c.id) AS workflow_rank
    FROM candidate AS c
),
community_free AS MATERIALIZED (
    SELECT g.slot, row_number() OVER (ORDER BY g.slot) AS rank
    FROM generate_series(0, p_cap_community - 1) AS g(slot)
    WHERE NOT EXISTS (
        SELECT 1 FROM buzz_delivery_delivery AS h
        WHERE h.community_id = p_community_id AND h.status = 'claimed' AND h.slot_community = g.slot
    )
),
target_free AS MATERIALIZED (
    SELECT k.target_pubkey, g.slot, row_number() OVER (PARTITION BY k.target_pubkey ORDER BY g.slot) AS rank
    FROM (SELECT DISTINCT target_pubkey FROM candidate) AS k, generate_series(0, p_cap_target - 1) AS g(slot)
    WHERE NOT EXISTS (
        SELECT 1 FROM buzz_delivery_delivery AS h
        WHERE h.community_id = p_community_id AND h.target_pubkey = k.target_pubkey AND h.status = 'claimed' AND h.slot_target = g.slot
    )
),
workflow_free AS MATERIALIZED (
    SELECT k.workflow_id, g.slot, row_number() OVER (PARTITION BY k.workflow_id ORDER BY g.slot) AS rank
    FROM (SELECT DISTINCT workflow_id FROM candidate) AS k, generate_series(0, p_cap_workflow - 1) AS g(slot)
    WHERE NOT EXISTS (
        SELECT 1 FROM buzz_delivery_delivery AS h
        WHERE h.community_id = p_community_id AND h.workflow_id = k.workflow_id AND h.status = 'claimed' AND h.slot_workflow = g.slot
    )
),
admitted AS MATERIALIZED (
    SELECT r.id, community_free.slot AS slot_community, target_free.slot AS slot_target, workflow_free.slot AS slot_workflow
    FROM ranked AS r
    LEFT JOIN community_free ON community_free.rank = r.community_rank
    LEFT JOIN target_free ON target_free.rank = r.target_rank AND target_free.target_pubkey = r.target_pubkey
    LEFT JOIN workflow_free ON workflow_free.rank = r.workflow_rank AND workflow_free.workflow_id = r.workflow_id
    WHERE (p_cap_community IS NULL OR community_free.slot IS NOT NULL) AND (p_cap_target IS NULL OR target_free.slot IS NOT NULL) AND (p_cap_workflow IS NULL OR workflow_free.slot IS NOT NULL)
)
UPDATE buzz_delivery_delivery AS d
SET status = 'claimed',
    lease_generation = d.lease_generation + 1,
    attempt = d.attempt + 1,
    claimed_at = buzz_delivery_now(),
    lease_until = LEAST(buzz_delivery_now() + make_interval(secs => p_lease_seconds), d.expires_at),
    next_attempt_at = NULL,
    claimed_by = p_holder,
    renewals = 0,
    slot_community = admitted.slot_community,
    slot_target = admitted.slot_target,
    slot_workflow = admitted.slot_workflow,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('claim')::text, 'status', ('claimed')::text, 'actor', (p_holder::text)::text]) || ('{"generation": ' || (d.lease_generation + 1)::text || ', "attempt": ' || (d.attempt + 1)::text || '}')::jsonb)
FROM candidate, admitted, unnest(ARRAY(SELECT admitted.id FROM admitted)) AS listed(id)
WHERE d.community_id = p_community_id AND d.id = candidate.id AND d.id = admitted.id AND d.id = listed.id
RETURNING d.*;
END
$function$;

CREATE OR REPLACE FUNCTION public.buzz_delivery_claim_hinted(p_community_id uuid, p_target_pubkey bytea, p_delivery_id uuid, p_limit bigint, p_lease_seconds double precision, p_holder text)
 RETURNS SETOF buzz_delivery_delivery
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
BEGIN
    RETURN QUERY
WITH candidate AS MATERIALIZED (
    SELECT d.id
    FROM buzz_delivery_delivery AS d
    WHERE d.community_id = p_community_id
      AND d.target_pubkey = p_target_pubkey
      AND d.status = 'pending'
      AND (d.next_attempt_at IS NULL OR d.next_attempt_at <= buzz_delivery_now())
      AND (d.expires_at IS NULL OR d.expires_at > buzz_delivery_now())
      AND (d.max_attempts IS NULL OR d.attempt < d.max_attempts)
      AND d.id = p_delivery_id
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
    ORDER BY d.priority DESC, d.created_at, d.id
    LIMIT p_limit
    FOR UPDATE OF d SKIP LOCKED
)
UPDATE buzz_delivery_delivery AS d
SET status = 'claimed',
    lease_generation = d.lease_generation + 1,
    attempt = d.attempt + 1,
    claimed_at = buzz_delivery_now(),
    lease_until = LEAST(buzz_delivery_now() + make_interval(secs => p_lease_seconds), d.expires_at),
    next_attempt_at = NULL,
    claimed_by = p_holder,
    renewals = 0,
    slot_community = NULL,
    slot_target = NULL,
    slot_workflow = NULL,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('claim')::text, 'status', ('claimed')::text, 'actor', (p_holder::text)::text]) || ('{"generation": ' || (d.lease_generation + 1)::text || ', "attempt": ' || (d.attempt + 1)::text || '}')::jsonb)
-- Through the primary key only: no status test here (the CTE locked each candidate FOR UPDATE
-- after re-checking its latest version, so nothing else changed it since), or with stale
-- statistics the pending-only indexes win and every pending row is read (test_claim_plan_stale_stats).
WHERE d.community_id = p_community_id AND d.id = p_delivery_id AND d.id IN (SELECT candidate.id FROM candidate)
RETURNING d.*;
END
$function$;

CREATE OR REPLACE FUNCTION public.buzz_delivery_settle_leases(p_community_id uuid, p_delivery_ids uuid[], p_lease_generations bigint[], p_target_pubkeys bytea[], p_outcomes character varying[], p_failure_codes character varying[], p_failure_messages text[], p_jitters double precision[], p_retry_afters double precision[], p_backoff_base double precision, p_backoff_cap double precision)
 RETURNS TABLE(id uuid, status character varying)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
BEGIN
    IF (SELECT count(DISTINCT x.run_id) FROM buzz_delivery_delivery AS x
        WHERE x.community_id = p_community_id AND x.id = ANY (p_delivery_ids)) > 1 THEN
    PERFORM 1 FROM buzz_delivery_workflow_run AS r
    WHERE r.community_id = p_community_id
      AND r.id IN (SELECT x.run_id FROM buzz_delivery_delivery AS x
                   WHERE x.community_id = p_community_id AND x.id = ANY (p_delivery_ids))
    ORDER BY r.id
    FOR NO KEY UPDATE OF r;
    END IF;
    RETURN QUERY
UPDATE buzz_delivery_delivery AS d
SET status = CASE WHEN s.outcome = 'retry' THEN CASE WHEN (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts) THEN 'failed' ELSE 'pending' END ELSE s.outcome END,
    finished_at = buzz_delivery_when(NOT s.outcome = 'retry' OR (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts), buzz_delivery_now()),
    failure_code = CASE WHEN s.outcome = 'retry' THEN CASE WHEN (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts) THEN 'attempts_exhausted' END
                        ELSE s.failure_code END,
    failure_message = CASE WHEN s.outcome = 'retry' AND NOT (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts) THEN NULL ELSE s.failure_message END,
    next_attempt_at = buzz_delivery_when(
        s.outcome = 'retry' AND NOT (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts), buzz_delivery_plus_seconds(buzz_delivery_now(), GREATEST(LEAST(p_backoff_base * power(2, LEAST(GREATEST(d.attempt - 1, 0), 62)), p_backoff_cap) * s.jitter, s.retry_after))
    ),
    lease_until = NULL,
    claimed_at = NULL,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', (CASE WHEN s.outcome = 'retry' THEN 'retry' ELSE 'settle' END)::text, 'status', (CASE WHEN s.outcome = 'retry' THEN CASE WHEN (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts) THEN 'failed' ELSE 'pending' END ELSE s.outcome END)::text, 'actor', (d.claimed_by)::text]) || ('{"generation": ' || (d.lease_generation)::text || ', "renewals": ' || (d.renewals)::text || '}')::jsonb)
FROM unnest(
    p_delivery_ids::uuid[], p_lease_generations::bigint[], p_target_pubkeys::bytea[],
    p_outcomes::varchar[], p_failure_codes::varchar[], p_failure_messages::text[],
    p_jitters::float8[], p_retry_afters::float8[]
) AS s(id, generation, target, outcome, failure_code, failure_message, jitter, retry_after)
WHERE d.community_id = p_community_id
  AND d.id = s.id
  AND d.target_pubkey = s.target
  AND d.lease_generation = s.generation
  AND d.status = 'claimed' COLLATE "C"
  AND d.lease_until >= buzz_delivery_now()
  AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
RETURNING d.id, d.status;
END
$function$;
"""

# django-pgtrigger's triggers of the table, which move from the view's model to the record's.
TRIGGERS = (
    "community_write_fence",
    "community_write_fence_delete",
    "community_write_fence_move",
    "delivery_binding_immutable",
    "delivery_generation_monotonic",
    "delivery_history_append_only",
)
# The indexes and constraints of the table, which leave the view's model state (the database
# keeps them on the record, under the same names).
INDEXES = (
    "delivery_pending_poll_idx",
    "delivery_pending_age_idx",
    "delivery_failure_code_idx",
    "delivery_claimed_lease_idx",
    "delivery_pending_expiry_idx",
    "delivery_terminal_age_idx",
    "delivery_workflow_idx",
    "delivery_message_event_idx",
    "delivery_created_idx",
)
CONSTRAINTS = (
    "delivery_identity_key",
    "delivery_cause_exactly_one",
    "delivery_status_known",
    "delivery_claimed_iff_lease",
    "delivery_terminal_iff_finished_at",
    "delivery_target_pubkey_32_bytes",
    "delivery_definition_event_id_32_bytes",
    "delivery_message_event_id_32_bytes",
    "delivery_cause_event_id_32_bytes",
    "delivery_step_id_not_blank",
    "delivery_lease_generation_gte_0",
    "delivery_attempt_gte_0",
    "delivery_attempt_within_max",
    "delivery_claimed_has_attempt",
    "delivery_failure_code_only_when_failed",
    "delivery_claimed_by_length",
    "delivery_renewals_gte_0",
    "delivery_history_bounded",
    "delivery_priority_range",
    "delivery_slot_community_range",
    "delivery_slot_target_range",
    "delivery_slot_workflow_range",
    "delivery_singleton_key_format",
    "delivery_singleton_pending_key",
    "delivery_slot_community_key",
    "delivery_slot_target_key",
    "delivery_slot_workflow_key",
)


# The sibling apps' migrations that name the table in DDL (a foreign key into it, triggers on it:
# tasks 0001, agents 0002, workflows 0002 and 0023) are not dependencies of this one: an app
# installed after this migration ran would leave an applied migration with an unapplied dependency
# (InconsistentMigrationHistory). They name the table at run time instead, whichever side of the
# rename they run on (buzz_delivery.delivery_table.RunSQLOnTheDeliveryTable).


def each_function(script: str) -> list[str]:
    """The ``CREATE OR REPLACE FUNCTION`` statements of ``script``, one a string (see above)."""
    head = "CREATE OR REPLACE FUNCTION"
    return [head + part.rstrip().rstrip(";") for part in script.split(head)[1:]]


# Who may read the table besides its owner (an operator's reporting role, PUBLIC): its grants follow
# the rename to the record, and the view of the old name needs the same SELECT, or every such
# reader meets "permission denied for view buzz_delivery_delivery" (security_invoker: the record's
# grants and row-level security still decide what it sees).
TABLE_READERS = """
SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END
FROM pg_class AS c
CROSS JOIN LATERAL aclexplode(c.relacl) AS a
LEFT JOIN pg_roles AS r ON r.oid = a.grantee
WHERE c.oid = to_regclass('buzz_delivery_delivery_record')
  AND a.privilege_type = 'SELECT' AND a.grantee <> c.relowner
ORDER BY 1
"""


def grant_the_tables_readers_the_view(apps: Any, schema_editor: Any) -> None:
    """``GRANT SELECT`` on the view to every role that may read the record (one statement each)."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(TABLE_READERS)
        for (grantee,) in cursor.fetchall():
            cursor.execute(f"GRANT SELECT ON buzz_delivery_delivery TO {grantee}")


class Migration(migrations.Migration):
    dependencies = [("buzz_delivery", "0033_delivery_requeues")]

    operations = [
        migrations.RunSQL(sql=migrations.RunSQL.noop, reverse_sql=each_function(OLD_FUNCTIONS)),
        *(
            OneStatementAtATime(pgtrigger.migrations.RemoveTrigger(model_name="workflowagentdelivery", name=name))
            for name in TRIGGERS
        ),
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(sql=RENAME_AND_VIEW, reverse_sql=VIEW_AND_RENAME_BACK)],
            state_operations=[
                *(migrations.RemoveIndex(model_name="workflowagentdelivery", name=name) for name in INDEXES),
                *(migrations.RemoveConstraint(model_name="workflowagentdelivery", name=name) for name in CONSTRAINTS),
                migrations.CreateModel(
                    name="DeliveryRecord",
                    fields=[
                        (
                            "id",
                            models.UUIDField(
                                db_default=django.contrib.postgres.functions.RandomUUID(),
                                default=buzz_delivery.models.new_uuid7,
                                editable=False,
                                primary_key=True,
                                serialize=False,
                            ),
                        ),
                        ("step_id", models.CharField(max_length=64)),
                        ("target_pubkey", models.BinaryField(max_length=32)),
                        ("definition_event_id", models.BinaryField(max_length=32)),
                        ("message_event_id", models.BinaryField(max_length=32)),
                        (
                            "cause_kind",
                            models.CharField(
                                choices=[("event", "Event"), ("schedule", "Schedule"), ("webhook", "Webhook")],
                                max_length=16,
                            ),
                        ),
                        ("cause_event_id", models.BinaryField(blank=True, max_length=32, null=True)),
                        ("cause_scheduled_for", models.DateTimeField(blank=True, null=True)),
                        ("cause_webhook_invocation_id", models.UUIDField(blank=True, null=True)),
                        (
                            "status",
                            models.CharField(
                                choices=[
                                    ("pending", "Pending"),
                                    ("claimed", "Claimed"),
                                    ("finished", "Finished"),
                                    ("failed", "Failed"),
                                    ("expired", "Expired"),
                                ],
                                db_default="pending",
                                default="pending",
                                max_length=16,
                            ),
                        ),
                        ("lease_generation", models.BigIntegerField(db_default=0, default=0)),
                        ("lease_until", models.DateTimeField(blank=True, null=True)),
                        ("claimed_at", models.DateTimeField(blank=True, null=True)),
                        ("finished_at", models.DateTimeField(blank=True, null=True)),
                        ("created_at", models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                        ("priority", models.SmallIntegerField(db_default=0, default=0)),
                        ("slot_community", models.SmallIntegerField(blank=True, editable=False, null=True)),
                        ("slot_target", models.SmallIntegerField(blank=True, editable=False, null=True)),
                        ("slot_workflow", models.SmallIntegerField(blank=True, editable=False, null=True)),
                        ("singleton_key", models.CharField(blank=True, editable=False, max_length=64, null=True)),
                        ("attempt", models.IntegerField(db_default=0, default=0)),
                        ("max_attempts", models.IntegerField(blank=True, null=True)),
                        ("next_attempt_at", models.DateTimeField(blank=True, null=True)),
                        ("expires_at", models.DateTimeField(blank=True, null=True)),
                        ("failure_code", models.CharField(blank=True, max_length=64, null=True)),
                        ("failure_message", models.TextField(blank=True, null=True)),
                        ("execution_trace", models.JSONField(blank=True, null=True)),
                        ("trigger_context", models.JSONField(blank=True, null=True)),
                        ("claimed_by", models.TextField(blank=True, null=True)),
                        ("renewals", models.IntegerField(db_default=0, default=0)),
                        (
                            "history",
                            models.JSONField(
                                blank=True, db_default=models.Value([], output_field=models.JSONField()), default=list
                            ),
                        ),
                        ("requeues", models.IntegerField(db_default=0, default=0, editable=False)),
                    ],
                    options={
                        "verbose_name": "delivery record",
                        "verbose_name_plural": "delivery records",
                        "db_table": "buzz_delivery_delivery_record",
                        "default_permissions": (),
                    },
                ),
                migrations.AlterModelOptions(
                    name="workflowagentdelivery",
                    options={
                        "managed": False,
                        "permissions": [
                            ("requeue_delivery", "Can requeue failed or expired deliveries"),
                            ("force_fail_delivery", "Can force-fail claimed deliveries"),
                            ("reap_deliveries", "Can reap expired leases now"),
                        ],
                        "verbose_name": "delivery",
                        "verbose_name_plural": "deliveries",
                    },
                ),
                migrations.AddField(
                    model_name="deliveryrecord",
                    name="community",
                    field=models.ForeignKey(
                        db_index=False, on_delete=django.db.models.deletion.PROTECT, to="buzz_delivery.community"
                    ),
                ),
                migrations.AddField(
                    model_name="deliveryrecord",
                    name="run",
                    field=models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="buzz_delivery.workflowrun",
                    ),
                ),
                migrations.AddField(
                    model_name="deliveryrecord",
                    name="workflow",
                    field=models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="buzz_delivery.workflow",
                    ),
                ),
                migrations.AddIndex(
                    model_name="deliveryrecord",
                    index=models.Index(
                        condition=models.Q(("status", "pending")),
                        fields=["community", "target_pubkey", "-priority", "created_at", "id"],
                        name="delivery_pending_poll_idx",
                    ),
                ),
                migrations.AddIndex(
                    model_name="deliveryrecord",
                    index=models.Index(
                        models.Func(
                            models.Value("UTC"),
                            models.F("created_at"),
                            function="timezone",
                            output_field=models.DateTimeField(),
                        ),
                        condition=models.Q(
                            ("created_at__gt", datetime.datetime(1970, 1, 1, 0, 0, tzinfo=datetime.timezone.utc)),
                            ("status", "pending"),
                        ),
                        name="delivery_pending_age_idx",
                    ),
                ),
                migrations.AddIndex(
                    model_name="deliveryrecord",
                    index=models.Index(
                        condition=models.Q(("failure_code__isnull", False)),
                        fields=["failure_code", "created_at"],
                        name="delivery_failure_code_idx",
                    ),
                ),
                migrations.AddIndex(
                    model_name="deliveryrecord",
                    index=models.Index(
                        condition=models.Q(("status", "claimed")),
                        fields=["community", "lease_until"],
                        name="delivery_claimed_lease_idx",
                    ),
                ),
                migrations.AddIndex(
                    model_name="deliveryrecord",
                    index=models.Index(
                        condition=models.Q(("expires_at__isnull", False), ("status", "pending")),
                        fields=["community", "expires_at"],
                        name="delivery_pending_expiry_idx",
                    ),
                ),
                migrations.AddIndex(
                    model_name="deliveryrecord",
                    index=models.Index(
                        condition=models.Q(("status__in", ["finished", "failed", "expired"])),
                        fields=["community", "finished_at"],
                        name="delivery_terminal_age_idx",
                    ),
                ),
                migrations.AddIndex(
                    model_name="deliveryrecord",
                    index=models.Index(fields=["community", "workflow"], name="delivery_workflow_idx"),
                ),
                migrations.AddIndex(
                    model_name="deliveryrecord",
                    index=models.Index(fields=["community", "message_event_id"], name="delivery_message_event_idx"),
                ),
                migrations.AddIndex(
                    model_name="deliveryrecord",
                    index=models.Index(
                        condition=models.Q(
                            ("created_at__gt", datetime.datetime(1970, 1, 1, 0, 0, tzinfo=datetime.timezone.utc))
                        ),
                        fields=["created_at"],
                        name="delivery_created_idx",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.UniqueConstraint(
                        fields=("community", "run", "step_id", "target_pubkey"), name="delivery_identity_key"
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            models.Q(
                                ("cause_event_id__isnull", False),
                                ("cause_kind", "event"),
                                ("cause_scheduled_for__isnull", True),
                                ("cause_webhook_invocation_id__isnull", True),
                            ),
                            models.Q(
                                ("cause_event_id__isnull", True),
                                ("cause_kind", "schedule"),
                                ("cause_scheduled_for__isnull", False),
                                ("cause_webhook_invocation_id__isnull", True),
                            ),
                            models.Q(
                                ("cause_event_id__isnull", True),
                                ("cause_kind", "webhook"),
                                ("cause_scheduled_for__isnull", True),
                                ("cause_webhook_invocation_id__isnull", False),
                            ),
                            _connector="OR",
                        ),
                        name="delivery_cause_exactly_one",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(("status__in", ["pending", "claimed", "finished", "failed", "expired"])),
                        name="delivery_status_known",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            models.Q(
                                ("claimed_at__isnull", False), ("lease_until__isnull", False), ("status", "claimed")
                            ),
                            models.Q(
                                models.Q(("status", "claimed"), _negated=True),
                                ("claimed_at__isnull", True),
                                ("lease_until__isnull", True),
                            ),
                            _connector="OR",
                        ),
                        name="delivery_claimed_iff_lease",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("finished_at__isnull", False), ("status__in", ["finished", "failed", "expired"])),
                            models.Q(
                                models.Q(("status__in", ["finished", "failed", "expired"]), _negated=True),
                                ("finished_at__isnull", True),
                            ),
                            _connector="OR",
                        ),
                        name="delivery_terminal_iff_finished_at",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=django.db.models.lookups.Exact(
                            django.db.models.functions.text.Length("target_pubkey"), 32
                        ),
                        name="delivery_target_pubkey_32_bytes",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=django.db.models.lookups.Exact(
                            django.db.models.functions.text.Length("definition_event_id"), 32
                        ),
                        name="delivery_definition_event_id_32_bytes",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=django.db.models.lookups.Exact(
                            django.db.models.functions.text.Length("message_event_id"), 32
                        ),
                        name="delivery_message_event_id_32_bytes",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            ("cause_event_id__isnull", True),
                            django.db.models.lookups.Exact(
                                django.db.models.functions.text.Length("cause_event_id"), 32
                            ),
                            _connector="OR",
                        ),
                        name="delivery_cause_event_id_32_bytes",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(("step_id__regex", "\\S")), name="delivery_step_id_not_blank"
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(("lease_generation__gte", 0)), name="delivery_lease_generation_gte_0"
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(("attempt__gte", 0)), name="delivery_attempt_gte_0"
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            ("max_attempts__isnull", True),
                            models.Q(("attempt__lte", models.F("max_attempts")), ("max_attempts__gte", 1)),
                            _connector="OR",
                        ),
                        name="delivery_attempt_within_max",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("status", "claimed"), _negated=True), ("attempt__gte", 1), _connector="OR"
                        ),
                        name="delivery_claimed_has_attempt",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            ("failure_code__isnull", True), ("status__in", ["failed", "expired"]), _connector="OR"
                        ),
                        name="delivery_failure_code_only_when_failed",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            ("claimed_by__isnull", True),
                            django.db.models.lookups.LessThanOrEqual(
                                django.db.models.functions.text.Length("claimed_by"), 200
                            ),
                            _connector="OR",
                        ),
                        name="delivery_claimed_by_length",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(("renewals__gte", 0)), name="delivery_renewals_gte_0"
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            django.db.models.lookups.Exact(
                                models.Func(
                                    models.F("history"), function="jsonb_typeof", output_field=models.TextField()
                                ),
                                "array",
                            ),
                            django.db.models.lookups.LessThanOrEqual(
                                models.Func(
                                    models.F("history"),
                                    function="jsonb_array_length",
                                    output_field=models.IntegerField(),
                                ),
                                50,
                            ),
                        ),
                        name="delivery_history_bounded",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(("priority__gte", -10), ("priority__lte", 10)),
                        name="delivery_priority_range",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            ("slot_community__isnull", True),
                            models.Q(("slot_community__gte", 0), ("slot_community__lt", 1000)),
                            _connector="OR",
                        ),
                        name="delivery_slot_community_range",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            ("slot_target__isnull", True),
                            models.Q(("slot_target__gte", 0), ("slot_target__lt", 1000)),
                            _connector="OR",
                        ),
                        name="delivery_slot_target_range",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            ("slot_workflow__isnull", True),
                            models.Q(("slot_workflow__gte", 0), ("slot_workflow__lt", 1000)),
                            _connector="OR",
                        ),
                        name="delivery_slot_workflow_range",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            ("singleton_key__isnull", True),
                            ("singleton_key__regex", "^[A-Za-z0-9_.:-]{1,64}$"),
                            _connector="OR",
                        ),
                        name="delivery_singleton_key_format",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.UniqueConstraint(
                        condition=models.Q(
                            ("lease_generation", 0), ("singleton_key__isnull", False), ("status", "pending")
                        ),
                        fields=("community", "target_pubkey", "singleton_key"),
                        name="delivery_singleton_pending_key",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.UniqueConstraint(
                        condition=models.Q(("slot_community__isnull", False), ("status", "claimed")),
                        fields=("community", "slot_community"),
                        name="delivery_slot_community_key",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.UniqueConstraint(
                        condition=models.Q(("slot_target__isnull", False), ("status", "claimed")),
                        fields=("community", "target_pubkey", "slot_target"),
                        name="delivery_slot_target_key",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="deliveryrecord",
                    constraint=models.UniqueConstraint(
                        condition=models.Q(("slot_workflow__isnull", False), ("status", "claimed")),
                        fields=("community", "workflow", "slot_workflow"),
                        name="delivery_slot_workflow_key",
                    ),
                ),
            ],
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name="deliveryrecord",
                trigger=pgtrigger.compiler.Trigger(
                    name="community_write_fence",
                    sql=pgtrigger.compiler.UpsertTriggerSql(
                        condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM NEW.community_id::text)",
                        execute="buzz_delivery_write_fence_row()",
                        func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ",
                        hash="241b529ab2dd80145147952b997ad6dd01b08cb2",
                        operation="INSERT OR UPDATE",
                        pgid="pgtrigger_community_write_fence_cc965",
                        table="buzz_delivery_delivery_record",
                        when="BEFORE",
                    ),
                ),
            )
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name="deliveryrecord",
                trigger=pgtrigger.compiler.Trigger(
                    name="community_write_fence_delete",
                    sql=pgtrigger.compiler.UpsertTriggerSql(
                        condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM OLD.community_id::text)",
                        execute="buzz_delivery_write_fence_row()",
                        func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ",
                        hash="55eee968488898c65631df3263aab2aefd2c9f82",
                        operation="DELETE",
                        pgid="pgtrigger_community_write_fence_delete_0b5be",
                        table="buzz_delivery_delivery_record",
                        when="BEFORE",
                    ),
                ),
            )
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name="deliveryrecord",
                trigger=pgtrigger.compiler.Trigger(
                    name="community_write_fence_move",
                    sql=pgtrigger.compiler.UpsertTriggerSql(
                        condition="WHEN (OLD.community_id IS DISTINCT FROM NEW.community_id)",
                        execute="buzz_delivery_write_fence_row()",
                        func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ",
                        hash="b7567e94b442d0fc412217c772b5b3ee0e2dc4e3",
                        operation='UPDATE OF "community_id"',
                        pgid="pgtrigger_community_write_fence_move_5f854",
                        table="buzz_delivery_delivery_record",
                        when="BEFORE",
                    ),
                ),
            )
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name="deliveryrecord",
                trigger=pgtrigger.compiler.Trigger(
                    name="delivery_binding_immutable",
                    sql=pgtrigger.compiler.UpsertTriggerSql(
                        func="\n            RAISE EXCEPTION USING ERRCODE = 'BD003',\n                MESSAGE = format('buzz_delivery: delivery %s: its binding and snapshots never '\n                                 'change; state changes go through buzz_delivery.services', OLD.id);\n        ",
                        hash="b78a71f1855ec58057a5e9e64351086381490413",
                        operation='UPDATE OF "id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id", "message_event_id", "cause_kind", "cause_event_id", "cause_scheduled_for", "cause_webhook_invocation_id", "execution_trace", "trigger_context", "singleton_key"',
                        pgid="pgtrigger_delivery_binding_immutable_f6fd2",
                        table="buzz_delivery_delivery_record",
                        when="BEFORE",
                    ),
                ),
            )
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name="deliveryrecord",
                trigger=pgtrigger.compiler.Trigger(
                    name="delivery_generation_monotonic",
                    sql=pgtrigger.compiler.UpsertTriggerSql(
                        condition="WHEN (NEW.lease_generation < OLD.lease_generation)",
                        func="\n            RAISE EXCEPTION USING ERRCODE = 'BD003',\n                MESSAGE = format('buzz_delivery: delivery %s: lease_generation cannot go back from %s to %s',\n                                 OLD.id, OLD.lease_generation, NEW.lease_generation);\n        ",
                        hash="5ac0899b3f9d4613dcc85263709b9cdf881d109c",
                        operation="UPDATE",
                        pgid="pgtrigger_delivery_generation_monotonic_7e65e",
                        table="buzz_delivery_delivery_record",
                        when="BEFORE",
                    ),
                ),
            )
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name="deliveryrecord",
                trigger=pgtrigger.compiler.Trigger(
                    name="delivery_history_append_only",
                    sql=pgtrigger.compiler.UpsertTriggerSql(
                        condition="WHEN (NEW.history IS DISTINCT FROM OLD.history AND NOT ((NEW.history - (-1)) = OLD.history OR (jsonb_array_length(OLD.history) >= 50 AND (NEW.history - (-1)) = (OLD.history - 0))))",
                        func="\n            RAISE EXCEPTION USING ERRCODE = 'BD003',\n                MESSAGE = format('buzz_delivery: %s %s: its history only grows by one entry per '\n                                 'statement; past entries are never rewritten', TG_TABLE_NAME, OLD.id);\n        ",
                        hash="18c68dd0c2ee1d65f0eb58918d521638f4c7dad1",
                        operation='UPDATE OF "history"',
                        pgid="pgtrigger_delivery_history_append_only_27347",
                        table="buzz_delivery_delivery_record",
                        when="BEFORE",
                    ),
                ),
            )
        ),
        OneStatementAtATime(
            pgtrigger.migrations.RemoveTrigger(
                model_name="community",
                name="community_lifecycle_forward_only",
            )
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name="community",
                trigger=pgtrigger.compiler.Trigger(
                    name="community_lifecycle_forward_only",
                    sql=pgtrigger.compiler.UpsertTriggerSql(
                        declare="DECLARE old_rank int; new_rank int;",
                        func="\n            IF NEW.id IS DISTINCT FROM OLD.id THEN\n                RAISE EXCEPTION USING ERRCODE = 'BD002',\n                    MESSAGE = 'buzz_delivery: a community id never changes';\n            END IF;\n            IF NEW.deletion_state IS DISTINCT FROM OLD.deletion_state THEN\n                -- The write fence's other side: writers hold this lock shared until they\n                -- commit; taken here, on the node that owns the community row, it waits for\n                -- them and queues later writers behind this move (SPEC sections 5, 15).\n                PERFORM pg_advisory_xact_lock(1111752705, hashtext(OLD.id::text));\n                -- This transaction's writers judge the community again from now on.\n                PERFORM set_config('buzz_delivery.fence_passed', '', true);\n                old_rank := array_position(ARRAY['active','quiescing','fenced','tombstone'], OLD.deletion_state);\n                new_rank := array_position(ARRAY['active','quiescing','fenced','tombstone'], NEW.deletion_state);\n                IF new_rank IS DISTINCT FROM old_rank + 1 THEN\n                    RAISE EXCEPTION USING ERRCODE = 'BD002',\n                        MESSAGE = format('buzz_delivery: community %s cannot move from %s to %s '\n                                         '(states move forward one step at a time)',\n                                         OLD.id, OLD.deletion_state, NEW.deletion_state);\n                END IF;\n                IF NEW.deletion_state = 'tombstone' AND (EXISTS (SELECT 1 FROM buzz_delivery_rate_limit WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_delivery_record WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_workflow_run WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_event WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_workflow WHERE community_id = OLD.id)) THEN\n                    RAISE EXCEPTION USING ERRCODE = 'BD002',\n                        MESSAGE = format('buzz_delivery: community %s still holds rows; '\n                                         'purge it before it becomes tombstone', OLD.id);\n                END IF;\n                NEW.fence_generation := OLD.fence_generation + 1;\n                NEW.state_changed_at := now();\n            ELSIF NEW.fence_generation IS DISTINCT FROM OLD.fence_generation THEN\n                RAISE EXCEPTION USING ERRCODE = 'BD002',\n                    MESSAGE = 'buzz_delivery: fence_generation changes only with a lifecycle move';\n            END IF;\n            RETURN NEW;\n        ",
                        hash="dba41c94fdb7862d35e081a210d17928215f1669",
                        operation="UPDATE",
                        pgid="pgtrigger_community_lifecycle_forward_only_9a308",
                        table="buzz_delivery_community",
                        when="BEFORE",
                    ),
                ),
            )
        ),
        migrations.RunSQL(sql=each_function(FUNCTIONS), reverse_sql=migrations.RunSQL.noop),
        isolation.view_grant_operation("buzz_delivery"),
        migrations.RunPython(grant_the_tables_readers_the_view, migrations.RunPython.noop, elidable=False),
    ]
