"""What Django cannot declare for the agent tables (SPEC sections 11, 12 and 15):

- primary keys that lead with ``community_id`` (the ORM still treats ``id`` as the key);
- composite, tenant-consistent foreign keys ``(community_id, x) REFERENCES t (community_id, id)``:
  journal, intake keys -> agent run (CASCADE); agent run -> the core workflow run it came from
  (CASCADE) and -> its engine approval (SET NULL of the approval column only); step waits ->
  the engine step (CASCADE). Two are checked at commit (DEFERRABLE): an intake key is written
  before its run (the key decides who creates the run) and a run parks before its approval row;
  step waits ->
  the engine step (CASCADE);
- the tombstone guard for these tables;
- the journal sequence: an inserted entry's ``seq`` must be the run's ``tool_calls_used`` (bumped
  by one, fenced, in the same transaction) and one past the run's last entry (contiguous from 1);
- approval resume: when an engine approval that an agent run waits on is closed (decided by
  ``decide_approval``, expired by either maintenance or a cancel), in the same transaction its
  journal entry is answered and the run becomes claimable (``pending``) again, exactly once;
  an expired approval makes the run unwind (compensate, then ``failed``/``approval_expired``);
- the way back to the workflow: a ``send_message`` step with ``await: agent_run`` gets a
  ``buzz_agents_step_wait`` row when it parks; the engine's delivery counters of that step are
  frozen (its delivery fan-in never ends it); each of its deliveries that fails or expires, and
  each agent run started from one of them that becomes terminal, is counted in the transaction
  that made it so, and the last one ends the step with the outputs keyed by target hex;
- a canceled workflow run cancels its agent runs (generation + 1) in the same transaction.

Lock order on the way back: the engine run row first (``FOR NO KEY UPDATE``), then the wait
row and the step, as the engine's own fan-in does.
"""

from django.db import migrations

from buzz_delivery.delivery_table import RunSQLOnTheDeliveryTable

PRIMARY_KEYS = ["buzz_agents_run", "buzz_agents_journal", "buzz_agents_intake_key", "buzz_agents_step_wait"]

FOREIGN_KEYS = [
    (
        "buzz_agents_run",
        "ag_run_source_run_same_community",
        "(community_id, source_run_id)",
        "buzz_delivery_workflow_run (community_id, id) ON DELETE CASCADE",
    ),
    (
        "buzz_agents_run",
        "ag_run_approval_same_community",
        "(community_id, approval_id)",
        "buzz_workflows_approval (community_id, id) ON DELETE SET NULL (approval_id) DEFERRABLE INITIALLY DEFERRED",
    ),
    (
        "buzz_agents_journal",
        "ag_journal_run_same_community",
        "(community_id, run_id)",
        "buzz_agents_run (community_id, id) ON DELETE CASCADE",
    ),
    (
        "buzz_agents_journal",
        "ag_journal_approval_same_community",
        "(community_id, approval_id)",
        "buzz_workflows_approval (community_id, id) ON DELETE SET NULL (approval_id) DEFERRABLE INITIALLY DEFERRED",
    ),
    (
        "buzz_agents_intake_key",
        "ag_intake_run_same_community",
        "(community_id, run_id)",
        "buzz_agents_run (community_id, id) ON DELETE CASCADE DEFERRABLE INITIALLY DEFERRED",
    ),
    (
        "buzz_agents_step_wait",
        "ag_step_wait_step_same_community",
        "(community_id, step_id)",
        "buzz_workflows_step (community_id, id) ON DELETE CASCADE",
    ),
]

TOMBSTONE_GUARD = """
CREATE FUNCTION buzz_agents_refuse_tombstone() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM buzz_agents_journal WHERE community_id = OLD.id)
       OR EXISTS (SELECT 1 FROM buzz_agents_intake_key WHERE community_id = OLD.id)
       OR EXISTS (SELECT 1 FROM buzz_agents_step_wait WHERE community_id = OLD.id)
       OR EXISTS (SELECT 1 FROM buzz_agents_run WHERE community_id = OLD.id) THEN
        RAISE EXCEPTION USING ERRCODE = 'BD002',
            MESSAGE = format('buzz_delivery: community %s still holds agent run rows; '
                             'purge it before it becomes tombstone', OLD.id);
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER buzz_agents_tombstone_guard
BEFORE UPDATE OF deletion_state ON buzz_delivery_community
FOR EACH ROW WHEN (NEW.deletion_state = 'tombstone' AND OLD.deletion_state IS DISTINCT FROM 'tombstone')
EXECUTE FUNCTION buzz_agents_refuse_tombstone();
"""
DROP_TOMBSTONE_GUARD = """
DROP TRIGGER buzz_agents_tombstone_guard ON buzz_delivery_community;
DROP FUNCTION buzz_agents_refuse_tombstone();
"""

JOURNAL_SEQUENCE = """
CREATE FUNCTION buzz_agents_journal_seq() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    used integer;
    last_ integer;
BEGIN
    SELECT tool_calls_used INTO used FROM buzz_agents_run
    WHERE community_id = NEW.community_id AND id = NEW.run_id;
    SELECT max(seq) INTO last_ FROM buzz_agents_journal
    WHERE community_id = NEW.community_id AND run_id = NEW.run_id;
    IF used IS NULL OR NEW.seq IS DISTINCT FROM used OR NEW.seq <> coalesce(last_, 0) + 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'BD003',
            MESSAGE = format('buzz_agents: journal seq %s is not the run''s next (counter %s, last %s)',
                             NEW.seq, used, last_);
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER buzz_agents_journal_seq
BEFORE INSERT ON buzz_agents_journal
FOR EACH ROW EXECUTE FUNCTION buzz_agents_journal_seq();
"""
DROP_JOURNAL_SEQUENCE = """
DROP TRIGGER buzz_agents_journal_seq ON buzz_agents_journal;
DROP FUNCTION buzz_agents_journal_seq();
"""

APPROVAL_RESUME = """
CREATE FUNCTION buzz_agents_approval_closed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE buzz_agents_journal AS j
    SET status = CASE WHEN NEW.state = 'expired' THEN 'failed' ELSE 'succeeded' END,
        output = jsonb_build_object('decision', NEW.state, 'decided_by', NEW.decided_by),
        error = CASE WHEN NEW.state = 'expired' THEN 'approval_expired' END,
        finished_at = NEW.closed_at
    WHERE j.community_id = NEW.community_id AND j.approval_id = NEW.id AND j.status = 'pending';
    IF NEW.state = 'expired' THEN
        UPDATE buzz_agents_run AS r
        SET state = 'pending', unwinding = true, failure_code = 'approval_expired',
            failure_message = 'no decision before the approval deadline', next_attempt_at = NULL
        WHERE r.community_id = NEW.community_id AND r.approval_id = NEW.id AND r.state = 'waiting_approval';
    ELSE
        UPDATE buzz_agents_run AS r SET state = 'pending', next_attempt_at = NULL
        WHERE r.community_id = NEW.community_id AND r.approval_id = NEW.id AND r.state = 'waiting_approval';
    END IF;
    PERFORM pg_notify('buzz_agents', NEW.community_id::text);
    RETURN NULL;
END;
$$;
CREATE TRIGGER buzz_agents_approval_closed
AFTER UPDATE OF state ON buzz_workflows_approval
FOR EACH ROW WHEN (OLD.state = 'pending' AND NEW.state <> 'pending' AND NEW.step_id IS NULL)
EXECUTE FUNCTION buzz_agents_approval_closed();
"""
DROP_APPROVAL_RESUME = """
DROP TRIGGER buzz_agents_approval_closed ON buzz_workflows_approval;
DROP FUNCTION buzz_agents_approval_closed();
"""

WAY_BACK = """
-- A send_message step parked: with await agent_run it gets its wait row.
CREATE FUNCTION buzz_agents_step_parked() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE mode text;
BEGIN
    SELECT elem->>'await' INTO mode
    FROM buzz_workflows_run r
    JOIN buzz_workflows_definition d ON d.community_id = r.community_id AND d.id = r.definition_id
    CROSS JOIN LATERAL jsonb_array_elements(d.content->'steps') AS elem
    WHERE r.community_id = NEW.community_id AND r.run_id = NEW.run_id AND elem->>'key' = NEW.key;
    IF mode = 'agent_run' THEN
        INSERT INTO buzz_agents_step_wait (id, community_id, step_id, run_id, step_key, expected, done, failed,
                                           tolerate_failures, outputs)
        VALUES (gen_random_uuid(), NEW.community_id, NEW.id, NEW.run_id, NEW.key, coalesce(NEW.expected, 0), 0, 0,
                NEW.tolerate_failures, '{}'::jsonb)
        ON CONFLICT (community_id, step_id) DO NOTHING;
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER buzz_agents_step_parked
AFTER UPDATE OF state ON buzz_workflows_step
FOR EACH ROW WHEN (NEW.state = 'waiting' AND OLD.state IS DISTINCT FROM 'waiting' AND NEW.kind = 'send_message')
EXECUTE FUNCTION buzz_agents_step_parked();

-- The engine's delivery fan-in never ends a step that awaits agent runs: its counters stay put.
CREATE FUNCTION buzz_agents_freeze_delivery_counters() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM buzz_agents_step_wait w WHERE w.community_id = NEW.community_id AND w.step_id = NEW.id) THEN
        NEW.delivered_terminal := OLD.delivered_terminal;
        NEW.delivered_failed := OLD.delivered_failed;
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER buzz_agents_freeze_delivery_counters
BEFORE UPDATE OF delivered_terminal, delivered_failed ON buzz_workflows_step
FOR EACH ROW WHEN (NEW.kind = 'send_message' AND NEW.state = 'waiting')
EXECUTE FUNCTION buzz_agents_freeze_delivery_counters();

-- Count one unit (an agent run that became terminal, or a delivery that failed or expired) of
-- an awaiting step; the last one ends the step (the engine's Advance then runs).
CREATE FUNCTION buzz_agents_count_unit(cid uuid, rid uuid, skey text, target text, is_failure boolean, out_ jsonb)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE w record;
BEGIN
    PERFORM 1 FROM buzz_workflows_run WHERE community_id = cid AND run_id = rid AND state = 'running'
    FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN;  -- not an engine run, or it has ended
    END IF;
    UPDATE buzz_agents_step_wait AS sw
    SET done = sw.done + 1, failed = sw.failed + (CASE WHEN is_failure THEN 1 ELSE 0 END),
        outputs = sw.outputs || jsonb_build_object(target, out_)
    WHERE sw.community_id = cid AND sw.run_id = rid AND sw.step_key = skey AND sw.done < sw.expected
      AND NOT sw.outputs ? target
    RETURNING sw.step_id, sw.expected, sw.done, sw.failed, sw.tolerate_failures, sw.outputs INTO w;
    IF NOT FOUND OR w.done < w.expected THEN
        RETURN;
    END IF;
    IF w.failed > w.tolerate_failures THEN
        UPDATE buzz_workflows_step SET state = 'failed', failure_code = 'agent_runs_failed',
            failure_message = format('%s of %s agent runs failed (%s tolerated)', w.failed, w.expected,
                                     w.tolerate_failures),
            output = w.outputs, wait_deadline = NULL, finished_at = buzz_delivery_now()
        WHERE community_id = cid AND id = w.step_id AND state = 'waiting';
    ELSE
        UPDATE buzz_workflows_step SET state = 'succeeded', output = w.outputs, wait_deadline = NULL,
            finished_at = buzz_delivery_now()
        WHERE community_id = cid AND id = w.step_id AND state = 'waiting';
    END IF;
END;
$$;

CREATE FUNCTION buzz_agents_run_ended() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM buzz_agents_count_unit(
        NEW.community_id, NEW.source_run_id, NEW.source_step_key, encode(NEW.agent_pubkey, 'hex'),
        NEW.state <> 'completed',
        CASE WHEN NEW.state = 'completed' THEN coalesce(NEW.output, 'null'::jsonb)
             ELSE jsonb_build_object('state', NEW.state, 'failure_code', NEW.failure_code) END);
    RETURN NULL;
END;
$$;
CREATE TRIGGER buzz_agents_run_ended
AFTER UPDATE OF state ON buzz_agents_run
FOR EACH ROW WHEN (NEW.source_run_id IS NOT NULL
                   AND NEW.state IN ('completed', 'failed', 'cancelled', 'timeout')
                   AND OLD.state NOT IN ('completed', 'failed', 'cancelled', 'timeout'))
EXECUTE FUNCTION buzz_agents_run_ended();

CREATE FUNCTION buzz_agents_delivery_lost() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM buzz_agents_count_unit(
        NEW.community_id, NEW.run_id, NEW.step_id, encode(NEW.target_pubkey, 'hex'), true,
        jsonb_build_object('state', 'delivery_' || NEW.status, 'failure_code', NEW.failure_code));
    RETURN NULL;
END;
$$;
CREATE TRIGGER buzz_agents_delivery_lost
AFTER UPDATE OF status ON buzz_delivery_delivery
FOR EACH ROW WHEN (NEW.status IN ('failed', 'expired') AND OLD.status NOT IN ('finished', 'failed', 'expired'))
EXECUTE FUNCTION buzz_agents_delivery_lost();

-- A canceled workflow run cancels the agent runs it started (their holders fail closed).
CREATE FUNCTION buzz_agents_workflow_canceled() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE buzz_agents_run AS r
    SET state = 'cancelled', lease_generation = r.lease_generation + 1, lease_until = NULL, claimed_at = NULL,
        unwinding = false, failure_code = 'workflow_canceled', failure_message = NULL,
        finished_at = buzz_delivery_now()
    WHERE r.community_id = NEW.community_id AND r.source_run_id = NEW.run_id
      AND r.state NOT IN ('completed', 'failed', 'cancelled', 'timeout');
    RETURN NULL;
END;
$$;
CREATE TRIGGER buzz_agents_workflow_canceled
AFTER UPDATE OF state ON buzz_workflows_run
FOR EACH ROW WHEN (NEW.state = 'canceled' AND OLD.state IS DISTINCT FROM 'canceled')
EXECUTE FUNCTION buzz_agents_workflow_canceled();
"""
DROP_WAY_BACK = """
DROP TRIGGER buzz_agents_workflow_canceled ON buzz_workflows_run;
DROP FUNCTION buzz_agents_workflow_canceled();
DROP TRIGGER buzz_agents_delivery_lost ON buzz_delivery_delivery;
DROP FUNCTION buzz_agents_delivery_lost();
DROP TRIGGER buzz_agents_run_ended ON buzz_agents_run;
DROP FUNCTION buzz_agents_run_ended();
DROP FUNCTION buzz_agents_count_unit(uuid, uuid, text, text, boolean, jsonb);
DROP TRIGGER buzz_agents_freeze_delivery_counters ON buzz_workflows_step;
DROP FUNCTION buzz_agents_freeze_delivery_counters();
DROP TRIGGER buzz_agents_step_parked ON buzz_workflows_step;
DROP FUNCTION buzz_agents_step_parked();
"""


def _primary_key(table: str) -> migrations.RunSQL:
    return migrations.RunSQL(
        sql=f"ALTER TABLE {table} DROP CONSTRAINT {table}_pkey, ADD CONSTRAINT {table}_pkey PRIMARY KEY (community_id, id);",
        reverse_sql=f"ALTER TABLE {table} DROP CONSTRAINT {table}_pkey, ADD CONSTRAINT {table}_pkey PRIMARY KEY (id);",
    )


def _foreign_key(table: str, name: str, cols: str, ref: str) -> migrations.RunSQL:
    return migrations.RunSQL(
        sql=f"ALTER TABLE {table} ADD CONSTRAINT {name} FOREIGN KEY {cols} REFERENCES {ref};",
        reverse_sql=f"ALTER TABLE {table} DROP CONSTRAINT {name};",
    )


class Migration(migrations.Migration):
    dependencies = [
        ("buzz_agents", "0001_initial"),
        ("buzz_workflows", "0005_approvals_for_agent_runs"),
        ("buzz_delivery", "0007_scale_out_keys_and_fence"),
    ]

    operations = [
        *[_primary_key(t) for t in PRIMARY_KEYS],
        *[_foreign_key(*spec) for spec in FOREIGN_KEYS],
        migrations.RunSQL(sql=TOMBSTONE_GUARD, reverse_sql=DROP_TOMBSTONE_GUARD),
        migrations.RunSQL(sql=JOURNAL_SEQUENCE, reverse_sql=DROP_JOURNAL_SEQUENCE),
        migrations.RunSQL(sql=APPROVAL_RESUME, reverse_sql=DROP_APPROVAL_RESUME),
        RunSQLOnTheDeliveryTable(sql=WAY_BACK, reverse_sql=DROP_WAY_BACK),
    ]
