"""The plan-cached lease functions (``buzz_delivery.services.cached``) read the community's lifecycle
once a statement (issue 31).

Their lifecycle test (``EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE ... AND
c.deletion_state = 'active')``) named the row's ``community_id``: a correlated test, which
PostgreSQL runs once for each row the claim picks or the settle ends. Every one of those
statements names its community (``d.community_id = p_community_id``), so the test now names the
parameter: an InitPlan read once a statement, with the same answer (the renewal and the settles
probed that one row, which every backend of every worker reads, once a lease; the claims' plans
already read it once). The peers drains measured no difference (``bench/results/community-once-ab.md``).

Only the bodies change (same arguments and result types): ``CREATE OR REPLACE``, one statement a
function (for Citus). On Citus run ``distribute_tables`` after it, as after every migrate.
Backwards, 0038's bodies are put back."""

import importlib

from django.db import migrations

each_function = importlib.import_module("buzz_delivery.migrations.0034_delivery_record_behind_a_view").each_function
OLD_FUNCTIONS = importlib.import_module("buzz_delivery.migrations.0038_delivery_queue_functions").FUNCTIONS

# What cached.ALL's create_sql() printed when this migration was written.
FUNCTIONS = r"""
CREATE OR REPLACE FUNCTION buzz_delivery_claim_pending(p_community_id uuid, p_target_pubkey bytea, p_limit bigint, p_lease_seconds float8, p_holder text)
RETURNS TABLE(community_id uuid, id uuid, workflow_id uuid, run_id uuid, step_id varchar, target_pubkey bytea, definition_event_id bytea, message_event_id bytea, cause_kind varchar, cause_event_id bytea, cause_scheduled_for timestamptz, cause_webhook_invocation_id uuid, status varchar, lease_generation bigint, lease_until timestamptz, claimed_at timestamptz, finished_at timestamptz, created_at timestamptz, priority smallint, slot_community smallint, slot_target smallint, slot_workflow smallint, singleton_key varchar, attempt integer, max_attempts integer, next_attempt_at timestamptz, expires_at timestamptz, failure_code varchar, failure_message text, claimed_by text, renewals integer) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
WITH claimed AS (
WITH candidate AS MATERIALIZED (
    SELECT d.id
    FROM buzz_delivery_delivery_queue AS d
    WHERE d.community_id = p_community_id
      AND d.target_pubkey = p_target_pubkey
      AND d.status = 'pending'
      AND (d.next_attempt_at IS NULL OR d.next_attempt_at <= buzz_delivery_now())
      AND (d.expires_at IS NULL OR d.expires_at > buzz_delivery_now())
      AND (d.max_attempts IS NULL OR d.attempt < d.max_attempts)
      
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = p_community_id AND c.deletion_state = 'active')
    ORDER BY d.priority DESC, d.created_at, d.id
    LIMIT p_limit
    FOR UPDATE OF d SKIP LOCKED
)
UPDATE buzz_delivery_delivery_queue AS d
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
    singleton_key = NULL,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('claim')::text, 'status', ('claimed')::text, 'actor', (p_holder::text)::text]) || ('{"generation": ' || (d.lease_generation + 1)::text || ', "attempt": ' || (d.attempt + 1)::text || '}')::jsonb)
FROM candidate, unnest(ARRAY(SELECT candidate.id FROM candidate)) AS listed(id)
-- Through the primary key only: no status test here (the CTE locked each candidate FOR UPDATE
-- after re-checking its latest version, so nothing else changed it since), or with stale
-- statistics the pending-only indexes win and every pending row is read (test_claim_plan_stale_stats).
WHERE d.community_id = p_community_id AND d.id = candidate.id AND d.id = listed.id
RETURNING d.status, d.lease_generation, d.lease_until, d.claimed_at, d.slot_community, d.slot_target, d.slot_workflow, d.attempt, d.next_attempt_at, d.expires_at, d.claimed_by, d.renewals, d.id
)
SELECT r.community_id, r.id, r.workflow_id, r.run_id, r.step_id, r.target_pubkey, r.definition_event_id, r.message_event_id, r.cause_kind, r.cause_event_id, r.cause_scheduled_for, r.cause_webhook_invocation_id, q.status, q.lease_generation, q.lease_until, q.claimed_at, r.finished_at, r.created_at, r.priority, q.slot_community, q.slot_target, q.slot_workflow, r.singleton_key, q.attempt, r.max_attempts, q.next_attempt_at, q.expires_at, r.failure_code, r.failure_message, q.claimed_by, q.renewals
FROM claimed AS q
JOIN buzz_delivery_delivery_record AS r ON r.community_id = p_community_id AND r.id = q.id;
END
$fn$;
CREATE OR REPLACE FUNCTION buzz_delivery_finish_lease(p_community_id uuid, p_delivery_id uuid, p_target_pubkey bytea, p_lease_generation bigint, p_status varchar, p_failure_code varchar, p_failure_message text)
RETURNS TABLE(status varchar) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
WITH gone AS (
    DELETE FROM buzz_delivery_delivery_queue AS d
    WHERE 
    d.community_id = p_community_id
    AND d.id = p_delivery_id
    AND d.target_pubkey = p_target_pubkey
    AND d.lease_generation = p_lease_generation
    AND d.status = 'claimed'
    AND d.lease_until >= buzz_delivery_now()
    AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = p_community_id AND c.deletion_state = 'active')

    RETURNING d.id, d.lease_generation, d.attempt, d.max_attempts, d.claimed_by, d.renewals, d.history
)
UPDATE buzz_delivery_delivery_record AS r
SET status = p_status,
    finished_at = buzz_delivery_now(),
    failure_code = p_failure_code,
    failure_message = p_failure_message,
    lease_generation = d.lease_generation,
    attempt = d.attempt,
    claimed_by = d.claimed_by,
    renewals = d.renewals,
    lease_until = NULL,
    claimed_at = NULL,
    next_attempt_at = NULL,
    slot_community = NULL,
    slot_target = NULL,
    slot_workflow = NULL,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('settle')::text, 'status', (p_status::varchar)::text, 'actor', (d.claimed_by)::text]) || ('{"generation": ' || (d.lease_generation)::text || ', "renewals": ' || (d.renewals)::text || '}')::jsonb)
FROM gone AS d
WHERE r.community_id = p_community_id AND r.id = d.id
RETURNING r.status;
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
WITH gone AS (
    DELETE FROM buzz_delivery_delivery_queue AS d
    USING unnest(p_delivery_ids::uuid[], p_lease_generations::bigint[], p_target_pubkeys::bytea[])
        AS f(id, generation, target)
    WHERE d.community_id = p_community_id
      AND d.id = f.id
      AND d.target_pubkey = f.target
      AND d.lease_generation = f.generation
      AND d.status = 'claimed' COLLATE "C"
      AND d.lease_until >= buzz_delivery_now()
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = p_community_id AND c.deletion_state = 'active')
    RETURNING d.id, d.lease_generation, d.attempt, d.max_attempts, d.claimed_by, d.renewals, d.history
)
UPDATE buzz_delivery_delivery_record AS r
SET status = p_status,
    finished_at = buzz_delivery_now(),
    failure_code = p_failure_code,
    failure_message = p_failure_message,
    lease_generation = d.lease_generation,
    attempt = d.attempt,
    claimed_by = d.claimed_by,
    renewals = d.renewals,
    lease_until = NULL,
    claimed_at = NULL,
    next_attempt_at = NULL,
    slot_community = NULL,
    slot_target = NULL,
    slot_workflow = NULL,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('settle')::text, 'status', (p_status::varchar)::text, 'actor', (d.claimed_by)::text]) || ('{"generation": ' || (d.lease_generation)::text || ', "renewals": ' || (d.renewals)::text || '}')::jsonb)
FROM gone AS d
WHERE r.community_id = p_community_id AND r.id = d.id
RETURNING r.id, r.status;
END
$fn$;
CREATE OR REPLACE FUNCTION buzz_delivery_claim_limited(p_community_id uuid, p_target_pubkey bytea, p_limit bigint, p_lease_seconds float8, p_holder text, p_cap_community integer, p_cap_target integer, p_cap_workflow integer)
RETURNS TABLE(community_id uuid, id uuid, workflow_id uuid, run_id uuid, step_id varchar, target_pubkey bytea, definition_event_id bytea, message_event_id bytea, cause_kind varchar, cause_event_id bytea, cause_scheduled_for timestamptz, cause_webhook_invocation_id uuid, status varchar, lease_generation bigint, lease_until timestamptz, claimed_at timestamptz, finished_at timestamptz, created_at timestamptz, priority smallint, slot_community smallint, slot_target smallint, slot_workflow smallint, singleton_key varchar, attempt integer, max_attempts integer, next_attempt_at timestamptz, expires_at timestamptz, failure_code varchar, failure_message text, claimed_by text, renewals integer) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(1651862577, hashtext(p_community_id::text));
    RETURN QUERY
WITH claimed AS (
WITH candidate AS MATERIALIZED (
    SELECT d.id, d.priority, d.created_at, d.target_pubkey, d.workflow_id
    FROM buzz_delivery_delivery_queue AS d
    WHERE d.community_id = p_community_id
      AND d.target_pubkey = p_target_pubkey
      AND d.status = 'pending'
      AND (d.next_attempt_at IS NULL OR d.next_attempt_at <= buzz_delivery_now())
      AND (d.expires_at IS NULL OR d.expires_at > buzz_delivery_now())
      AND (d.max_attempts IS NULL OR d.attempt < d.max_attempts)
      
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = p_community_id AND c.deletion_state = 'active')
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
        SELECT 1 FROM buzz_delivery_delivery_queue AS h
        WHERE h.community_id = p_community_id AND h.slot_community = g.slot
    )
),
target_free AS MATERIALIZED (
    SELECT k.target_pubkey, g.slot, row_number() OVER (PARTITION BY k.target_pubkey ORDER BY g.slot) AS rank
    FROM (SELECT DISTINCT target_pubkey FROM candidate) AS k, generate_series(0, p_cap_target - 1) AS g(slot)
    WHERE NOT EXISTS (
        SELECT 1 FROM buzz_delivery_delivery_queue AS h
        WHERE h.community_id = p_community_id AND h.target_pubkey = k.target_pubkey AND h.slot_target = g.slot
    )
),
workflow_free AS MATERIALIZED (
    SELECT k.workflow_id, g.slot, row_number() OVER (PARTITION BY k.workflow_id ORDER BY g.slot) AS rank
    FROM (SELECT DISTINCT workflow_id FROM candidate) AS k, generate_series(0, p_cap_workflow - 1) AS g(slot)
    WHERE NOT EXISTS (
        SELECT 1 FROM buzz_delivery_delivery_queue AS h
        WHERE h.community_id = p_community_id AND h.workflow_id = k.workflow_id AND h.slot_workflow = g.slot
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
UPDATE buzz_delivery_delivery_queue AS d
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
    singleton_key = NULL,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('claim')::text, 'status', ('claimed')::text, 'actor', (p_holder::text)::text]) || ('{"generation": ' || (d.lease_generation + 1)::text || ', "attempt": ' || (d.attempt + 1)::text || '}')::jsonb)
FROM candidate, admitted, unnest(ARRAY(SELECT admitted.id FROM admitted)) AS listed(id)
-- Through the primary key only: no status test here (the CTE locked each candidate FOR UPDATE
-- after re-checking its latest version, so nothing else changed it since).
WHERE d.community_id = p_community_id AND d.id = candidate.id AND d.id = admitted.id AND d.id = listed.id
RETURNING d.status, d.lease_generation, d.lease_until, d.claimed_at, d.slot_community, d.slot_target, d.slot_workflow, d.attempt, d.next_attempt_at, d.expires_at, d.claimed_by, d.renewals, d.id
)
SELECT r.community_id, r.id, r.workflow_id, r.run_id, r.step_id, r.target_pubkey, r.definition_event_id, r.message_event_id, r.cause_kind, r.cause_event_id, r.cause_scheduled_for, r.cause_webhook_invocation_id, q.status, q.lease_generation, q.lease_until, q.claimed_at, r.finished_at, r.created_at, r.priority, q.slot_community, q.slot_target, q.slot_workflow, r.singleton_key, q.attempt, r.max_attempts, q.next_attempt_at, q.expires_at, r.failure_code, r.failure_message, q.claimed_by, q.renewals
FROM claimed AS q
JOIN buzz_delivery_delivery_record AS r ON r.community_id = p_community_id AND r.id = q.id;
END
$fn$;
CREATE OR REPLACE FUNCTION buzz_delivery_claim_hinted(p_community_id uuid, p_target_pubkey bytea, p_delivery_id uuid, p_limit bigint, p_lease_seconds float8, p_holder text)
RETURNS TABLE(community_id uuid, id uuid, workflow_id uuid, run_id uuid, step_id varchar, target_pubkey bytea, definition_event_id bytea, message_event_id bytea, cause_kind varchar, cause_event_id bytea, cause_scheduled_for timestamptz, cause_webhook_invocation_id uuid, status varchar, lease_generation bigint, lease_until timestamptz, claimed_at timestamptz, finished_at timestamptz, created_at timestamptz, priority smallint, slot_community smallint, slot_target smallint, slot_workflow smallint, singleton_key varchar, attempt integer, max_attempts integer, next_attempt_at timestamptz, expires_at timestamptz, failure_code varchar, failure_message text, claimed_by text, renewals integer) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
WITH claimed AS (
WITH candidate AS MATERIALIZED (
    SELECT d.id
    FROM buzz_delivery_delivery_queue AS d
    WHERE d.community_id = p_community_id
      AND d.target_pubkey = p_target_pubkey
      AND d.status = 'pending'
      AND (d.next_attempt_at IS NULL OR d.next_attempt_at <= buzz_delivery_now())
      AND (d.expires_at IS NULL OR d.expires_at > buzz_delivery_now())
      AND (d.max_attempts IS NULL OR d.attempt < d.max_attempts)
      AND d.id = p_delivery_id
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = p_community_id AND c.deletion_state = 'active')
    ORDER BY d.priority DESC, d.created_at, d.id
    LIMIT p_limit
    FOR UPDATE OF d SKIP LOCKED
)
UPDATE buzz_delivery_delivery_queue AS d
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
    singleton_key = NULL,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('claim')::text, 'status', ('claimed')::text, 'actor', (p_holder::text)::text]) || ('{"generation": ' || (d.lease_generation + 1)::text || ', "attempt": ' || (d.attempt + 1)::text || '}')::jsonb)
-- Through the primary key only: no status test here (the CTE locked each candidate FOR UPDATE
-- after re-checking its latest version, so nothing else changed it since), or with stale
-- statistics the pending-only indexes win and every pending row is read (test_claim_plan_stale_stats).
WHERE d.community_id = p_community_id AND d.id = p_delivery_id AND d.id IN (SELECT candidate.id FROM candidate)
RETURNING d.status, d.lease_generation, d.lease_until, d.claimed_at, d.slot_community, d.slot_target, d.slot_workflow, d.attempt, d.next_attempt_at, d.expires_at, d.claimed_by, d.renewals, d.id
)
SELECT r.community_id, r.id, r.workflow_id, r.run_id, r.step_id, r.target_pubkey, r.definition_event_id, r.message_event_id, r.cause_kind, r.cause_event_id, r.cause_scheduled_for, r.cause_webhook_invocation_id, q.status, q.lease_generation, q.lease_until, q.claimed_at, r.finished_at, r.created_at, r.priority, q.slot_community, q.slot_target, q.slot_workflow, r.singleton_key, q.attempt, r.max_attempts, q.next_attempt_at, q.expires_at, r.failure_code, r.failure_message, q.claimed_by, q.renewals
FROM claimed AS q
JOIN buzz_delivery_delivery_record AS r ON r.community_id = p_community_id AND r.id = q.id;
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
WITH back AS (
    UPDATE buzz_delivery_delivery_queue AS d
    SET status = 'pending',
        next_attempt_at = buzz_delivery_plus_seconds(buzz_delivery_now(), GREATEST(LEAST(p_backoff_base * power(2, LEAST(GREATEST(d.attempt - 1, 0), 62)), p_backoff_cap) * s.jitter, s.retry_after)),
        lease_until = NULL,
        claimed_at = NULL,
        slot_community = NULL,
        slot_target = NULL,
        slot_workflow = NULL,
        history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('retry')::text, 'status', ('pending')::text, 'actor', (d.claimed_by)::text]) || ('{"generation": ' || (d.lease_generation)::text || ', "renewals": ' || (d.renewals)::text || '}')::jsonb)
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
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = p_community_id AND c.deletion_state = 'active')
      AND s.outcome = 'retry' AND NOT (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts)
    RETURNING d.id, d.status
),
gone AS (
    DELETE FROM buzz_delivery_delivery_queue AS d
    USING unnest(
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
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = p_community_id AND c.deletion_state = 'active')
      AND NOT (s.outcome = 'retry' AND NOT (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts))
    RETURNING d.id, d.lease_generation, d.attempt, d.max_attempts, d.claimed_by, d.renewals, d.history, s.outcome, s.failure_code, s.failure_message
),
done AS (
    UPDATE buzz_delivery_delivery_record AS r
    SET status = CASE WHEN d.outcome = 'retry' THEN 'failed' ELSE d.outcome END,
        finished_at = buzz_delivery_now(),
        failure_code = CASE WHEN d.outcome = 'retry' THEN 'attempts_exhausted' ELSE d.failure_code END,
        failure_message = d.failure_message,
        lease_generation = d.lease_generation,
    attempt = d.attempt,
    claimed_by = d.claimed_by,
    renewals = d.renewals,
    lease_until = NULL,
    claimed_at = NULL,
    next_attempt_at = NULL,
    slot_community = NULL,
    slot_target = NULL,
    slot_workflow = NULL,
        history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', (CASE WHEN d.outcome = 'retry' THEN 'retry' ELSE 'settle' END)::text, 'status', (CASE WHEN d.outcome = 'retry' THEN 'failed' ELSE d.outcome END)::text, 'actor', (d.claimed_by)::text]) || ('{"generation": ' || (d.lease_generation)::text || ', "renewals": ' || (d.renewals)::text || '}')::jsonb)
    FROM gone AS d
WHERE r.community_id = p_community_id AND r.id = d.id
    RETURNING r.id, r.status
)
SELECT back.id, back.status FROM back
UNION ALL
SELECT done.id, done.status FROM done;
END
$fn$;
CREATE OR REPLACE FUNCTION buzz_delivery_retry_lease(p_community_id uuid, p_delivery_id uuid, p_target_pubkey bytea, p_lease_generation bigint, p_failure_message text, p_backoff_base float8, p_backoff_cap float8, p_jitter float8, p_retry_after float8)
RETURNS TABLE(status varchar) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
WITH back AS (
    UPDATE buzz_delivery_delivery_queue AS d
    SET status = 'pending',
        next_attempt_at = buzz_delivery_plus_seconds(buzz_delivery_now(), GREATEST(LEAST(p_backoff_base * power(2, LEAST(GREATEST(d.attempt - 1, 0), 62)), p_backoff_cap) * p_jitter, p_retry_after)),
        lease_until = NULL,
        claimed_at = NULL,
        slot_community = NULL,
        slot_target = NULL,
        slot_workflow = NULL,
        history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('retry')::text, 'status', ('pending')::text, 'actor', (d.claimed_by)::text]) || ('{"generation": ' || (d.lease_generation)::text || ', "renewals": ' || (d.renewals)::text || '}')::jsonb)
    WHERE 
    d.community_id = p_community_id
    AND d.id = p_delivery_id
    AND d.target_pubkey = p_target_pubkey
    AND d.lease_generation = p_lease_generation
    AND d.status = 'claimed'
    AND d.lease_until >= buzz_delivery_now()
    AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = p_community_id AND c.deletion_state = 'active')
 AND NOT (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts)
    RETURNING d.status
),
gone AS (
    DELETE FROM buzz_delivery_delivery_queue AS d
    WHERE 
    d.community_id = p_community_id
    AND d.id = p_delivery_id
    AND d.target_pubkey = p_target_pubkey
    AND d.lease_generation = p_lease_generation
    AND d.status = 'claimed'
    AND d.lease_until >= buzz_delivery_now()
    AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = p_community_id AND c.deletion_state = 'active')
 AND (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts)
    RETURNING d.id, d.lease_generation, d.attempt, d.max_attempts, d.claimed_by, d.renewals, d.history
),
failed AS (
    UPDATE buzz_delivery_delivery_record AS r
    SET status = 'failed',
        finished_at = buzz_delivery_now(),
        failure_code = 'attempts_exhausted',
        failure_message = p_failure_message,
        lease_generation = d.lease_generation,
    attempt = d.attempt,
    claimed_by = d.claimed_by,
    renewals = d.renewals,
    lease_until = NULL,
    claimed_at = NULL,
    next_attempt_at = NULL,
    slot_community = NULL,
    slot_target = NULL,
    slot_workflow = NULL,
        history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('retry')::text, 'status', ('failed')::text, 'actor', (d.claimed_by)::text]) || ('{"generation": ' || (d.lease_generation)::text || ', "renewals": ' || (d.renewals)::text || '}')::jsonb)
    FROM gone AS d
WHERE r.community_id = p_community_id AND r.id = d.id
    RETURNING r.status
)
SELECT back.status FROM back
UNION ALL
SELECT failed.status FROM failed;
END
$fn$;
"""


class Migration(migrations.Migration):
    dependencies = [("buzz_delivery", "0040_record_index_swap_concurrently")]

    operations = [
        migrations.RunSQL(sql=each_function(FUNCTIONS), reverse_sql=each_function(OLD_FUNCTIONS)),
    ]
