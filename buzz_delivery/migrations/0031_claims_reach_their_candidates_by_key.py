"""The claims' UPDATE (``buzz_delivery_claim_pending``, ``buzz_delivery_claim_hinted``,
``services/cached.py``) reaches the candidates it locked by primary key in their cached (generic)
plans, whatever the planner estimates of the community: the batch claim joins the candidates both
as rows and as an array of their ids (``sql.CLAIM_FROM``: the planner probes the key from the side
it estimates smaller) and the hinted claim names its row (``d.id = p_delivery_id``)
instead of ``d.id = ANY (ARRAY(SELECT candidate.id FROM candidate))``, an array of unknown length
to the planner, which lost to another index's community prefix whenever the statistics gave a
community few rows (a fleet of small communities): every row of the claiming community read on
every claim (``tests/test_claim_plan_stale_stats.py``; a hinted claim's time grew with its
community in ``bench.run --only wake``). The same claims otherwise. Frozen copies of what
``CachedStatement.create_sql()`` printed when this migration was written; delegated on Citus as
before (``scaleout.delegated_functions``: the signatures are unchanged)."""

import importlib

from django.db import migrations

_0023 = importlib.import_module("buzz_delivery.migrations.0023_concurrency_slots")
_0027 = importlib.import_module("buzz_delivery.migrations.0027_claim_hinted_as_a_function")

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
FROM candidate, unnest(ARRAY(SELECT candidate.id FROM candidate)) AS listed(id)
-- Through the primary key only: no status test here (the CTE locked each candidate FOR UPDATE
-- after re-checking its latest version, so nothing else changed it since), or with stale
-- statistics the pending-only indexes win and every pending row is read (test_claim_plan_stale_stats).
WHERE d.community_id = p_community_id AND d.id = candidate.id AND d.id = listed.id
RETURNING d.*;
END
$fn$;
"""

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
WHERE d.community_id = p_community_id AND d.id = p_delivery_id AND d.id IN (SELECT candidate.id FROM candidate)
RETURNING d.*;
END
$fn$;
"""


class Migration(migrations.Migration):
    dependencies = [("buzz_delivery", "0030_batch_settles_reach_the_batch_by_key")]

    operations = [
        migrations.RunSQL(sql=CLAIM_PENDING, reverse_sql=_0023.CLAIM_PENDING),
        migrations.RunSQL(sql=CLAIM_HINTED, reverse_sql=_0027.CLAIM_HINTED),
    ]
