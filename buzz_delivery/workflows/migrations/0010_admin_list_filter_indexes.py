"""A partial index for the steps list's ``state=failed`` filter (issue 17: every list stays fast at 1M rows).

Failed steps are few and spread over the whole table: the list's capped count (at most 10,001
rows) found fewer than its cap and so read every row (0.35 s at a million steps). Only failed
steps are in this index, each written once (failed is terminal)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_delivery', '0012_maintenance_run_totals'),
        ('buzz_workflows', '0009_admin_list_id_index'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='step',
            index=models.Index(condition=models.Q(('state', 'failed')), fields=['id'], name='wf_step_failed_idx'),
        ),
    ]
