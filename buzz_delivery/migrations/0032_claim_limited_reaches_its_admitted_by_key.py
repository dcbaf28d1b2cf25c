"""The claim under concurrency limits (``buzz_delivery_claim_limited``, ``services/flow.py``,
``services/cached.py``) reaches the rows it admitted by primary key in its cached (generic) plan,
whatever the planner estimates of the community: its UPDATE joins the candidates, the admitted
and the admitted's ids as an array (``FROM candidate, admitted, unnest(ARRAY(SELECT admitted.id
FROM admitted)) AS listed(id)``), so the plan probes the key from whichever it estimates smaller,
as the plain claims do since 0031 and the engine's claims under limits since workflows 0028. It
joined ``admitted`` alone, which lost to another index's community prefix when the statistics
gave a community few rows (a fleet of small communities) and to a hash join over a sequential
scan of the community when one target's large backlog had been analysed: every row of the
claiming community read on every claim (``tests/test_claim_limited_plan.py``). The same claim
and the same slots otherwise. A frozen copy of what ``CachedStatement.create_sql()`` printed
when this migration was written; delegated on Citus as before (the signature is unchanged)."""

import importlib

from django.db import migrations

_0024 = importlib.import_module("buzz_delivery.migrations.0024_claim_under_limits_as_a_function")

CLAIM_LIMITED = r"""
CREATE OR REPLACE FUNCTION buzz_delivery_claim_limited(p_community_id uuid, p_target_pubkey bytea, p_limit bigint, p_lease_seconds float8, p_holder text, p_cap_community integer, p_cap_target integer, p_cap_workflow integer)
RETURNS SETOF buzz_delivery_delivery LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(1651862577, hashtext(p_community_id::text));
    RETURN QUERY
WITH candidate AS MATERIALIZED (
    SELECT d.id, d.priority, d.created_at, d.target_pubkey, d.workflow_id
    FROM buzz_delivery_delivery AS d
    WHERE d.community_id = p_community_id
      AND d.target_pubkey = p_target_pubkey
      AND d.status = 'pending'
      AND (d.next_attempt_at IS NULL OR d.next_attempt_at <= buzz_delivery_now())
      AND (d.expires_at IS NULL OR d.expires_at > buzz_delivery_now())
      AND (d.max_attempts IS NULL OR d.attempt < d.max_attempts)
      
      AND EXISTS (SELECT 1 FROM buzz_delivery_community c WHERE c.id = d.community_id AND c.deletion_state = 'active')
    ORDER BY d.priority DESC, d.created_at, d.id
    LIMIT LEAST(p_limit, p_cap_community, p_cap_target)
    FOR UPDATE OF d SKIP LOCKED
),
ranked AS MATERIALIZED (
    SELECT c.id, c.target_pubkey, c.workflow_id,
           row_number() OVER (ORDER BY c.priority DESC, c.created_at, c.id) AS community_rank,
           row_number() OVER (PARTITION BY c.target_pubkey ORDER BY c.priority DESC, c.created_at, c.id) AS target_rank,
           row_number() OVER (PARTITION BY c.workflow_id ORDER BY c.priority DESC, c.created_at, c.id) AS workflow_rank
    FROM candidate AS c
),
community_free AS MATERIALIZED (
    SELECT g.slot, row_number() OVER (ORDER BY g.slot) AS rank
    FROM generate_series(0, p_cap_community - 1) AS g(slot)
    WHERE NOT EXISTS (
        SELECT 1 FROM buzz_delivery_delivery AS h
        WHERE h.community_id = p_community_id AND h.status = 'claimed' AND h.slot_community = g.slot
    )
),
target_free AS MATERIALIZED (
    SELECT k.target_pubkey, g.slot, row_number() OVER (PARTITION BY k.target_pubkey ORDER BY g.slot) AS rank
    FROM (SELECT DISTINCT target_pubkey FROM candidate) AS k, generate_series(0, p_cap_target - 1) AS g(slot)
    WHERE NOT EXISTS (
        SELECT 1 FROM buzz_delivery_delivery AS h
        WHERE h.community_id = p_community_id AND h.target_pubkey = k.target_pubkey AND h.status = 'claimed' AND h.slot_target = g.slot
    )
),
workflow_free AS MATERIALIZED (
    SELECT k.workflow_id, g.slot, row_number() OVER (PARTITION BY k.workflow_id ORDER BY g.slot) AS rank
    FROM (SELECT DISTINCT workflow_id FROM candidate) AS k, generate_series(0, p_cap_workflow - 1) AS g(slot)
    WHERE NOT EXISTS (
        SELECT 1 FROM buzz_delivery_delivery AS h
        WHERE h.community_id = p_community_id AND h.workflow_id = k.workflow_id AND h.status = 'claimed' AND h.slot_workflow = g.slot
    )
),
admitted AS MATERIALIZED (
    SELECT r.id, community_free.slot AS slot_community, target_free.slot AS slot_target, workflow_free.slot AS slot_workflow
    FROM ranked AS r
    LEFT JOIN community_free ON community_free.rank = r.community_rank
    LEFT JOIN target_free ON target_free.rank = r.target_rank AND target_free.target_pubkey = r.target_pubkey
    LEFT JOIN workflow_free ON workflow_free.rank = r.workflow_rank AND workflow_free.workflow_id = r.workflow_id
    WHERE (p_cap_community IS NULL OR community_free.slot IS NOT NULL) AND (p_cap_target IS NULL OR target_free.slot IS NOT NULL) AND (p_cap_workflow IS NULL OR workflow_free.slot IS NOT NULL)
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
    slot_community = admitted.slot_community,
    slot_target = admitted.slot_target,
    slot_workflow = admitted.slot_workflow,
    history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now()) || jsonb_object(ARRAY['event', ('claim')::text, 'status', ('claimed')::text, 'actor', (p_holder::text)::text]) || ('{"generation": ' || (d.lease_generation + 1)::text || ', "attempt": ' || (d.attempt + 1)::text || '}')::jsonb)
FROM candidate, admitted, unnest(ARRAY(SELECT admitted.id FROM admitted)) AS listed(id)
WHERE d.community_id = p_community_id AND d.id = candidate.id AND d.id = admitted.id AND d.id = listed.id
RETURNING d.*;
END
$fn$;
"""


class Migration(migrations.Migration):
    dependencies = [("buzz_delivery", "0031_claims_reach_their_candidates_by_key")]

    operations = [
        migrations.RunSQL(sql=CLAIM_LIMITED, reverse_sql=_0024.CLAIM_LIMITED),
    ]
