"""An agent run's history on its row (issue 17), as core 0008 does for deliveries: ``renewals``
(heartbeats of the current lease) and ``history`` (the last 50 transitions, appended through core
0008's ``buzz_delivery_history_push`` by the statement that makes each transition; bounded by a
CHECK, append-only by a trigger). The holder is the existing ``worker_id``. Constant defaults:
no table rewrite."""

import django.db.models.lookups
import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_agents', '0002_keys_and_triggers'),
        ('buzz_delivery', '0008_holder_and_history'),
        ('buzz_workflows', '0006_step_holder_and_history'),
    ]

    operations = [
        migrations.AddField(
            model_name='agentrun',
            name='history',
            field=models.JSONField(blank=True, db_default=models.Value([], output_field=models.JSONField()), default=list),
        ),
        migrations.AddField(
            model_name='agentrun',
            name='renewals',
            field=models.IntegerField(db_default=0, default=0),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='agentrun',
            trigger=pgtrigger.compiler.Trigger(name='ag_run_history_append_only', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (NEW.history IS DISTINCT FROM OLD.history AND NOT ((NEW.history - (-1)) = OLD.history OR (jsonb_array_length(OLD.history) >= 50 AND (NEW.history - (-1)) = (OLD.history - 0))))', func="\n            RAISE EXCEPTION USING ERRCODE = 'BD003',\n                MESSAGE = format('buzz_delivery: %s %s: its history only grows by one entry per '\n                                 'statement; past entries are never rewritten', TG_TABLE_NAME, OLD.id);\n        ", hash='31710d70d4561b21e0f0af9bb53f8e2fabb4477b', operation='UPDATE OF "history"', pgid='pgtrigger_ag_run_history_append_only_b981a', table='buzz_agents_run', when='BEFORE')),
        ),
        migrations.AddConstraint(
            model_name='agentrun',
            constraint=models.CheckConstraint(condition=models.Q(('renewals__gte', 0)), name='ag_run_renewals_gte_0'),
        ),
        migrations.AddConstraint(
            model_name='agentrun',
            constraint=models.CheckConstraint(condition=models.Q(django.db.models.lookups.Exact(models.Func(models.F('history'), function='jsonb_typeof', output_field=models.TextField()), 'array'), django.db.models.lookups.LessThanOrEqual(models.Func(models.F('history'), function='jsonb_array_length', output_field=models.IntegerField()), 50)), name='ag_run_history_bounded'),
        ),
    ]
