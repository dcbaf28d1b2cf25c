"""An index on the agent run id alone (issue 17: every list stays fast at 1M rows).

The primary key leads with ``community_id`` (0002), so the admin list's default order (newest
first by the UUIDv7 id, Django's ``-pk``) sorted the whole table for each page (0.8 s at a
million runs, 1.2 s for page 50) and the detail page's lookup by id scanned it. New ids are the
largest, so an insert writes the right-hand leaf; no update changes the id."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_agents', '0006_workflow_cancel_expires_approvals'),
        ('buzz_delivery', '0012_maintenance_run_totals'),
        ('buzz_workflows', '0008_row_level_security'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='agentrun',
            index=models.Index(fields=['id'], name='ag_run_id_idx'),
        ),
    ]
