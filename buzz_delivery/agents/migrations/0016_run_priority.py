"""Agent run priority (issue 32): the accepted delivery's, CHECKed -10..10; the pending-runs index in the claim's order."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_agents', '0015_run_trace_context'),
        ('buzz_delivery', '0023_concurrency_slots'),
        ('buzz_workflows', '0021_run_and_step_priority'),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name='agentrun',
            name='ag_run_pending_idx',
        ),
        migrations.AddField(
            model_name='agentrun',
            name='priority',
            field=models.SmallIntegerField(db_default=0, default=0),
        ),
        migrations.AddIndex(
            model_name='agentrun',
            index=models.Index(condition=models.Q(('state', 'pending')), fields=['community', 'agent_pubkey', '-priority', 'created_at'], name='ag_run_pending_idx'),
        ),
        migrations.AddConstraint(
            model_name='agentrun',
            constraint=models.CheckConstraint(condition=models.Q(('priority__gte', -10), ('priority__lte', 10)), name='ag_run_priority_range'),
        ),
    ]
