"""The mixed batch settle (``services.settle_deliveries``: each row its own outcome, texts,
jitter and Retry-After; issue 29) as a plan-cached PL/pgSQL function (``services/cached.py``,
``SETTLE_MANY``): it was sent as a plain statement, parsed and planned on every flush of the
worker's settler and of the gateway's batch finish, and it settled the rows in the order the
UPDATE met them, so two workers settling deliveries of the same workflow runs could deadlock in
the workflow engine's fan-in trigger (issue 31). Like ``buzz_delivery_finish_leases`` (0028) it
first locks its deliveries' runs in run id order when they are of more than one run. The same
settle otherwise. A frozen copy of what ``CachedStatement.create_sql()`` printed when this
migration was written."""

from django.db import migrations

SETTLE_LEASES = r"""
CREATE OR REPLACE FUNCTION buzz_delivery_settle_leases(p_community_id uuid, p_delivery_ids uuid[], p_lease_generations bigint[], p_target_pubkeys bytea[], p_outcomes varchar[], p_failure_codes varchar[], p_failure_messages text[], p_jitters float8[], p_retry_afters float8[], p_backoff_base float8, p_backoff_cap float8)
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
SET status = CASE WHEN s.outcome = 'retry' THEN CASE WHEN (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts) THEN 'failed' ELSE 'pending' END ELSE s.outcome END,
    finished_at = buzz_delivery_when(NOT s.outcome = 'retry' OR (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts), buzz_delivery_now()),
    failure_code = CASE WHEN s.outcome = 'retry' THEN CASE WHEN (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts) THEN 'attempts_exhausted' END
                        ELSE s.failure_code END,
    failure_message = CASE WHEN s.outcome = 'retry' AND NOT (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts) THEN NULL ELSE s.failure_message END,
    next_attempt_at = buzz_delivery_when(
        s.outcome = 'retry' AND NOT (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts), buzz_delivery_plus_seconds(buzz_delivery_now(), GREATEST(LEAST(p_backoff_base * power(2, LEAST(GREATEST(d.attempt - 1, 0), 62)), p_backoff_cap) * s.jitter, s.retry_after))
    ),
    lease_until = NULL,
    claimed_at = NULL,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', (CASE WHEN s.outcome = 'retry' THEN 'retry' ELSE 'settle' END)::text, 'status', (CASE WHEN s.outcome = 'retry' THEN CASE WHEN (d.max_attempts IS NOT NULL AND d.attempt >= d.max_attempts) THEN 'failed' ELSE 'pending' END ELSE s.outcome END)::text, 'actor', (d.claimed_by)::text]) || ('{"generation": ' || (d.lease_generation)::text || ', "renewals": ' || (d.renewals)::text || '}')::jsonb)
FROM unnest(
    p_delivery_ids::uuid[], p_lease_generations::bigint[], p_target_pubkeys::bytea[],
    p_outcomes::varchar[], p_failure_codes::varchar[], p_failure_messages::text[],
    p_jitters::float8[], p_retry_afters::float8[]
) AS s(id, generation, target, outcome, failure_code, failure_message, jitter, retry_after)
WHERE d.community_id = p_community_id
  AND d.id = s.id
  AND d.target_pubkey = s.target
  AND d.lease_generation = s.generation
  AND d.status = 'claimed'
  AND d.lease_until >= buzz_delivery_now()
  AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
RETURNING d.id, d.status;
END
$fn$;
"""

# The signature the delegation names (scaleout.delegated_functions) and the reverse drops.
DROP_SETTLE_LEASES = """
DROP FUNCTION IF EXISTS buzz_delivery_settle_leases(uuid, uuid[], bigint[], bytea[], varchar[], varchar[], text[],
    float8[], float8[], float8, float8);
"""


class Migration(migrations.Migration):
    dependencies = [("buzz_delivery", "0028_batch_settle_locks_runs_in_order")]

    operations = [
        migrations.RunSQL(sql=SETTLE_LEASES, reverse_sql=DROP_SETTLE_LEASES),
    ]
