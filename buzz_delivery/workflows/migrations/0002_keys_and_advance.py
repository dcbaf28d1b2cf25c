"""What Django cannot declare for the engine's tables (SPEC sections 11 and 15):

- primary keys that lead with ``community_id`` (Django's own ``PRIMARY KEY (id)`` is replaced;
  the ORM still treats ``id``/``run_id`` as the primary key);
- composite, tenant-consistent foreign keys ``(community_id, x) REFERENCES t (community_id, id)``,
  to each other and to the core's ``Workflow``/``WorkflowRun`` (ON DELETE CASCADE, like the core);
- the tombstone guard: a community cannot become ``tombstone`` while an engine table holds its rows;
- Advance (SPEC 11 "Advance"): an AFTER trigger on the step table that, in the transaction
  that made a step terminal, counts it in its run and its dependents, releases dependents whose
  dependencies are all terminal (``when`` evaluated in SQL: ``ready`` or ``skipped``), ends the
  run when every step is terminal or a step failed under ``on_error: fail_run``, and moves the
  parent step of a child run;
- fan-in: an AFTER UPDATE trigger on the core's delivery table that counts each delivery of a
  waiting ``send_message`` step in the transaction that makes it terminal (or takes it back
  when an operator requeues it), whatever path settled it, and ends the step when all are in.

Lock order, on every path that can end a step: the run row first (``FOR NO KEY UPDATE``),
then step rows, so concurrent settles, cancels and completions never deadlock.
"""

from django.db import migrations

from buzz_delivery.delivery_table import RunSQLOnTheDeliveryTable

T = "('succeeded', 'failed', 'skipped', 'canceled')"

PRIMARY_KEYS = [
    ("buzz_workflows_definition", "id"),
    ("buzz_workflows_run", "run_id"),
    ("buzz_workflows_step", "id"),
    ("buzz_workflows_approval", "id"),
]

FOREIGN_KEYS = [
    ("buzz_workflows_definition", "wf_definition_workflow_same_community",
     "(community_id, workflow_id)", "buzz_delivery_workflow (community_id, id)"),
    ("buzz_workflows_run", "wf_run_core_run_same_community",
     "(community_id, run_id)", "buzz_delivery_workflow_run (community_id, id)"),
    ("buzz_workflows_run", "wf_run_workflow_same_community",
     "(community_id, workflow_id)", "buzz_delivery_workflow (community_id, id)"),
    ("buzz_workflows_run", "wf_run_definition_same_community",
     "(community_id, definition_id)", "buzz_workflows_definition (community_id, id)"),
    ("buzz_workflows_run", "wf_run_parent_same_community",
     "(community_id, parent_run_id)", "buzz_workflows_run (community_id, run_id)"),
    ("buzz_workflows_run", "wf_run_restart_of_same_community",
     "(community_id, restart_of_id)", "buzz_workflows_run (community_id, run_id)"),
    ("buzz_workflows_step", "wf_step_run_same_community",
     "(community_id, run_id)", "buzz_workflows_run (community_id, run_id)"),
    ("buzz_workflows_approval", "wf_approval_run_same_community",
     "(community_id, run_id)", "buzz_workflows_run (community_id, run_id)"),
    ("buzz_workflows_approval", "wf_approval_step_same_community",
     "(community_id, step_id)", "buzz_workflows_step (community_id, id)"),
]

TOMBSTONE_GUARD = """
CREATE FUNCTION buzz_workflows_refuse_tombstone() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM buzz_workflows_approval WHERE community_id = OLD.id)
       OR EXISTS (SELECT 1 FROM buzz_workflows_step WHERE community_id = OLD.id)
       OR EXISTS (SELECT 1 FROM buzz_workflows_run WHERE community_id = OLD.id)
       OR EXISTS (SELECT 1 FROM buzz_workflows_definition WHERE community_id = OLD.id) THEN
        RAISE EXCEPTION USING ERRCODE = 'BD002',
            MESSAGE = format('buzz_delivery: community %s still holds workflow engine rows; '
                             'purge it before it becomes tombstone', OLD.id);
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER buzz_workflows_tombstone_guard
BEFORE UPDATE OF deletion_state ON buzz_delivery_community
FOR EACH ROW WHEN (NEW.deletion_state = 'tombstone' AND OLD.deletion_state IS DISTINCT FROM 'tombstone')
EXECUTE FUNCTION buzz_workflows_refuse_tombstone();
"""
DROP_TOMBSTONE_GUARD = """
DROP TRIGGER buzz_workflows_tombstone_guard ON buzz_delivery_community;
DROP FUNCTION buzz_workflows_refuse_tombstone();
"""

ADVANCE = f"""
-- A reference into the run's data: ARRAY['input', ...path] or ARRAY['steps', key, 'output', ...path].
CREATE FUNCTION buzz_workflows_ref(cid uuid, rid uuid, ref text[]) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
DECLARE src jsonb;
BEGIN
    IF ref[1] = 'input' THEN
        SELECT r.input INTO src FROM buzz_workflows_run r WHERE r.community_id = cid AND r.run_id = rid;
        RETURN src #> coalesce(ref[2:], ARRAY[]::text[]);
    ELSIF ref[1] = 'steps' THEN
        SELECT s.output INTO src FROM buzz_workflows_step s
        WHERE s.community_id = cid AND s.run_id = rid AND s.key = ref[2];
        RETURN src #> coalesce(ref[4:], ARRAY[]::text[]);
    END IF;
    RETURN NULL;
END;
$$;

-- A `when` condition: {{"ref": [...], "equals"|"contains"|"exists": value, "not": bool}}.
CREATE FUNCTION buzz_workflows_when(cid uuid, rid uuid, cond jsonb) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    val jsonb := buzz_workflows_ref(cid, rid, ARRAY(SELECT jsonb_array_elements_text(cond->'ref')));
    res boolean;
BEGIN
    IF val IS NULL THEN val := 'null'::jsonb; END IF;
    IF cond ? 'equals' THEN
        res := val = cond->'equals';
    ELSIF cond ? 'contains' THEN
        res := val @> (cond->'contains');
    ELSE
        res := (val <> 'null'::jsonb) = (cond->>'exists')::boolean;
    END IF;
    IF (cond->>'not')::boolean IS TRUE THEN
        res := NOT res;
    END IF;
    RETURN coalesce(res, false);
END;
$$;

-- A pending step whose dependencies are all terminal: skipped (a blocking dependency, or its
-- condition is false) or ready.
CREATE FUNCTION buzz_workflows_release(cid uuid, sid uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE s record;
BEGIN
    SELECT id, run_id, deps_blocked, when_cond INTO s FROM buzz_workflows_step
    WHERE community_id = cid AND id = sid AND state = 'pending' AND deps_done = deps_total;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF s.deps_blocked > 0 THEN
        UPDATE buzz_workflows_step SET state = 'skipped', skip_reason = 'dependency_not_succeeded',
            finished_at = buzz_delivery_now()
        WHERE community_id = cid AND id = sid AND state = 'pending';
    ELSIF s.when_cond IS NOT NULL AND NOT buzz_workflows_when(cid, s.run_id, s.when_cond) THEN
        UPDATE buzz_workflows_step SET state = 'skipped', skip_reason = 'condition_false',
            finished_at = buzz_delivery_now()
        WHERE community_id = cid AND id = sid AND state = 'pending';
    ELSE
        UPDATE buzz_workflows_step SET state = 'ready', ready_at = buzz_delivery_now()
        WHERE community_id = cid AND id = sid AND state = 'pending';
        PERFORM pg_notify('buzz_workflows', cid::text);
    END IF;
END;
$$;

-- End a running run once: succeeded (output = its succeeded sink steps' outputs), failed or
-- canceled (every non-terminal step canceled with generation + 1, child runs canceled, pending
-- approvals expired). A child run's end moves its parent's waiting step. Returns whether it
-- ended the run (false: already terminal).
CREATE FUNCTION buzz_workflows_end_run(cid uuid, rid uuid, st text, code text, msg text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    r record;
    child uuid;
    reason text;
    code_ text;
BEGIN
    PERFORM 1 FROM buzz_workflows_run WHERE community_id = cid AND run_id = rid FOR NO KEY UPDATE;
    IF st <> 'succeeded' THEN
        reason := 'run_' || st;
        UPDATE buzz_workflows_step SET state = 'canceled', lease_generation = lease_generation + 1,
            lease_until = NULL, claimed_at = NULL, wait_deadline = NULL, skip_reason = reason,
            finished_at = buzz_delivery_now()
        WHERE community_id = cid AND run_id = rid AND state NOT IN {T};
        UPDATE buzz_workflows_approval SET state = 'expired', closed_at = buzz_delivery_now()
        WHERE community_id = cid AND run_id = rid AND state = 'pending';
    END IF;
    UPDATE buzz_workflows_run SET state = st, failure_code = code, failure_message = msg,
        finished_at = buzz_delivery_now(),
        output = (SELECT jsonb_object_agg(s.key, s.output) FROM buzz_workflows_step s
                  WHERE s.community_id = cid AND s.run_id = rid AND s.dependents = '{{}}' AND s.state = 'succeeded')
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
            UPDATE buzz_workflows_step SET state = 'succeeded', output = coalesce(r.output, '{{}}'::jsonb),
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

-- Advance: a step became terminal (exactly once: terminal states never change).
CREATE FUNCTION buzz_workflows_advance() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    run_state text;
    left_ integer;
    blocked integer;
    d record;
BEGIN
    UPDATE buzz_workflows_run SET steps_left = steps_left - 1
    WHERE community_id = NEW.community_id AND run_id = NEW.run_id
    RETURNING state, steps_left INTO run_state, left_;
    IF run_state IS DISTINCT FROM 'running' OR NEW.state = 'canceled' THEN
        RETURN NULL;  -- the run already ended (or is ending): nothing more advances
    END IF;
    IF NEW.state = 'failed' AND NEW.on_error = 'fail_run' THEN
        PERFORM buzz_workflows_end_run(NEW.community_id, NEW.run_id, 'failed', 'step_failed',
            format('step %s failed: %s', NEW.key, NEW.failure_code));
        RETURN NULL;
    END IF;
    blocked := CASE WHEN NEW.state = 'skipped' OR (NEW.state = 'failed' AND NEW.on_error = 'skip_dependents')
                    THEN 1 ELSE 0 END;
    FOR d IN UPDATE buzz_workflows_step SET deps_done = deps_done + 1, deps_blocked = deps_blocked + blocked
             WHERE community_id = NEW.community_id AND run_id = NEW.run_id AND key = ANY(NEW.dependents)
               AND state = 'pending'
             RETURNING id, deps_done, deps_total LOOP
        IF d.deps_done = d.deps_total THEN
            PERFORM buzz_workflows_release(NEW.community_id, d.id);
        END IF;
    END LOOP;
    IF left_ = 0 THEN
        PERFORM buzz_workflows_end_run(NEW.community_id, NEW.run_id, 'succeeded', NULL, NULL);
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER buzz_workflows_advance
AFTER UPDATE OF state ON buzz_workflows_step
FOR EACH ROW WHEN (OLD.state NOT IN {T} AND NEW.state IN {T})
EXECUTE FUNCTION buzz_workflows_advance();

-- Fan-in: a delivery of a waiting send_message step became terminal (or was requeued).
CREATE FUNCTION buzz_workflows_count_delivery() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    dt integer;
    df integer;
    s record;
    summary jsonb;
    message text;
BEGIN
    IF NEW.status IN ('finished', 'failed', 'expired') THEN
        dt := 1;
        df := CASE WHEN NEW.status = 'finished' THEN 0 ELSE 1 END;
    ELSE
        dt := -1;
        df := CASE WHEN OLD.status = 'finished' THEN 0 ELSE -1 END;
    END IF;
    -- Lock order: the run first (see the module docstring).
    PERFORM 1 FROM buzz_workflows_run
    WHERE community_id = NEW.community_id AND run_id = NEW.run_id AND state = 'running' FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;  -- not an engine run, or it has ended
    END IF;
    UPDATE buzz_workflows_step AS st
    SET delivered_terminal = st.delivered_terminal + dt, delivered_failed = st.delivered_failed + df
    WHERE st.community_id = NEW.community_id AND st.run_id = NEW.run_id AND st.key = NEW.step_id
      AND st.state = 'waiting' AND st.kind = 'send_message'
    RETURNING st.id, st.expected, st.delivered_terminal, st.delivered_failed, st.tolerate_failures INTO s;
    IF NOT FOUND OR s.delivered_terminal < s.expected THEN
        RETURN NULL;
    END IF;
    -- Values computed first, so the SET clauses below apply no function to a column (SPEC 15).
    summary := jsonb_build_object('delivered', s.expected - s.delivered_failed, 'failed', s.delivered_failed);
    IF s.delivered_failed > s.tolerate_failures THEN
        message := format('%s of %s deliveries failed (%s tolerated)',
                          s.delivered_failed, s.expected, s.tolerate_failures);
        UPDATE buzz_workflows_step SET state = 'failed', failure_code = 'deliveries_failed',
            failure_message = message, output = summary, wait_deadline = NULL, finished_at = buzz_delivery_now()
        WHERE community_id = NEW.community_id AND id = s.id AND state = 'waiting';
    ELSE
        UPDATE buzz_workflows_step SET state = 'succeeded', output = summary,
            wait_deadline = NULL, finished_at = buzz_delivery_now()
        WHERE community_id = NEW.community_id AND id = s.id AND state = 'waiting';
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER buzz_workflows_delivery_fan_in
AFTER UPDATE OF status ON buzz_delivery_delivery
FOR EACH ROW WHEN ((OLD.status IN ('finished', 'failed', 'expired')) IS DISTINCT FROM
                   (NEW.status IN ('finished', 'failed', 'expired')))
EXECUTE FUNCTION buzz_workflows_count_delivery();
"""

DROP_ADVANCE = """
DROP TRIGGER buzz_workflows_delivery_fan_in ON buzz_delivery_delivery;
DROP FUNCTION buzz_workflows_count_delivery();
DROP TRIGGER buzz_workflows_advance ON buzz_workflows_step;
DROP FUNCTION buzz_workflows_advance();
DROP FUNCTION buzz_workflows_end_run(uuid, uuid, text, text, text);
DROP FUNCTION buzz_workflows_release(uuid, uuid);
DROP FUNCTION buzz_workflows_when(uuid, uuid, jsonb);
DROP FUNCTION buzz_workflows_ref(uuid, uuid, text[]);
"""


def _primary_key(table: str, column: str) -> migrations.RunSQL:
    return migrations.RunSQL(
        sql=f"ALTER TABLE {table} DROP CONSTRAINT {table}_pkey, "
        f"ADD CONSTRAINT {table}_pkey PRIMARY KEY (community_id, {column});",
        reverse_sql=f"ALTER TABLE {table} DROP CONSTRAINT {table}_pkey, ADD CONSTRAINT {table}_pkey PRIMARY KEY ({column});",
    )


def _foreign_key(table: str, name: str, cols: str, ref: str) -> migrations.RunSQL:
    return migrations.RunSQL(
        sql=f"ALTER TABLE {table} ADD CONSTRAINT {name} FOREIGN KEY {cols} REFERENCES {ref} ON DELETE CASCADE;",
        reverse_sql=f"ALTER TABLE {table} DROP CONSTRAINT {name};",
    )


class Migration(migrations.Migration):
    dependencies = [("buzz_workflows", "0001_initial"), ("buzz_delivery", "0006_database_clock")]

    operations = [
        *[_primary_key(*spec) for spec in PRIMARY_KEYS],
        *[_foreign_key(*spec) for spec in FOREIGN_KEYS],
        migrations.RunSQL(sql=TOMBSTONE_GUARD, reverse_sql=DROP_TOMBSTONE_GUARD),
        RunSQLOnTheDeliveryTable(sql=ADVANCE, reverse_sql=DROP_ADVANCE),
    ]
