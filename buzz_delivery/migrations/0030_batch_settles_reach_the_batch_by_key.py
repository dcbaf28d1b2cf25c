"""The batch settles (``buzz_delivery_finish_leases``, ``buzz_delivery_settle_leases``,
``services/cached.py``) reach their batch through the primary key in their cached (generic)
plans, whatever the statistics: their status fence is written as ``sql.CLAIMED_BY_KEY`` (the
same test), which the planner cannot match to ``delivery_claimed_lease_idx``. Their generic plans
read every row claimed in the community through that index and joined the batch (2,000 claimed:
0.80 ms a 50-row settle against 0.25 ms by key, bench/results/worker-k4.md). The same settles
otherwise, the runs still locked first in run order (0028). Frozen copies of what
``CachedStatement.create_sql()`` printed when this migration was written; delegated on Citus as
before (``scaleout.delegated_functions``: the signatures are unchanged)."""

import importlib

from django.db import migrations

_0028 = importlib.import_module("buzz_delivery.migrations.0028_batch_settle_locks_runs_in_order")
_0029 = importlib.import_module("buzz_delivery.migrations.0029_mixed_batch_settle_as_a_function")

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
  AND d.status = 'claimed' COLLATE "C"
  AND d.lease_until >= buzz_delivery_now()
  AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
RETURNING d.id, d.status;
END
$fn$;
"""

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
  AND d.status = 'claimed' COLLATE "C"
  AND d.lease_until >= buzz_delivery_now()
  AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
RETURNING d.id, d.status;
END
$fn$;
"""


class Migration(migrations.Migration):
    dependencies = [("buzz_delivery", "0029_mixed_batch_settle_as_a_function")]

    operations = [
        migrations.RunSQL(sql=FINISH_LEASES, reverse_sql=_0028.FINISH_LEASES),
        migrations.RunSQL(sql=SETTLE_LEASES, reverse_sql=_0029.SETTLE_LEASES),
    ]
