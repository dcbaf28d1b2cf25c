"""The engine's hottest statements as plan-cached PL/pgSQL functions (issue 31,
``buzz_delivery/workflows/services/cached.py``): the claim of ready steps and the batch
completion (once per orchestrator round) and the start of a run (once per run) were parsed and
planned anew on every call (about 0.3-0.5 ms of server CPU per run of DBOS's diamond,
``bench/results/engine-server-cpu.md``). A frozen copy of what ``CachedStatement.create_sql()``
printed when this migration was written."""

from django.db import migrations

CLAIM_READY = r"""
CREATE OR REPLACE FUNCTION buzz_workflows_claim_ready(p_community_id uuid, p_limit bigint, p_lease_seconds float8, p_holder text)
RETURNS TABLE(o_community_id uuid, o_id uuid, o_run_id uuid, o_key varchar, o_kind varchar, o_state varchar, o_position integer, o_depends_on varchar[], o_dependents varchar[], o_deps_total integer, o_deps_done integer, o_deps_blocked integer, o_on_error varchar, o_when_cond jsonb, o_max_attempts integer, o_attempts integer, o_timeout_seconds integer, o_backoff_base_seconds double precision, o_backoff_cap_seconds double precision, o_lease_generation bigint, o_lease_until timestamp with time zone, o_claimed_at timestamp with time zone, o_ready_at timestamp with time zone, o_next_attempt_at timestamp with time zone, o_waiting_since timestamp with time zone, o_wait_deadline timestamp with time zone, o_expected integer, o_delivered_terminal integer, o_delivered_failed integer, o_tolerate_failures integer, o_child_run_id uuid, o_output jsonb, o_failure_code varchar, o_failure_message text, o_skip_reason varchar, o_priority smallint, o_created_at timestamp with time zone, o_started_at timestamp with time zone, o_finished_at timestamp with time zone, o_claimed_by text, o_renewals integer, o_event_name varchar, o_event_key text, o_on_timeout varchar, o_map_key varchar, o_item_index integer, o_spec jsonb, o_slot_community smallint, o_slot_workflow smallint, o_slot_step smallint, o_slot_workflow_id uuid, o_definition_id uuid) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
WITH candidate AS MATERIALIZED (
    SELECT s.id FROM buzz_workflows_step AS s
    WHERE s.community_id = p_community_id
      AND s.state = 'ready'
      AND (s.next_attempt_at IS NULL OR s.next_attempt_at <= buzz_delivery_now())
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = p_community_id AND c.deletion_state = 'active')
    ORDER BY s.priority DESC, s.ready_at, s.id
    LIMIT p_limit
    FOR UPDATE OF s SKIP LOCKED
)
UPDATE buzz_workflows_step AS s
SET state = 'running',
    lease_generation = s.lease_generation + 1,
    attempts = s.attempts + 1,
    claimed_at = buzz_delivery_now(),
    started_at = buzz_delivery_now(),
    lease_until = buzz_delivery_now() + make_interval(secs => p_lease_seconds),
    next_attempt_at = NULL,
    claimed_by = p_holder,
    renewals = 0,
    history = buzz_delivery_history_push(s.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('claim')::text, 'status', ('running')::text, 'actor', (p_holder::text)::text]) || ('{"generation": ' || (s.lease_generation + 1)::text || ', "attempt": ' || (s.attempts + 1)::text || '}')::jsonb),
    slot_community = NULL, slot_workflow = NULL, slot_step = NULL
-- Through the primary key (the ids as an array), with no state test: the candidates were locked
-- FOR UPDATE after their latest version was re-checked (still ready), and a state test would
-- let a plan reach them through the ready index or a scan of every ready step of the community;
-- the run's definition by its key, row by row (a join let the plan-cached function's generic
-- plan scan the community's runs: tests/test_wf_cached_statements.py).
WHERE s.community_id = p_community_id AND s.id = ANY (ARRAY(SELECT candidate.id FROM candidate))
RETURNING s.community_id, s.id, s.run_id, s.key, s.kind, s.state, s.position, s.depends_on, s.dependents, s.deps_total, s.deps_done, s.deps_blocked, s.on_error, s.when_cond, s.max_attempts, s.attempts, s.timeout_seconds, s.backoff_base_seconds, s.backoff_cap_seconds, s.lease_generation, s.lease_until, s.claimed_at, s.ready_at, s.next_attempt_at, s.waiting_since, s.wait_deadline, s.expected, s.delivered_terminal, s.delivered_failed, s.tolerate_failures, s.child_run_id, s.output, s.failure_code, s.failure_message, s.skip_reason, s.priority, s.created_at, s.started_at, s.finished_at, s.claimed_by, s.renewals, s.event_name, s.event_key, s.on_timeout, s.map_key, s.item_index, s.spec, s.slot_community, s.slot_workflow, s.slot_step, s.slot_workflow_id,
    (SELECT r.definition_id FROM buzz_workflows_run AS r WHERE r.community_id = p_community_id AND r.run_id = s.run_id);
END
$fn$;
"""

COMPLETE_STEPS = r"""
CREATE OR REPLACE FUNCTION buzz_workflows_complete_steps(p_community_id uuid, p_step_ids uuid[], p_lease_generations bigint[], p_outputs jsonb[])
RETURNS TABLE(o_id uuid) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
UPDATE buzz_workflows_step AS s
SET state = 'succeeded', output = u.output, failure_code = NULL, failure_message = NULL,
    lease_until = NULL, claimed_at = NULL, finished_at = buzz_delivery_now(),
    history = buzz_delivery_history_push(s.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('settle')::text, 'status', ('succeeded')::text, 'actor', (s.claimed_by)::text]) || ('{"generation": ' || (s.lease_generation)::text || ', "renewals": ' || (s.renewals)::text || '}')::jsonb)
FROM unnest(p_step_ids::uuid[], p_lease_generations::bigint[], p_outputs::jsonb[]) AS u(id, generation, output)
WHERE s.community_id = p_community_id
  AND s.id = u.id
  AND s.lease_generation = u.generation
  AND s.state = 'running'
  AND s.lease_until >= buzz_delivery_now()
  AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = p_community_id AND c.deletion_state = 'active')
RETURNING s.id;
END
$fn$;
"""

CREATE_RUN = r"""
CREATE OR REPLACE FUNCTION buzz_workflows_create_run(p_community_id uuid, p_run_id uuid, p_workflow_id uuid, p_definition_id uuid, p_input jsonb, p_cause_kind text, p_cause_event_id bytea, p_cause_scheduled_for timestamptz, p_cause_webhook_invocation_id uuid, p_idempotency_key text, p_parent_run_id uuid, p_parent_step_key text, p_depth integer, p_restart_of_id uuid, p_steps_total integer, p_deadline_seconds float8, p_steps jsonb, p_tags text[], p_trace_context jsonb, p_priority integer)
RETURNS TABLE(o_community_id uuid, o_run_id uuid, o_workflow_id uuid, o_definition_id uuid, o_state varchar, o_input jsonb, o_output jsonb, o_tags varchar[], o_failure_code varchar, o_failure_message text, o_cause_kind varchar, o_cause_event_id bytea, o_cause_scheduled_for timestamp with time zone, o_cause_webhook_invocation_id uuid, o_idempotency_key varchar, o_parent_run_id uuid, o_parent_step_key varchar, o_restart_of_id uuid, o_depth integer, o_steps_total integer, o_steps_left integer, o_deadline_at timestamp with time zone, o_deliveries_to_expire boolean, o_trace_context jsonb, o_created_at timestamp with time zone, o_priority smallint, o_finished_at timestamp with time zone, o_notified text) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
WITH core AS (
    INSERT INTO buzz_delivery_workflow_run (id, community_id, workflow_id)
    VALUES (p_run_id, p_community_id, p_workflow_id)
), run AS (
    INSERT INTO buzz_workflows_run (run_id, community_id, workflow_id, definition_id, state, input, cause_kind, cause_event_id, cause_scheduled_for, cause_webhook_invocation_id, idempotency_key, parent_run_id, parent_step_key, depth, restart_of_id, steps_total, steps_left, deadline_at, deliveries_to_expire, tags, trace_context, priority)
    VALUES (p_run_id, p_community_id, p_workflow_id, p_definition_id, 'running', p_input::jsonb,
            p_cause_kind, p_cause_event_id, p_cause_scheduled_for, p_cause_webhook_invocation_id,
            p_idempotency_key, p_parent_run_id, p_parent_step_key, p_depth, p_restart_of_id,
            p_steps_total, p_steps_total, buzz_delivery_now() + make_interval(secs => p_deadline_seconds), false,
            p_tags::varchar(100)[], p_trace_context::jsonb, p_priority)
    RETURNING community_id, run_id, workflow_id, definition_id, state, input, output, tags, failure_code, failure_message, cause_kind, cause_event_id, cause_scheduled_for, cause_webhook_invocation_id, idempotency_key, parent_run_id, parent_step_key, restart_of_id, depth, steps_total, steps_left, deadline_at, deliveries_to_expire, trace_context, created_at, priority, finished_at
), ready AS (
    INSERT INTO buzz_workflows_step (id, community_id, run_id, key, kind, state, position, depends_on, dependents,
        deps_total, deps_done, deps_blocked, on_error, when_cond, max_attempts, attempts, timeout_seconds,
        backoff_base_seconds, backoff_cap_seconds, lease_generation, ready_at, delivered_terminal,
        delivered_failed, tolerate_failures, priority)
    SELECT x.id, p_community_id, p_run_id, x.key, x.kind, x.state, x.position, x.depends_on, x.dependents,
        x.deps_total, 0, 0, x.on_error, x.when_cond, x.max_attempts, 0, x.timeout_seconds,
        x.backoff_base_seconds, x.backoff_cap_seconds, 0, buzz_delivery_now(), 0, 0, x.tolerate_failures, p_priority
    FROM jsonb_to_recordset(p_steps::jsonb) AS x(id uuid, key text, kind text, state text, position integer, depends_on text[], dependents text[], deps_total integer, on_error text, when_cond jsonb, max_attempts integer, timeout_seconds integer, backoff_base_seconds double precision, backoff_cap_seconds double precision, tolerate_failures integer)
    WHERE x.state = 'ready'

), pending AS (
    INSERT INTO buzz_workflows_step (id, community_id, run_id, key, kind, state, position, depends_on, dependents,
        deps_total, deps_done, deps_blocked, on_error, when_cond, max_attempts, attempts, timeout_seconds,
        backoff_base_seconds, backoff_cap_seconds, lease_generation, ready_at, delivered_terminal,
        delivered_failed, tolerate_failures, priority)
    SELECT x.id, p_community_id, p_run_id, x.key, x.kind, x.state, x.position, x.depends_on, x.dependents,
        x.deps_total, 0, 0, x.on_error, x.when_cond, x.max_attempts, 0, x.timeout_seconds,
        x.backoff_base_seconds, x.backoff_cap_seconds, 0, NULL::timestamptz, 0, 0, x.tolerate_failures, p_priority
    FROM jsonb_to_recordset(p_steps::jsonb) AS x(id uuid, key text, kind text, state text, position integer, depends_on text[], dependents text[], deps_total integer, on_error text, when_cond jsonb, max_attempts integer, timeout_seconds integer, backoff_base_seconds double precision, backoff_cap_seconds double precision, tolerate_failures integer)
    WHERE x.state = 'pending'

)
SELECT community_id, run_id, workflow_id, definition_id, state, input, output, tags, failure_code, failure_message, cause_kind, cause_event_id, cause_scheduled_for, cause_webhook_invocation_id, idempotency_key, parent_run_id, parent_step_key, restart_of_id, depth, steps_total, steps_left, deadline_at, deliveries_to_expire, trace_context, created_at, priority, finished_at, pg_notify('buzz_workflows', p_community_id::text)::text FROM run;
END
$fn$;
"""


class Migration(migrations.Migration):
    # After 0025 (the fan-in in one update): one line of migrations.
    dependencies = [("buzz_workflows", "0025_fan_in_ends_step_in_its_counting_update")]

    operations = [
        migrations.RunSQL(sql=CLAIM_READY, reverse_sql="DROP FUNCTION buzz_workflows_claim_ready(uuid, bigint, float8, text);"),
        migrations.RunSQL(sql=COMPLETE_STEPS, reverse_sql="DROP FUNCTION buzz_workflows_complete_steps(uuid, uuid[], bigint[], jsonb[]);"),
        migrations.RunSQL(sql=CREATE_RUN, reverse_sql="DROP FUNCTION buzz_workflows_create_run(uuid, uuid, uuid, uuid, jsonb, text, bytea, timestamptz, uuid, text, uuid, text, integer, uuid, integer, float8, jsonb, text[], jsonb, integer);"),
    ]
