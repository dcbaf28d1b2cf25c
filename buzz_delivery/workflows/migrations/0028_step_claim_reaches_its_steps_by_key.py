"""The claim of ready steps (``buzz_workflows_claim_ready``, ``workflows/services/cached.py``)
reaches the steps it locked by primary key in its cached (generic) plan whatever the planner
estimates of the community: its UPDATE joins the candidates and their ids as an array
(``FROM candidate, unnest(ARRAY(SELECT candidate.id FROM candidate))``), so the plan probes the
key from whichever it estimates smaller, instead of ``s.id = ANY (ARRAY(...))`` alone, which lost
to the primary key's community prefix whenever the statistics gave a community fewer than ten
rows (a fleet of small communities): every step of the claiming community read on every claim
(``tests/test_engine_claim_plan_fleet_stats.py``). The same claim otherwise. A frozen copy of what
``CachedStatement.create_sql()`` printed when this migration was written; delegated on Citus as
before (``scaleout.delegated_functions``: the signature is unchanged)."""

import importlib

from django.db import migrations

_0026 = importlib.import_module("buzz_delivery.workflows.migrations.0026_engine_statements_as_functions")

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
WHERE s.community_id = p_community_id AND s.id = candidate.id AND s.id = listed.id
RETURNING s.community_id, s.id, s.run_id, s.key, s.kind, s.state, s.position, s.depends_on, s.dependents, s.deps_total, s.deps_done, s.deps_blocked, s.on_error, s.when_cond, s.max_attempts, s.attempts, s.timeout_seconds, s.backoff_base_seconds, s.backoff_cap_seconds, s.lease_generation, s.lease_until, s.claimed_at, s.ready_at, s.next_attempt_at, s.waiting_since, s.wait_deadline, s.expected, s.delivered_terminal, s.delivered_failed, s.tolerate_failures, s.child_run_id, s.output, s.failure_code, s.failure_message, s.skip_reason, s.priority, s.created_at, s.started_at, s.finished_at, s.claimed_by, s.renewals, s.event_name, s.event_key, s.on_timeout, s.map_key, s.item_index, s.spec, s.slot_community, s.slot_workflow, s.slot_step, s.slot_workflow_id,
    (SELECT r.definition_id FROM buzz_workflows_run AS r WHERE r.community_id = p_community_id AND r.run_id = s.run_id);
END
$fn$;
"""


class Migration(migrations.Migration):
    dependencies = [("buzz_workflows", "0027_start_in_one_statement_run_written_once_less")]

    operations = [migrations.RunSQL(sql=CLAIM_READY, reverse_sql=_0026.CLAIM_READY)]
