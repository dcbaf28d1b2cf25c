"""Partial indexes for the agent runs list's filters on rare values (issue 17: every list stays fast at 1M rows).

``state=failed``, ``state=waiting_approval`` and ``shadow=yes`` match a few rows spread over the
whole table: the list's capped count (at most 10,001 rows) read most or all of it (0.25-0.3 s
at a million runs, pages of 0.3-0.5 s). Each index holds only the runs in that state (written
when a run enters it; waiting_approval ones leave it again) or the shadow runs."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_agents', '0007_admin_list_id_index'),
        ('buzz_delivery', '0012_maintenance_run_totals'),
        ('buzz_workflows', '0009_admin_list_id_index'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='agentrun',
            index=models.Index(condition=models.Q(('state', 'failed')), fields=['id'], name='ag_run_failed_idx'),
        ),
        migrations.AddIndex(
            model_name='agentrun',
            index=models.Index(condition=models.Q(('state', 'waiting_approval')), fields=['id'], name='ag_run_waiting_approval_idx'),
        ),
        migrations.AddIndex(
            model_name='agentrun',
            index=models.Index(condition=models.Q(('shadow', True)), fields=['id'], name='ag_run_shadow_idx'),
        ),
    ]
