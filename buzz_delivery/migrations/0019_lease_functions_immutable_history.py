"""The claim and both settles (``buzz_delivery.services.cached``) again, with their history
entries built by IMMUTABLE operations over the row's columns (``sql.history_object``): the
STABLE ``jsonb_build_object`` over columns in SET is refused by Citus, so every lease statement
stopped on a cluster (issue 30). The same entries as before. A frozen copy of what
``CachedStatement.create_sql()`` printed when this migration was written."""

import importlib

from django.db import migrations

_0017 = importlib.import_module("buzz_delivery.migrations.0017_lease_statements_as_functions")

CLAIM_PENDING = r"""
CREATE OR REPLACE FUNCTION buzz_delivery_claim_pending(p_community_id uuid, p_target_pubkey bytea, p_limit bigint, p_lease_seconds float8, p_holder text)
RETURNS SETOF buzz_delivery_delivery LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
WITH candidate AS MATERIALIZED (
    SELECT d.id
    FROM buzz_delivery_delivery AS d
    WHERE d.community_id = p_community_id
      AND d.target_pubkey = p_target_pubkey
      AND d.status = 'pending'
      AND (d.next_attempt_at IS NULL OR d.next_attempt_at <= buzz_delivery_now())
      AND (d.expires_at IS NULL OR d.expires_at > buzz_delivery_now())
      AND (d.max_attempts IS NULL OR d.attempt < d.max_attempts)
      
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
    ORDER BY d.created_at, d.id
    LIMIT p_limit
    FOR UPDATE OF d SKIP LOCKED
)
UPDATE buzz_delivery_delivery AS d
SET status = 'claimed',
    lease_generation = d.lease_generation + 1,
    attempt = d.attempt + 1,
    claimed_at = buzz_delivery_now(),
    lease_until = LEAST(buzz_delivery_now() + make_interval(secs => p_lease_seconds), d.expires_at),
    next_attempt_at = NULL,
    claimed_by = p_holder,
    renewals = 0,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('claim')::text, 'status', ('claimed')::text, 'actor', (p_holder::text)::text]) || ('{"generation": ' || (d.lease_generation + 1)::text || ', "attempt": ' || (d.attempt + 1)::text || '}')::jsonb)
-- Through the primary key only: no status test here (the CTE locked each candidate FOR UPDATE
-- after re-checking its latest version, so nothing else changed it since), or with stale
-- statistics the pending-only indexes win and every pending row is read (test_claim_plan_stale_stats).
WHERE d.community_id = p_community_id AND d.id = ANY (ARRAY(SELECT candidate.id FROM candidate))
RETURNING d.*;
END
$fn$;
"""

FINISH_LEASE = r"""
CREATE OR REPLACE FUNCTION buzz_delivery_finish_lease(p_community_id uuid, p_delivery_id uuid, p_target_pubkey bytea, p_lease_generation bigint, p_status varchar, p_failure_code varchar, p_failure_message text)
RETURNS TABLE(status varchar) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
UPDATE buzz_delivery_delivery AS d
SET status = p_status,
    finished_at = buzz_delivery_now(),
    lease_until = NULL,
    claimed_at = NULL,
    failure_code = p_failure_code,
    failure_message = p_failure_message,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('settle')::text, 'status', (p_status::varchar)::text, 'actor', (d.claimed_by)::text]) || ('{"generation": ' || (d.lease_generation)::text || ', "renewals": ' || (d.renewals)::text || '}')::jsonb)
WHERE 
    d.community_id = p_community_id
    AND d.id = p_delivery_id
    AND d.target_pubkey = p_target_pubkey
    AND d.lease_generation = p_lease_generation
    AND d.status = 'claimed'
    AND d.lease_until >= buzz_delivery_now()
    AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')

RETURNING d.status;
END
$fn$;
"""

FINISH_LEASES = r"""
CREATE OR REPLACE FUNCTION buzz_delivery_finish_leases(p_community_id uuid, p_delivery_ids uuid[], p_lease_generations bigint[], p_target_pubkeys bytea[], p_status varchar, p_failure_code varchar, p_failure_message text)
RETURNS TABLE(id uuid, status varchar) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
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
    dependencies = [("buzz_delivery", "0018_delivery_run_name")]

    operations = [
        migrations.RunSQL(sql=CLAIM_PENDING, reverse_sql=_0017.CLAIM_PENDING),
        migrations.RunSQL(sql=FINISH_LEASE, reverse_sql=_0017.FINISH_LEASE),
        migrations.RunSQL(sql=FINISH_LEASES, reverse_sql=_0017.FINISH_LEASES),
    ]
