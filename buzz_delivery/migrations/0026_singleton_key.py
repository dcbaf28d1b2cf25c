"""Debounce / singleton deliveries (issue 32, services/singleton.py, docs/flow-control.md): the
producer's ``singleton_key`` (CHECKed to 1..64 characters of A-Z a-z 0-9 _ . : -), immutable like
the binding (the binding trigger now names it), and the partial UNIQUE index that keeps one
never-claimed pending delivery per (community, target, key); it leads with community_id (SPEC 15)."""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("buzz_delivery", "0025_rate_limits"),
    ]

    operations = [
        pgtrigger.migrations.RemoveTrigger(
            model_name="workflowagentdelivery",
            name="delivery_binding_immutable",
        ),
        migrations.AddField(
            model_name="workflowagentdelivery",
            name="singleton_key",
            field=models.CharField(blank=True, editable=False, max_length=64, null=True),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowagentdelivery",
            trigger=pgtrigger.compiler.Trigger(
                name="delivery_binding_immutable",
                sql=pgtrigger.compiler.UpsertTriggerSql(
                    func="\n            RAISE EXCEPTION USING ERRCODE = 'BD003',\n                MESSAGE = format('buzz_delivery: delivery %s: its binding and snapshots never '\n                                 'change; state changes go through buzz_delivery.services', OLD.id);\n        ",
                    hash="165d173c0307ed72e098f497c71120a375befd37",
                    operation='UPDATE OF "id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id", "message_event_id", "cause_kind", "cause_event_id", "cause_scheduled_for", "cause_webhook_invocation_id", "execution_trace", "trigger_context", "singleton_key"',
                    pgid="pgtrigger_delivery_binding_immutable_d935b",
                    table="buzz_delivery_delivery",
                    when="BEFORE",
                ),
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowagentdelivery",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("singleton_key__isnull", True),
                    ("singleton_key__regex", "^[A-Za-z0-9_.:-]{1,64}$"),
                    _connector="OR",
                ),
                name="delivery_singleton_key_format",
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowagentdelivery",
            constraint=models.UniqueConstraint(
                condition=models.Q(("lease_generation", 0), ("singleton_key__isnull", False), ("status", "pending")),
                fields=("community", "target_pubkey", "singleton_key"),
                name="delivery_singleton_pending_key",
            ),
        ),
    ]
