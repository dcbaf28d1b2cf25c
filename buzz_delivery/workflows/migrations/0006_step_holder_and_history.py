"""Who holds a step's lease, and the step's history on its row (issue 17), as core 0008 does for
deliveries: ``claimed_by`` (<= 200 characters), ``renewals`` and ``history`` (the last 50
transitions, appended through core 0008's ``buzz_delivery_history_push`` by the statement that
makes each transition; bounded by a CHECK, append-only by a trigger). Constant defaults: no
table rewrite."""

import django.db.models.functions.text
import django.db.models.lookups
import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_delivery', '0008_holder_and_history'),
        ('buzz_workflows', '0005_approvals_for_agent_runs'),
    ]

    operations = [
        migrations.AddField(
            model_name='step',
            name='claimed_by',
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='step',
            name='history',
            field=models.JSONField(blank=True, db_default=models.Value([], output_field=models.JSONField()), default=list),
        ),
        migrations.AddField(
            model_name='step',
            name='renewals',
            field=models.IntegerField(db_default=0, default=0),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='step',
            trigger=pgtrigger.compiler.Trigger(name='wf_step_history_append_only', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (NEW.history IS DISTINCT FROM OLD.history AND NOT ((NEW.history - (-1)) = OLD.history OR (jsonb_array_length(OLD.history) >= 50 AND (NEW.history - (-1)) = (OLD.history - 0))))', func="\n            RAISE EXCEPTION USING ERRCODE = 'BD003',\n                MESSAGE = format('buzz_delivery: %s %s: its history only grows by one entry per '\n                                 'statement; past entries are never rewritten', TG_TABLE_NAME, OLD.id);\n        ", hash='1be53292b142a2bdee7506a85e2e8ab894ff6603', operation='UPDATE OF "history"', pgid='pgtrigger_wf_step_history_append_only_5d1c9', table='buzz_workflows_step', when='BEFORE')),
        ),
        migrations.AddConstraint(
            model_name='step',
            constraint=models.CheckConstraint(condition=models.Q(('claimed_by__isnull', True), django.db.models.lookups.LessThanOrEqual(django.db.models.functions.text.Length('claimed_by'), 200), _connector='OR'), name='wf_step_claimed_by_length'),
        ),
        migrations.AddConstraint(
            model_name='step',
            constraint=models.CheckConstraint(condition=models.Q(('renewals__gte', 0)), name='wf_step_renewals_gte_0'),
        ),
        migrations.AddConstraint(
            model_name='step',
            constraint=models.CheckConstraint(condition=models.Q(django.db.models.lookups.Exact(models.Func(models.F('history'), function='jsonb_typeof', output_field=models.TextField()), 'array'), django.db.models.lookups.LessThanOrEqual(models.Func(models.F('history'), function='jsonb_array_length', output_field=models.IntegerField()), 50)), name='wf_step_history_bounded'),
        ),
    ]
