"""The start of a run in one statement, and one version of the run row less per run (issue 31,
``bench/results/engine-run-statements.md``).

1. ``buzz_workflows_create_run`` takes ``p_latest``: the run is of the workflow's latest version,
   and ``p_definition_id`` is the latest the caller's process last saw; the statement checks it
   (an uncorrelated read of the definitions by their key) and writes nothing, returning no row,
   when another version is latest. ``start_run`` read the latest version in a statement, and an
   autocommit transaction, of its own before every start; it now reads it only when its process
   has not seen one or the check refused it (``services/runs.py``). The check is a statement of
   the function before the start's own (``sql.LATEST_VERSION_CHECK_IN_FUNCTION``), which stays
   ``INSERT ... VALUES``: router form on Citus. Without ``p_latest`` (a child run, a restart, a
   pinned version) the start is the same as before. Its signature changes:
   the old function is dropped, the delegation on Citus names the new one (``cached.py``).

2. The Advance's count of a step in its run (``steps_left - 1``, one UPDATE of the run row per
   ended step) is left out for the run's last open step when the run is running and the step
   does not cancel: ``buzz_workflows_end_run`` counts it in the UPDATE that ends the run
   (``counted``), so the run row gets one version fewer per run (five to four for DBOS's
   diamond; the end's version is never HOT: it changes ``state``, which partial indexes name).
   The run is already locked by the transaction (every path that ends a step locks its run
   first, migration 0002); the UPDATE that would count it matches no row and writes nothing.
   Should the end find the run no longer running, the Advance counts the step as before.

3. ``buzz_workflows_end_run`` locks the run first only when it cancels steps (an end other than
   ``succeeded``: run first, then steps). A success updates no step of the run, and its caller,
   the Advance, holds the run already: the lock was a statement that took nothing new. The
   UPDATE that ends the run still waits for, and re-checks, any other holder (``state =
   'running'``).
"""

import importlib

from django.db import migrations

_0018 = importlib.import_module("buzz_delivery.workflows.migrations.0018_history_entries_immutable")
_0024 = importlib.import_module("buzz_delivery.workflows.migrations.0024_advance_releases_in_one_update")
_0026 = importlib.import_module("buzz_delivery.workflows.migrations.0026_engine_statements_as_functions")

_OLD_CREATE_RUN = (
    "buzz_workflows_create_run(uuid, uuid, uuid, uuid, jsonb, text, bytea, timestamptz, uuid, text, uuid, text,"
    " integer, uuid, integer, float8, jsonb, text[], jsonb, integer)"
)
_NEW_CREATE_RUN = _OLD_CREATE_RUN[:-1] + ", boolean)"

CREATE_RUN = r"""
CREATE OR REPLACE FUNCTION buzz_workflows_create_run(p_community_id uuid, p_run_id uuid, p_workflow_id uuid, p_definition_id uuid, p_input jsonb, p_cause_kind text, p_cause_event_id bytea, p_cause_scheduled_for timestamptz, p_cause_webhook_invocation_id uuid, p_idempotency_key text, p_parent_run_id uuid, p_parent_step_key text, p_depth integer, p_restart_of_id uuid, p_steps_total integer, p_deadline_seconds float8, p_steps jsonb, p_tags text[], p_trace_context jsonb, p_priority integer, p_latest boolean)
RETURNS TABLE(o_community_id uuid, o_run_id uuid, o_workflow_id uuid, o_definition_id uuid, o_state varchar, o_input jsonb, o_output jsonb, o_tags varchar[], o_failure_code varchar, o_failure_message text, o_cause_kind varchar, o_cause_event_id bytea, o_cause_scheduled_for timestamp with time zone, o_cause_webhook_invocation_id uuid, o_idempotency_key varchar, o_parent_run_id uuid, o_parent_step_key varchar, o_restart_of_id uuid, o_depth integer, o_steps_total integer, o_steps_left integer, o_deadline_at timestamp with time zone, o_deliveries_to_expire boolean, o_trace_context jsonb, o_created_at timestamp with time zone, o_priority smallint, o_finished_at timestamp with time zone, o_notified text) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    IF p_latest AND p_definition_id IS DISTINCT FROM (
        SELECT d.id FROM buzz_workflows_definition AS d
        WHERE d.community_id = p_community_id AND d.workflow_id = p_workflow_id
        ORDER BY d.version DESC LIMIT 1) THEN
        RETURN;  -- another version is the latest: nothing written, no row
    END IF;
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

END_RUN = """
DROP FUNCTION buzz_workflows_end_run(uuid, uuid, text, text, text);
CREATE FUNCTION buzz_workflows_end_run(cid uuid, rid uuid, st text, code text, msg text, counted integer DEFAULT 0)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    r record;
    child uuid;
    reason text;
    code_ text;
    out_ jsonb;
    to_expire boolean;
BEGIN
    IF st <> 'succeeded' THEN
        -- Lock order: the run first, then the steps this cancels.
        PERFORM 1 FROM buzz_workflows_run WHERE community_id = cid AND run_id = rid FOR NO KEY UPDATE;
        reason := 'run_' || st;
        UPDATE buzz_workflows_step SET state = 'canceled', lease_generation = lease_generation + 1,
            lease_until = NULL, claimed_at = NULL, wait_deadline = NULL, skip_reason = reason,
            finished_at = buzz_delivery_now(),
            history = buzz_delivery_history_push(history, jsonb_build_object('at', buzz_delivery_now())
                || jsonb_object(ARRAY['event', 'cancel', 'status', 'canceled', 'actor', 'engine', 'reason', reason])
                || ('{"generation": ' || (lease_generation + 1)::text || ', "renewals": ' || renewals::text || '}')::jsonb)
        WHERE community_id = cid AND run_id = rid AND state NOT IN ('succeeded', 'failed', 'skipped', 'canceled');
        UPDATE buzz_workflows_approval SET state = 'expired', closed_at = buzz_delivery_now()
        WHERE community_id = cid AND run_id = rid AND state = 'pending';
    END IF;
    -- Values first, so the SET below applies no function to a column (SPEC 15).
    SELECT jsonb_object_agg(s.key, s.output) INTO out_ FROM buzz_workflows_step s
    WHERE s.community_id = cid AND s.run_id = rid AND s.dependents = '{}' AND s.state = 'succeeded';
    to_expire := st <> 'succeeded';
    -- ``counted``: steps the caller (the Advance, for the run's last open step) counts here, in
    -- the run's one new version, rather than in an UPDATE of its own.
    UPDATE buzz_workflows_run SET state = st, failure_code = code, failure_message = msg,
        finished_at = buzz_delivery_now(), output = out_, deliveries_to_expire = to_expire,
        steps_left = steps_left - counted
    WHERE community_id = cid AND run_id = rid AND state = 'running'
    RETURNING parent_run_id, parent_step_key, output INTO r;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF st <> 'succeeded' THEN
        FOR child IN SELECT run_id FROM buzz_workflows_run
                     WHERE community_id = cid AND parent_run_id = rid AND state = 'running' LOOP
            PERFORM buzz_workflows_end_run(cid, child, 'canceled', NULL, NULL);
        END LOOP;
    END IF;
    IF r.parent_run_id IS NOT NULL THEN
        PERFORM 1 FROM buzz_workflows_run WHERE community_id = cid AND run_id = r.parent_run_id FOR NO KEY UPDATE;
        IF st = 'succeeded' THEN
            UPDATE buzz_workflows_step SET state = 'succeeded', output = coalesce(r.output, '{}'::jsonb),
                wait_deadline = NULL, finished_at = buzz_delivery_now()
            WHERE community_id = cid AND run_id = r.parent_run_id AND key = r.parent_step_key
              AND state = 'waiting' AND child_run_id = rid;
        ELSE
            code_ := 'child_run_' || st;
            UPDATE buzz_workflows_step SET state = 'failed', failure_code = code_,
                failure_message = msg, wait_deadline = NULL, finished_at = buzz_delivery_now()
            WHERE community_id = cid AND run_id = r.parent_run_id AND key = r.parent_step_key
              AND state = 'waiting' AND child_run_id = rid;
        END IF;
    END IF;
    RETURN true;
END;
$$;
"""

PREVIOUS_END_RUN = "DROP FUNCTION buzz_workflows_end_run(uuid, uuid, text, text, text, integer);\n" + _0018.END_RUN

ADVANCE = """
CREATE OR REPLACE FUNCTION buzz_workflows_advance() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    run_state text;
    left_ integer;
    counted integer := 0;
    ended boolean;
    blocked integer;
    now_ timestamptz;
    woke boolean := false;
    d record;
BEGIN
    -- The step counted in its run, but the running run's last open step (a step that does not
    -- cancel): its run's end counts it (buzz_workflows_end_run's ``counted``), one version.
    UPDATE buzz_workflows_run SET steps_left = steps_left - 1
    WHERE community_id = NEW.community_id AND run_id = NEW.run_id
      AND (steps_left > 1 OR state <> 'running' OR NEW.state = 'canceled')
    RETURNING state, steps_left INTO run_state, left_;
    IF NOT FOUND THEN
        run_state := 'running';
        left_ := 0;
        counted := 1;
    END IF;
    IF run_state IS DISTINCT FROM 'running' OR NEW.state = 'canceled' THEN
        RETURN NULL;  -- the run already ended (or is ending): nothing more advances
    END IF;
    IF NEW.state = 'failed' AND NEW.on_error = 'fail_run' THEN
        -- (The call is a statement of its own: inside an AND with ``counted = 1`` it was
        -- folded away when the plan knew ``counted`` was 0.)
        ended := buzz_workflows_end_run(NEW.community_id, NEW.run_id, 'failed', 'step_failed',
                                        format('step %s failed: %s', NEW.key, NEW.failure_code), counted);
        IF NOT ended AND counted = 1 THEN
            UPDATE buzz_workflows_run SET steps_left = steps_left - 1
            WHERE community_id = NEW.community_id AND run_id = NEW.run_id;
        END IF;
        RETURN NULL;
    END IF;
    IF cardinality(NEW.dependents) > 0 THEN
        blocked := CASE WHEN NEW.state = 'skipped' OR (NEW.state = 'failed' AND NEW.on_error = 'skip_dependents')
                        THEN 1 ELSE 0 END;
        now_ := buzz_delivery_now();
        -- A successor whose last dependency this is, none blocked and no `when`: ready here.
        FOR d IN UPDATE buzz_workflows_step
                 SET deps_done = deps_done + 1, deps_blocked = deps_blocked + blocked,
                     state = CASE WHEN deps_done + 1 = deps_total AND deps_blocked + blocked = 0
                                       AND when_cond IS NULL THEN 'ready' ELSE state END,
                     ready_at = CASE WHEN deps_done + 1 = deps_total AND deps_blocked + blocked = 0
                                          AND when_cond IS NULL THEN now_ ELSE ready_at END
                 WHERE community_id = NEW.community_id AND run_id = NEW.run_id AND key = ANY(NEW.dependents)
                   AND state = 'pending'
                 RETURNING id, state, deps_done, deps_total LOOP
            IF d.state = 'ready' THEN
                woke := true;
            ELSIF d.deps_done = d.deps_total THEN
                PERFORM buzz_workflows_release(NEW.community_id, d.id);  -- skipped, or its `when`
            END IF;
        END LOOP;
        IF woke AND current_setting('buzz_workflows.notify_deferred', true) IS DISTINCT FROM 'on' THEN
            PERFORM pg_notify('buzz_workflows', NEW.community_id::text);
        END IF;
    END IF;
    IF left_ = 0 THEN
        ended := buzz_workflows_end_run(NEW.community_id, NEW.run_id, 'succeeded', NULL, NULL, counted);
        IF NOT ended AND counted = 1 THEN
            UPDATE buzz_workflows_run SET steps_left = steps_left - 1
            WHERE community_id = NEW.community_id AND run_id = NEW.run_id;
        END IF;
    END IF;
    RETURN NULL;
END;
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("buzz_workflows", "0026_engine_statements_as_functions")]

    operations = [
        migrations.RunSQL(
            sql=f"DROP FUNCTION {_OLD_CREATE_RUN};\n{CREATE_RUN}",
            reverse_sql=f"DROP FUNCTION {_NEW_CREATE_RUN};\n{_0026.CREATE_RUN}",
        ),
        migrations.RunSQL(sql=END_RUN, reverse_sql=PREVIOUS_END_RUN),
        migrations.RunSQL(sql=ADVANCE, reverse_sql=_0024.ADVANCE),
    ]
