"""The batch settle (``buzz_delivery_finish_leases``, ``services/cached.py``) locks its deliveries'
runs in run id order before it settles anything, when they are of more than one run
(``sql.LOCK_RUNS_OF_DELIVERIES_IN_FUNCTION``):
two workers settling the deliveries of the same workflow runs (one per target) deadlocked when
their batches met the runs in different orders (issue 31). The same settle otherwise. A frozen
copy of what ``CachedStatement.create_sql()`` printed when this migration was written."""

import importlib

from django.db import migrations

_0019 = importlib.import_module("buzz_delivery.migrations.0019_lease_functions_immutable_history")

FINISH_LEASES = r"""
CREATE OR REPLACE FUNCTION buzz_delivery_finish_leases(p_community_id uuid, p_delivery_ids uuid[], p_lease_generations bigint[], p_target_pubkeys bytea[], p_status varchar, p_failure_code varchar, p_failure_message text)
RETURNS TABLE(id uuid, status varchar) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
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
  AND d.status = 'claimed'
  AND d.lease_until >= buzz_delivery_now()
  AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
RETURNING d.id, d.status;
END
$fn$;
"""


class Migration(migrations.Migration):
    dependencies = [("buzz_delivery", "0027_claim_hinted_as_a_function")]

    operations = [
        migrations.RunSQL(sql=FINISH_LEASES, reverse_sql=_0019.FINISH_LEASES),
    ]
