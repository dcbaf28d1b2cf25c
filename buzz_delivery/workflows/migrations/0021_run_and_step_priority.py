"""Run and step priority (issue 32): a CHECKed -10..10 on runs (set at start, carried by child runs
and restarts) and their steps; the ready-steps index in the claim's order (priority DESC, ready_at)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_delivery', '0023_concurrency_slots'),
        ('buzz_workflows', '0020_run_trace_context'),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name='step',
            name='wf_step_ready_idx',
        ),
        migrations.AddField(
            model_name='run',
            name='priority',
            field=models.SmallIntegerField(db_default=0, default=0),
        ),
        migrations.AddField(
            model_name='step',
            name='priority',
            field=models.SmallIntegerField(db_default=0, default=0),
        ),
        migrations.AddIndex(
            model_name='step',
            index=models.Index(condition=models.Q(('state', 'ready')), fields=['community', '-priority', 'ready_at'], name='wf_step_ready_idx'),
        ),
        migrations.AddConstraint(
            model_name='run',
            constraint=models.CheckConstraint(condition=models.Q(('priority__gte', -10), ('priority__lte', 10)), name='wf_run_priority_range'),
        ),
        migrations.AddConstraint(
            model_name='step',
            constraint=models.CheckConstraint(condition=models.Q(('priority__gte', -10), ('priority__lte', 10)), name='wf_step_priority_range'),
        ),
    ]
