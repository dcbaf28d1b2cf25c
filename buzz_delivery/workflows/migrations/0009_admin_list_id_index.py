"""An index on the run id and one on the step id alone (issue 17: every list stays fast at 1M rows).

The primary keys lead with ``community_id`` (0002), so the admin lists' default order (newest
first by the UUIDv7 id, Django's ``-pk``) sorted the whole table for each page (about 0.8 s per
page at a million runs, 1.5 s for the steps) and a lookup by id alone (a run's detail page, the
run of each listed step or approval) scanned it (0.25 s a row: 14 s for the approvals list).
New ids are the largest, so an insert writes the right-hand leaf of these; no update changes
them (heap-only updates stay possible)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_delivery', '0012_maintenance_run_totals'),
        ('buzz_workflows', '0008_row_level_security'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='run',
            index=models.Index(fields=['run'], name='wf_run_id_idx'),
        ),
        migrations.AddIndex(
            model_name='step',
            index=models.Index(fields=['id'], name='wf_step_id_idx'),
        ),
    ]
