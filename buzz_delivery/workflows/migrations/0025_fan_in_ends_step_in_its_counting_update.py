"""The delivery fan-in ends a ``send_message`` step in the UPDATE that counts its last delivery
(issue 31, ``bench/results/send-shape.md``).

Before, ``buzz_workflows_count_delivery`` (the AFTER UPDATE OF status trigger on the delivery
table, migrations 0002 and 0023) counted each delivery that became terminal in its step (one
UPDATE of the step row) and, when the count reached ``expected``, ran a second UPDATE of the same
row to ``succeeded`` (or ``failed``: more failures than tolerated). Each of those is a statement
of its own on the step table (27 CHECK constraints prepared per statement, 11 indexes opened),
and the second wrote a second version of the row. Now the counting UPDATE also lists ``state``
(unchanged by it), and a BEFORE trigger on the step table, ``buzz_workflows_fan_in_end``, ends
the step in that same UPDATE when the counters reach ``expected``: one statement, one version.

The outcome is the one the second UPDATE wrote: the output ``{"delivered", "failed"}``, the
wait deadline cleared, ``finished_at`` from the database clock, ``failed`` with
``deliveries_failed`` and its message past ``tolerate_failures``. The Advance trigger (AFTER
UPDATE OF state, fired because the UPDATE lists ``state``) then runs as before. The lock order
is unchanged (the run first, then the step). The agents' freeze of the counters of a step that
awaits agent runs (``buzz_agents_freeze_delivery_counters``, BEFORE, agents migration 0002) runs
before this trigger (triggers of one kind fire in name order): a frozen count does not move, and
the trigger's WHEN requires a moved count, so such a step is not ended here, as before.

Only the fan-in writes the counters (the park sets ``expected``, never the counters), so the
BEFORE trigger fires only there. SPEC 15: no UPDATE applies a function to a column in its SET
list (the trigger sets ``NEW`` fields); the UPDATE names the row's community, as before.
"""

from django.db import migrations

FAN_IN = """
CREATE OR REPLACE FUNCTION buzz_workflows_count_delivery() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    dt integer;
    df integer;
BEGIN
    IF NEW.status IN ('finished', 'failed', 'expired') THEN
        dt := 1;
        df := CASE WHEN NEW.status = 'finished' THEN 0 ELSE 1 END;
    ELSE
        dt := -1;
        df := CASE WHEN OLD.status = 'finished' THEN 0 ELSE -1 END;
    END IF;
    -- Lock order: the run first (see migration 0002).
    PERFORM 1 FROM buzz_workflows_run
    WHERE community_id = NEW.community_id AND run_id = NEW.run_id AND state = 'running' FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;  -- not an engine run, or it has ended
    END IF;
    -- `state` is listed (unchanged) so that the step's AFTER UPDATE OF state triggers (Advance)
    -- see the end that buzz_workflows_fan_in_end (BEFORE) writes when the count is full.
    UPDATE buzz_workflows_step AS st
    SET delivered_terminal = st.delivered_terminal + dt, delivered_failed = st.delivered_failed + df,
        state = st.state
    WHERE st.community_id = NEW.community_id AND st.run_id = NEW.run_id AND st.key = NEW.step_id
      AND st.state = 'waiting' AND st.kind = 'send_message';
    RETURN NULL;
END;
$$;

CREATE FUNCTION buzz_workflows_fan_in_end() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.output := jsonb_build_object('delivered', NEW.expected - NEW.delivered_failed, 'failed', NEW.delivered_failed);
    NEW.wait_deadline := NULL;
    NEW.finished_at := buzz_delivery_now();
    IF NEW.delivered_failed > NEW.tolerate_failures THEN
        NEW.state := 'failed';
        NEW.failure_code := 'deliveries_failed';
        NEW.failure_message := format('%s of %s deliveries failed (%s tolerated)',
                                      NEW.delivered_failed, NEW.expected, NEW.tolerate_failures);
    ELSE
        NEW.state := 'succeeded';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER buzz_workflows_fan_in_end
BEFORE UPDATE OF delivered_terminal ON buzz_workflows_step
FOR EACH ROW WHEN (NEW.kind = 'send_message' AND OLD.state = 'waiting' AND NEW.state = 'waiting'
                   AND NEW.delivered_terminal IS DISTINCT FROM OLD.delivered_terminal
                   AND NEW.delivered_terminal >= NEW.expected)
EXECUTE FUNCTION buzz_workflows_fan_in_end();
"""

# Migration 0002's function (0023 changed only the trigger's WHEN).
REVERSE = """
DROP TRIGGER buzz_workflows_fan_in_end ON buzz_workflows_step;
DROP FUNCTION buzz_workflows_fan_in_end();
CREATE OR REPLACE FUNCTION buzz_workflows_count_delivery() RETURNS trigger
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
    PERFORM 1 FROM buzz_workflows_run
    WHERE community_id = NEW.community_id AND run_id = NEW.run_id AND state = 'running' FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    UPDATE buzz_workflows_step AS st
    SET delivered_terminal = st.delivered_terminal + dt, delivered_failed = st.delivered_failed + df
    WHERE st.community_id = NEW.community_id AND st.run_id = NEW.run_id AND st.key = NEW.step_id
      AND st.state = 'waiting' AND st.kind = 'send_message'
    RETURNING st.id, st.expected, st.delivered_terminal, st.delivered_failed, st.tolerate_failures INTO s;
    IF NOT FOUND OR s.delivered_terminal < s.expected THEN
        RETURN NULL;
    END IF;
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
"""


class Migration(migrations.Migration):
    dependencies = [("buzz_workflows", "0024_advance_releases_in_one_update")]

    operations = [migrations.RunSQL(sql=FAN_IN, reverse_sql=REVERSE)]
