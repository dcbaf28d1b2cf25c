# A release inside a transaction that claims what it releases does not NOTIFY (issue 12).
#
# The orchestrator's completer records a batch of step outputs and, in the same transaction,
# claims the steps the Advance trigger released (complete_and_claim_steps). It sets the
# transaction-local setting NOTIFY_DEFERRED first; buzz_workflows_release then leaves the wake-up
# to it, and it NOTIFYs only when ready steps are left over that it did not claim. Without the
# setting every release wakes every orchestrator, which all claim at once for steps that one of
# them takes (measured: 6.5 claim statements per 4-step run with 4 orchestrators). Any role can
# set it: it only decides who is woken, never what a claim may take (polling covers a lost wake).

from django.db import migrations

RELEASE = """
CREATE OR REPLACE FUNCTION buzz_workflows_release(cid uuid, sid uuid) RETURNS void
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
        IF current_setting('buzz_workflows.notify_deferred', true) IS DISTINCT FROM 'on' THEN
            PERFORM pg_notify('buzz_workflows', cid::text);
        END IF;
    END IF;
END;
$$;
"""

PREVIOUS = RELEASE.replace(
    """        IF current_setting('buzz_workflows.notify_deferred', true) IS DISTINCT FROM 'on' THEN
            PERFORM pg_notify('buzz_workflows', cid::text);
        END IF;
""",
    """        PERFORM pg_notify('buzz_workflows', cid::text);
""",
)


class Migration(migrations.Migration):
    dependencies = [("buzz_workflows", "0012_write_fence_runs_one_shared_function")]

    operations = [migrations.RunSQL(sql=RELEASE, reverse_sql=PREVIOUS)]
