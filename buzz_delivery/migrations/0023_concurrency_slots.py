"""Concurrency limits by key (issue 32, services/flow.py): the slot columns, their range and one
partial UNIQUE index per kind of key over the claimed deliveries."""

import importlib

from django.db import migrations, models

_0022 = importlib.import_module("buzz_delivery.migrations.0022_delivery_priority")

# The plan-cached claim clears the slots (a claim under no limit holds none): a frozen copy of
# what ``CachedStatement.create_sql()`` printed when this migration was written.
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
-- Through the primary key only: no status test here (the CTE locked each candidate FOR UPDATE
-- after re-checking its latest version, so nothing else changed it since), or with stale
-- statistics the pending-only indexes win and every pending row is read (test_claim_plan_stale_stats).
WHERE d.community_id = p_community_id AND d.id = ANY (ARRAY(SELECT candidate.id FROM candidate))
RETURNING d.*;
END
$fn$;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("buzz_delivery", "0022_delivery_priority"),
    ]

    operations = [
        migrations.AddField(
            model_name="workflowagentdelivery",
            name="slot_community",
            field=models.SmallIntegerField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="workflowagentdelivery",
            name="slot_target",
            field=models.SmallIntegerField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="workflowagentdelivery",
            name="slot_workflow",
            field=models.SmallIntegerField(blank=True, editable=False, null=True),
        ),
        migrations.AddConstraint(
            model_name="workflowagentdelivery",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("slot_community__isnull", True),
                    models.Q(("slot_community__gte", 0), ("slot_community__lt", 1000)),
                    _connector="OR",
                ),
                name="delivery_slot_community_range",
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowagentdelivery",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("slot_target__isnull", True),
                    models.Q(("slot_target__gte", 0), ("slot_target__lt", 1000)),
                    _connector="OR",
                ),
                name="delivery_slot_target_range",
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowagentdelivery",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("slot_workflow__isnull", True),
                    models.Q(("slot_workflow__gte", 0), ("slot_workflow__lt", 1000)),
                    _connector="OR",
                ),
                name="delivery_slot_workflow_range",
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowagentdelivery",
            constraint=models.UniqueConstraint(
                condition=models.Q(("slot_community__isnull", False), ("status", "claimed")),
                fields=("community", "slot_community"),
                name="delivery_slot_community_key",
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowagentdelivery",
            constraint=models.UniqueConstraint(
                condition=models.Q(("slot_target__isnull", False), ("status", "claimed")),
                fields=("community", "target_pubkey", "slot_target"),
                name="delivery_slot_target_key",
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowagentdelivery",
            constraint=models.UniqueConstraint(
                condition=models.Q(("slot_workflow__isnull", False), ("status", "claimed")),
                fields=("community", "workflow", "slot_workflow"),
                name="delivery_slot_workflow_key",
            ),
        ),
        migrations.RunSQL(sql=CLAIM_PENDING, reverse_sql=_0022.CLAIM_PENDING),
    ]
