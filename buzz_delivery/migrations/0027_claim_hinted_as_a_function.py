"""The claim of one hinted delivery as a plan-cached PL/pgSQL function (issue 31,
``services/cached.py``): the worker's wake path claims the delivery a hint names through it, so
the claim is no longer parsed and planned anew on every hint (about 0.3 ms of a warm backend's
time, the largest part of the claim). A frozen copy of what ``CachedStatement.create_sql()``
printed when this migration was written."""

from django.db import migrations

CLAIM_HINTED = r"""
CREATE OR REPLACE FUNCTION buzz_delivery_claim_hinted(p_community_id uuid, p_target_pubkey bytea, p_delivery_id uuid, p_limit bigint, p_lease_seconds float8, p_holder text)
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
      AND d.id = p_delivery_id
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
    ORDER BY d.priority DESC, d.created_at, d.id
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
    slot_community = NULL,
    slot_target = NULL,
    slot_workflow = NULL,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('claim')::text, 'status', ('claimed')::text, 'actor', (p_holder::text)::text]) || ('{"generation": ' || (d.lease_generation + 1)::text || ', "attempt": ' || (d.attempt + 1)::text || '}')::jsonb)
-- Through the primary key only: no status test here (the CTE locked each candidate FOR UPDATE
-- after re-checking its latest version, so nothing else changed it since), or with stale
-- statistics the pending-only indexes win and every pending row is read (test_claim_plan_stale_stats).
WHERE d.community_id = p_community_id AND d.id = ANY (ARRAY(SELECT candidate.id FROM candidate))
RETURNING d.*;
END
$fn$;
"""


class Migration(migrations.Migration):
    dependencies = [("buzz_delivery", "0026_singleton_key")]

    operations = [
        migrations.RunSQL(
            sql=CLAIM_HINTED,
            reverse_sql="DROP FUNCTION buzz_delivery_claim_hinted(p_community_id uuid, p_target_pubkey bytea, p_delivery_id uuid, p_limit bigint, p_lease_seconds float8, p_holder text);",
        ),
    ]
