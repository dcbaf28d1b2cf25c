"""The Advance trigger makes a successor ``ready`` in the UPDATE that counts its last dependency
(issue 31, ``bench/results/engine-server-cpu.md``).

Before, each completed step's Advance counted itself in its successors (``deps_done + 1``, one
UPDATE) and then, for every successor whose count was full, called ``buzz_workflows_release``:
a PL/pgSQL call that read the step again and UPDATEd it a second time to ``ready``. Measured on
DBOS's 4-step diamond, that call and its read and second UPDATE (a second non-HOT version of the
row, a new entry in every index of the step table) were the largest single part of the engine's
server CPU: ~0.9 of ~3.9 ms per run. Now the counting UPDATE sets ``state = 'ready'`` and
``ready_at`` itself when the count becomes full and nothing else decides the step (no dependency
blocked it, no ``when`` condition): one version, one statement. A successor whose count becomes
full with a blocked dependency or a ``when`` condition is released by ``buzz_workflows_release``
as before (skipped, or its condition evaluated), which is unchanged. The wake-up is the same: one
``pg_notify`` per Advance that made a step ready, unless the transaction deferred it
(``buzz_workflows.notify_deferred``, migration 0013).

And a step without dependents (a sink, e.g. the diamond's last step) runs no successor UPDATE.

The run table keeps 30% of each page free (``fillfactor = 70``): every step's Advance UPDATEs
its run's ``steps_left``, a column no index holds, so the new version can stay on its page (a
HOT update: no entry in any of the run table's eleven indexes, two of them GIN) if the page has
room; runs are inserted one after another, so a full page had none and about half of those
updates wrote a new entry in every index (measured: 1.7 of a diamond run's 5 updates HOT at
``fillfactor`` 100, 3.6 at 70; the fifth, ending the run, changes ``state``, which the partial
indexes name). Pages written before keep their fill until rewritten.

SPEC 15: the clock is read once into a variable before the UPDATE (no CASE holds a clock
expression, no STABLE function is applied to a column in the SET list), and the UPDATE names
the row's community, as before.
"""

from django.db import migrations

ADVANCE = """
CREATE OR REPLACE FUNCTION buzz_workflows_advance() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    run_state text;
    left_ integer;
    blocked integer;
    now_ timestamptz;
    woke boolean := false;
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
        PERFORM buzz_workflows_end_run(NEW.community_id, NEW.run_id, 'succeeded', NULL, NULL);
    END IF;
    RETURN NULL;
END;
$$;
"""

PREVIOUS = """
CREATE OR REPLACE FUNCTION buzz_workflows_advance() RETURNS trigger
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
"""


class Migration(migrations.Migration):
    dependencies = [("buzz_workflows", "0023_fan_in_only_engine_messages")]

    operations = [
        migrations.RunSQL(sql=ADVANCE, reverse_sql=PREVIOUS),
        migrations.RunSQL(
            sql="ALTER TABLE buzz_workflows_run SET (fillfactor = 70)",
            reverse_sql="ALTER TABLE buzz_workflows_run RESET (fillfactor)",
        ),
    ]
