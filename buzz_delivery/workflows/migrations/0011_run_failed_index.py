"""A partial index for the runs list's ``state=failed`` filter (issue 17: every list stays fast at 1M rows).

Failed runs are a few percent spread over the whole table: the list's capped count (at most
10,001 rows) read about a quarter of it at a million runs (90 ms alone, pages of 0.15-0.5 s on
the shared machine). Only failed runs are in this index, each written once (failed is terminal),
as for the steps (0010)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_delivery', '0012_maintenance_run_totals'),
        ('buzz_workflows', '0010_admin_list_filter_indexes'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='run',
            index=models.Index(condition=models.Q(('state', 'failed')), fields=['run'], name='wf_run_failed_idx'),
        ),
    ]
